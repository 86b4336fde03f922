"""OpenAI-compatible HTTP server with DFlash inside: ``python -m dflash_gguf.server --pair DIR``.

Endpoints
    POST /v1/completions, POST /v1/chat/completions   OpenAI request/response shapes; ``stream: true``
        sends server-sent events ``data: {chunk}`` ... ``data: [DONE]``. Every response (and the last
        chunk of a stream) carries a top-level ``dflash`` object (acceptance_length, drafted, accepted,
        steps, tokens_per_second, ...), ``null`` when the request was served by plain decoding.
    POST /v1/responses  OpenAI's Responses API (``input``, ``instructions``, ``max_output_tokens``, function
        ``tools``, ``text.format``, ``stream``: its ``response.*`` events); ``previous_response_id`` continues a
        stored response (the last 256, in memory; ``GET``/``DELETE /v1/responses/{id}``).
    POST /v1/messages   Anthropic's Messages API (``system``, ``max_tokens``, ``stop_sequences``, ``tools`` ->
        ``tool_use`` blocks, ``stream``: message_start ... message_stop; Anthropic's error shape), and
        ``/v1/messages/count_tokens``. Both are served by the chat route (``translate``): the same answers.
    POST /v1/embeddings OpenAI's shape (``input``: text(s) or token ids; ``encoding_format`` float or base64):
        mean-pooled states from a context of their own on the same weights, made at the first request.
    POST /tokenize, /detokenize                  llama-server's shapes (``content``, ``add_special``,
        ``parse_special``, ``with_pieces``; ``tokens``).
    POST /extras/tokenize, /extras/tokenize/count, /extras/detokenize   llama_cpp.server's shapes.
    GET /v1/models      the one model this server holds.
    GET /health         ``{"status": "ok", "model", "dflash", "busy", "waiting"}``.
    GET /metrics        Prometheus text format (``?format=json`` for JSON): requests by endpoint and
        status, tokens, DFlash steps/drafted/accepted, mean acceptance length, tokens/s, fallbacks,
        client disconnects.

Concurrency: one model and one llama.cpp context per server. With slots (``parallel``; the command line's
default, 4 as llama-server's ``-np -1``) completions and chats are decoded together in the batched engine
(:mod:`dflash_gguf.server.slots`), which borrows the model's own context as one KV cache of ``n_ctx`` cells
shared by the slots - no second copy of the target's state. Requests the slots do not serve, and every
request without slots, are served one at a time in arrival order (an asyncio lock, held for the whole
request including every chunk of a stream) with the cache to themselves (the slots finish what runs first:
llama_cpp's own path removes positions of every sequence); llama.cpp runs on one dedicated worker thread, so
/health, /metrics and /v1/models answer while a generation runs. A client that disconnects, streaming or not,
stops its generation at
the next token (``Llama.interrupt``); the DFlash engine rolls both caches back and the next request
is served normally.

Limits (``create_app(max_queue=, request_timeout=)``, ``--max-queue``, ``--request-timeout``):
    * when ``max_queue`` requests already wait for the model, a new one gets **503** at once
      (``Retry-After: 1``);
    * a request not finished ``request_timeout`` seconds after it arrived (waiting included) is
      stopped and gets **408** (``x-should-retry: false``, so OpenAI clients do not resend work that
      already timed out); a stream past its first chunk has sent its status line, so it gets an
      ``error`` event (code 408) instead and ends. 408, not 504: no upstream server is involved,
      the time limit is this server's own.

Streams: ``stream_options: {"include_usage": true}`` sends, before ``[DONE]``, one more chunk with
``choices: []`` and ``usage`` (and the ``dflash`` object), and ``"usage": null`` in the others, as
OpenAI does.

Not supported, with a 400: ``n`` or ``best_of`` > 1 (llama_cpp.server silently returns one choice),
``suffix`` (llama_cpp 0.3.36 builds fill-in-the-middle prompts with placeholder token id 0),
``logprobs`` / ``top_logprobs`` without ``--parallel`` unless the model keeps every position's logits
(``--logits-all``, as in llama_cpp: then they are served with DFlash); with ``--parallel`` the slots serve
them either way (the generated tokens' log-probabilities from the rows the engine verified, in llama_cpp's
format; streamed, each chunk carries those of the tokens whose text it completes), except for an echoed
prompt's, which need ``--logits-all`` and a text prompt. ``echo`` works as in llama_cpp, and with a
token-id prompt too (its text detokenized; llama_cpp 0.3.36 fails on it).

Errors are JSON ``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (validation,
context overflow, an unknown field), 404/405 for unknown routes, 408/503 as above, 500 only for
server faults; under /v1/messages, Anthropic's ``{"type": "error", "error": {"type", "message"}}`` with the
same statuses. ``--api-key`` is taken from ``Authorization: Bearer`` or ``x-api-key`` (Anthropic's clients).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from typing import Any, Callable, Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dflash_gguf import __version__
from dflash_gguf.requests.responses import usage_chunk
from dflash_gguf.requests.stops import stop_list
from dflash_gguf.server.metrics import Metrics
from dflash_gguf.server.responses import (POLL_S, BadRequest, ServingError, error_body, error_response, plain_json,
                                          validation_message)
from dflash_gguf.server.schemas import ChatRequest, CompletionRequest
from dflash_gguf.native.threads import SerialWorker

log = logging.getLogger("dflash_gguf.server")
_END = object()


# --------------------------------------------------------------------------- serving state
class _Lease:
    """A running stream's claim on the model: closing it (once) ends the generation and frees the lock."""

    def __init__(self, server: "_Server", it: Iterator | None):
        self.server, self.it, self.done = server, it, False

    def release(self) -> None:
        if self.done:
            return
        self.done = True
        self.server.metrics.in_flight -= 1
        self.server.release(self.it)


class _Server:
    def __init__(self, llm, model_id: str, max_queue: int | None = None, request_timeout: float | None = None):
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if request_timeout is not None and request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
        self.llm = llm
        self.model_id = model_id
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.interrupt = getattr(llm, "interrupt", None)   # dflash_gguf.Llama: stop at the next token
        self._tasks: set[asyncio.Task] = set()
        self.created = int(time.time())
        self.lock = asyncio.Lock()
        # the only thread touching llm, at a time: it ends when idle, so that its OpenMP pool does not slow the
        # slots' engine thread once it is done (dflash_gguf.native.threads)
        self.worker = SerialWorker(name="llama")
        self.metrics = Metrics()
        self.waiting = 0
        self.slots = None          # --parallel N: the batched engine (dflash_gguf.server.slots.Slots)
        self._lend = None          # ... its cache, while a request on llama_cpp's own path holds the lock
        self.eog: list[int] | None = None   # the model's end-of-generation ids, once a request needs them
        self.embedder = None       # /v1/embeddings: a context of its own, made at the first request (extras)

    async def run(self, fn: Callable, *args):
        return await asyncio.wrap_future(self.worker.submit(fn, *args))

    def admit(self, busy: bool | None = None, waiting: int | None = None, what: str = "the model") -> None:
        """503 when the request would wait (``busy``: the model is in use) and ``max_queue`` requests
        already wait for it (the slots pass their own state)."""
        busy = self.lock.locked() if busy is None else busy
        waiting = self.waiting if waiting is None else waiting
        if self.max_queue is not None and busy and waiting >= self.max_queue:
            self.metrics.rejected += 1
            raise ServingError(503, f"server busy: {waiting} request(s) already waiting for {what} "
                                    f"(--max-queue {self.max_queue}); retry later", "server_busy", "queue_full",
                               {"Retry-After": "1"})

    def failed(self, endpoint: str, exc: BaseException) -> JSONResponse:
        """The error response for ``exc``, counted in the metrics."""
        resp = error_response(exc)
        self.metrics.request(endpoint, resp.status_code)
        return resp

    def timed_out(self) -> ServingError:
        self.metrics.timeouts += 1
        return ServingError(408, f"request timed out after {self.request_timeout:g} s (--request-timeout); "
                                 "its generation was stopped", "timeout_error", "request_timeout",
                            {"x-should-retry": "false"})

    async def acquire(self, deadline: float | None = None) -> None:
        """The model to this request: the lock, and where the slots share the model's context, the cache
        (the slots finish what runs first: :meth:`Slots.lend`)."""
        self.waiting += 1
        try:
            if deadline is None:
                await self.lock.acquire()
            else:
                await asyncio.wait_for(self.lock.acquire(), max(0.0, deadline - time.monotonic()))
            if self.slots is not None:
                try:
                    self._lend = await self.slots.lend(deadline)
                except BaseException:
                    self.lock.release()
                    raise
        except asyncio.TimeoutError:
            raise self.timed_out() from None
        finally:
            self.waiting -= 1

    async def watch(self, fn: Callable, args: tuple, request: Request, deadline: float | None):
        """Run ``fn(*args)`` on the worker; ``(result, None)``, or ``(None, "disconnect" | "timeout")`` as
        soon as the client is gone or the deadline passed (the generation is interrupted; the worker
        finishes the call in the background, before any later job)."""
        fut = asyncio.wrap_future(self.worker.submit(fn, *args))
        while True:
            done, _ = await asyncio.wait({fut}, timeout=POLL_S)
            if done:
                return fut.result(), None
            why = None
            if deadline is not None and time.monotonic() >= deadline:
                why = "timeout"
            elif await request.is_disconnected():
                why = "disconnect"
            if why is not None:
                if self.interrupt is not None:
                    task = asyncio.ensure_future(self._interrupt_until_done(fut))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                fut.add_done_callback(_quiet)   # its result or error is no longer wanted
                return None, why

    async def _interrupt_until_done(self, fut) -> None:
        """Keep the stop flag raised until the job ends (a call that had not started yet clears it when
        it starts). The next request's job cannot start before ``fut`` is done: it needs the lock."""
        while not fut.done():
            self.interrupt()
            await asyncio.sleep(POLL_S)

    def release(self, it: Iterator | None = None) -> None:
        """Close ``it`` on the worker (after any call still running there), then free the lock."""
        loop = asyncio.get_running_loop()

        def job():
            try:
                if it is not None and hasattr(it, "close"):
                    it.close()        # the DFlash engine rolls its caches back to the consumed tokens
            except Exception:
                log.exception("closing a generation failed")
            finally:
                lend, self._lend = self._lend, None
                if lend is not None:
                    lend.back.set()     # the slots have the cache again
                loop.call_soon_threadsafe(self.lock.release)

        self.worker.submit(job)

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request, endpoint: str, call: Callable[[], Any], stream: bool,
                       include_usage: bool = False):
        """Run ``call`` (a create_* call of the Llama) with the model to itself; JSON or an SSE stream."""
        self.metrics.in_flight += 1
        leased = False
        deadline = time.monotonic() + self.request_timeout if self.request_timeout else None
        try:
            self.admit()
            await self.acquire(deadline)
            if not stream:
                try:
                    result, why = await self.watch(call, (), request, deadline)
                finally:
                    self.release()
                if why is not None:
                    return self._stopped(endpoint, why)
                self.metrics.generation(result.get("dflash"), result.get("usage"))
                self.metrics.request(endpoint, 200)
                return JSONResponse(plain_json(result))
            it = None
            try:
                it = await self.run(call)
                first, why = await self.watch(next, (it, _END), request, deadline)   # errors before it: HTTP errors
            except BaseException:
                self.release(it)
                raise
            if why is not None:
                self.release(it)
                return self._stopped(endpoint, why)
            lease, leased = _Lease(self, it), True
            self.metrics.request(endpoint, 200)
            return _SSEResponse(self._events(request, lease, first, deadline, include_usage), lease)
        except Exception as e:
            return self.failed(endpoint, e)
        finally:
            if not leased:
                self.metrics.in_flight -= 1

    def _stopped(self, endpoint: str, why: str) -> JSONResponse:
        if why == "timeout":
            resp = error_response(self.timed_out())
        else:                      # nobody reads this answer; 499 as nginx logs a client that closed
            self.metrics.disconnects += 1
            log.info("client disconnected: generation stopped")
            resp = JSONResponse(error_body("client closed the request", "invalid_request_error"), status_code=499)
        self.metrics.request(endpoint, resp.status_code)
        return resp

    async def _events(self, request: Request, lease: _Lease, first, deadline: float | None, include_usage: bool):
        chunk, last = first, None
        try:
            while chunk is not _END:
                usage = chunk.pop("usage", None)     # dflash_gguf.Llama puts it on a stream's finish chunk
                if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is not None:
                    usage = usage or getattr(self.llm, "last_usage", None)   # ... or, without a drafter, here
                    self.metrics.generation(chunk.get("dflash"), usage)
                    last = (chunk, usage)
                if include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(plain_json(chunk))}\n\n"
                if await request.is_disconnected():
                    why = "disconnect"
                else:
                    chunk, why = await self.watch(next, (lease.it, _END), request, deadline)
                if why == "disconnect":
                    self.metrics.disconnects += 1
                    log.info("client disconnected: generation stopped")
                    return
                if why == "timeout":
                    err = self.timed_out()
                    yield f"data: {json.dumps(error_body(str(err), err.type, None, 408))}\n\n"
                    return
            if include_usage and last is not None:
                fin, usage = last
                yield f"data: {json.dumps(usage_chunk(fin, usage))}\n\n"
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:   # Starlette saw the disconnect first and cancelled the stream
            self.metrics.disconnects += 1
            raise
        except Exception as e:   # after the first chunk the status line is sent: report in the stream
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(str(e), 'server_error'))}\n\n"
        finally:
            lease.release()


def _quiet(fut) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("an interrupted generation ended with %r", fut.exception())


class _SSEResponse(StreamingResponse):
    """Server-sent events whose lease is released even if the body is never iterated."""

    def __init__(self, content, lease: _Lease):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._lease = lease

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._lease.release()


# --------------------------------------------------------------------------- app
def _grammar(llm, text: str | None):
    if text is None:
        return None
    from dflash_gguf.native.llama import llama_grammar

    from dflash_gguf.api import check_grammar

    grammar = llama_grammar.LlamaGrammar.from_string(text, verbose=False)
    try:
        check_grammar(llm, grammar)   # llama_cpp would crash the process on a grammar it cannot parse
    except ValueError as e:
        raise BadRequest(f"{e}", "grammar") from e
    return grammar


def shaped(request: Request, resp: JSONResponse) -> JSONResponse:
    """An error response in the shape of the API the request's path belongs to (Anthropic's for /v1/messages)."""
    from dflash_gguf.server.translate import anthropic_error

    return anthropic_error(resp) if request.url.path.startswith("/v1/messages") else resp


AUTO_SLOTS = 4     # --parallel -1 (the default): llama-server's automatic slot count, one KV cache of -c cells
OPEN_PATHS = frozenset({"/health"})     # answered without an API key (load balancers, probes)


def authorized(header: str | None, api_key: str) -> bool:
    """``Authorization: Bearer <api_key>``, compared in constant time."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def create_app(llm, model_id: str | None = None, *, max_queue: int | None = None,
               request_timeout: float | None = None, api_key: str | None = None, parallel: int | None = None) -> FastAPI:
    """A FastAPI app serving ``llm`` (a :class:`dflash_gguf.Llama`, or any ``llama_cpp.Llama``).

    ``max_queue``: requests allowed to wait for the model (more get 503; None: no limit).
    ``request_timeout``: seconds a request may take from arrival to its end (408; None: no limit).
    ``api_key``: every request but ``/health`` must carry ``Authorization: Bearer <api_key>`` (401
    otherwise, with an OpenAI-style error); None or empty: no key.
    ``parallel``: sequences decoded together (:mod:`dflash_gguf.server.slots`; needs a
    :class:`dflash_gguf.Llama`): requests the batched engine serves run there, N per step, the rest
    (an echoed prompt's logprobs, chat formats without a known formatter) on ``llm`` one at a time with the
    cache to themselves. -1: ``AUTO_SLOTS`` (4), llama-server's ``-np -1`` and the command line's default.
    The slots borrow ``llm``'s own context, made again as one unified KV cache of its ``n_ctx`` cells for N
    sequences (:meth:`dflash_gguf.Llama.serve_sequences`; so ``n_ctx`` is what all slots share, as
    llama-server's ``-c``); a Llama that cannot share gets slot contexts of their own (N x n_ctx cells).
    None or 0 (the default here: the caller's Llama is left as it was made): every request on ``llm``,
    one at a time.
    With a plain ``llama_cpp.Llama`` a timed-out or abandoned generation runs to its end unseen.
    """
    from pathlib import Path

    model_id = model_id or Path(llm.model_path).stem
    srv = _Server(llm, model_id, max_queue=max_queue, request_timeout=request_timeout)
    if parallel == -1:
        parallel = AUTO_SLOTS
    if parallel:
        if not hasattr(llm, "dflash_info"):
            raise ValueError("parallel slots need a dflash_gguf.Llama")
        from dflash_gguf.server.slots import Slots

        srv.slots = Slots(llm, parallel)
        srv.metrics.slots = srv.slots

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if srv.slots is not None:
            srv.slots.close()   # the engine thread ends, its contexts are freed
        if srv.embedder is not None:
            srv.embedder.close()

    app = FastAPI(title="dflash-gguf", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server with lossless DFlash speculative decoding")
    app.state.server = srv

    if api_key:
        @app.middleware("http")
        async def _key(request: Request, call_next):
            if request.url.path in OPEN_PATHS or authorized(request.headers.get("authorization"), api_key) \
                    or authorized("Bearer " + request.headers.get("x-api-key", ""), api_key):
                return await call_next(request)
            srv.metrics.request(request.url.path, 401)
            return shaped(request, JSONResponse(
                error_body("Incorrect or missing API key: send the header 'Authorization: Bearer <key>' or "
                           "'x-api-key: <key>' (the key the server was started with)",
                           "invalid_request_error", None, "invalid_api_key"),
                status_code=401, headers={"WWW-Authenticate": "Bearer"}))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        srv.metrics.request(request.url.path, 400)
        return JSONResponse(error_body(msg, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return shaped(request, JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code))

    @app.exception_handler(ValueError)
    async def _bad_value(request: Request, exc: ValueError):
        srv.metrics.request(request.url.path, 400)
        return error_response(exc)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        return error_response(exc)

    @app.get("/health")
    async def health():
        out = {"status": "ok", "model": model_id, "dflash": _dflash_info(llm), "busy": srv.lock.locked(),
               "waiting": srv.waiting}
        if srv.slots is not None:
            f = srv.slots.figures()
            out["slots"] = {k: f[k] for k in ("total", "busy", "waiting")}
        return out

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": srv.created,
                                            "owned_by": "dflash-gguf", "dflash": _dflash_info(llm)}]}

    @app.get("/metrics")
    async def metrics(format: str = "prometheus"):
        if format == "json":
            return srv.metrics.as_dict()
        return PlainTextResponse(srv.metrics.prometheus(), media_type="text/plain; version=0.0.4")

    def no_eog(kw: dict) -> None:
        """llama-server's ``ignore_eos``: the end-of-generation tokens masked (constraints.masked)."""
        from dflash_gguf.decoding.constraints import masked
        from dflash_gguf.native.engine import end_of_generation_ids

        if srv.eog is None:
            srv.eog = end_of_generation_ids(llm._model.vocab, llm.n_vocab())
        kw["logit_bias"] = masked(kw.get("logit_bias"), srv.eog)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        kw = body.sampling_kwargs()
        if body.ignore_eos:
            no_eog(kw)
        kw.update(max_tokens=body.max_tokens if body.max_tokens is not None else 16, echo=body.echo,
                  logprobs=body.logprobs, stream=body.stream, model=model_id)
        grammar = _grammar(llm, body.grammar)
        if grammar is not None:
            kw["grammar"] = grammar
        prompt = body.prompt
        _check_prompt(llm, prompt)
        echo = prompt if body.echo else None      # the text a non-streamed completion starts with
        if body.echo and not isinstance(prompt, str):
            # llama_cpp 0.3.36 fails on echo of a token-id prompt (it adds the id list to the text: a 500
            # before): the prompt's text is echoed here, detokenized
            if body.logprobs is not None:
                raise BadRequest("logprobs with echo=true need a text prompt: llama_cpp cannot echo a token-id "
                                 "prompt with its logprobs", "echo")
            echo = llm.detokenize(list(prompt)).decode("utf-8", errors="ignore")
            kw["echo"] = False
        if srv.slots is not None and srv.slots.eligible(kw):
            from dflash_gguf.server import slots as S

            # as llama_cpp's create_completion tokenizes it
            ids = list(prompt) if not isinstance(prompt, str) else \
                llm.tokenize(prompt.encode("utf-8"), special=True) if prompt else [llm.token_bos()]
            job = S.make_job(srv.slots, asyncio.get_running_loop(), ids, kw, stop_list(kw.get("stop")), chat=False,
                             offset0=len(prompt))
            if echo is not None and not body.stream:
                job.echo = echo      # llama_cpp: text = prompt + completion; its streams leave the prompt out
            return await S.serve(srv, request, "/v1/completions", job, body.stream, body.include_usage(), False)
        call = lambda: llm.create_completion(prompt, **kw)  # noqa: E731
        if echo is not None and not kw["echo"] and not body.stream:
            call = lambda: _echoed(llm.create_completion(prompt, **kw), echo)  # noqa: E731
        return await srv.generate(request, "/v1/completions", call, body.stream, body.include_usage())

    async def serve_chat(body: ChatRequest, request: Request, endpoint: str):
        """The chat route's answer to ``body`` (also the other APIs': dflash_gguf.server.translate)."""
        kw = body.sampling_kwargs()
        if body.ignore_eos:
            no_eog(kw)
        messages = [m.as_dict() for m in body.messages]
        kw.update(max_tokens=body.max_completion_tokens or body.max_tokens, stream=body.stream, model=model_id,
                  logprobs=body.logprobs, top_logprobs=body.top_logprobs, response_format=body.response_format,
                  tools=body.tools, tool_choice=body.tool_choice)
        grammar = _grammar(llm, body.grammar)
        if grammar is not None:
            kw["grammar"] = grammar
        _check_schemas(body.response_format, body.tools)
        if body.chat_template_kwargs:
            if not hasattr(llm, "dflash_info"):
                raise BadRequest("chat_template_kwargs needs a dflash_gguf.Llama", "chat_template_kwargs")
            kw["chat_template_kwargs"] = body.chat_template_kwargs
        if srv.slots is not None and srv.slots.eligible(kw):
            from dflash_gguf.requests.prompts import chat_prompt
            from dflash_gguf.server import slots as S

            formatted = chat_prompt(llm, messages, body.tools, body.tool_choice, body.chat_template_kwargs)
            if formatted is not None:
                ids, fmt_stops = formatted
                job = S.make_job(srv.slots, asyncio.get_running_loop(), ids, kw,
                                 stop_list(kw.get("stop")) + fmt_stops, chat=True)
                return await S.serve(srv, request, endpoint, job, body.stream, body.include_usage(), True)
        return await srv.generate(request, endpoint, lambda: llm.create_chat_completion(messages, **kw),
                                  body.stream, body.include_usage())

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await serve_chat(body, request, "/v1/chat/completions")

    from dflash_gguf.server import extras, translate

    translate.add_routes(app, srv, serve_chat)
    extras.add_routes(app, srv)
    return app


def _check_schemas(response_format: dict | None, tools: list | None) -> None:
    """A JSON schema that cannot become a grammar is a 400 (llama_cpp would quietly constrain the reply to
    any JSON instead)."""
    from dflash_gguf.native.llama import llama_grammar

    found = []
    if isinstance(response_format, dict) and "schema" in response_format:
        found.append(("response_format", response_format["schema"]))
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and "parameters" in fn:
            found.append(("tools", fn["parameters"]))
    for param, schema in found:
        try:
            llama_grammar.json_schema_to_gbnf(json.dumps(schema))
        except Exception as e:   # the converter raises assertion, attribute and key errors alike
            raise BadRequest(f"invalid JSON schema in {param}: {e}", param) from e


def _echoed(completion: dict, text: str) -> dict:
    """A non-streamed completion whose text starts with ``text`` (echo of a token-id prompt)."""
    completion["choices"][0]["text"] = text + completion["choices"][0]["text"]
    return completion


def _dflash_info(llm) -> dict | None:
    return getattr(llm, "dflash_info", None)


def _check_prompt(llm, prompt) -> None:
    """Token ids must be in the vocabulary (llama.cpp would abort on a bad id)."""
    if isinstance(prompt, list):
        n_vocab = llm.n_vocab()
        bad = [t for t in prompt if t >= n_vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", "prompt")
