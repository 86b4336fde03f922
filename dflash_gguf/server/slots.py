"""``--parallel N`` (default: 4, as llama-server's ``-np -1``): requests decoded together in one batched engine.

Beside the server's :class:`dflash_gguf.Llama` (which keeps serving what the batched engine does not:
logprobs of an echoed prompt, chat formats without a known formatter, a chat handler of its own),
:class:`Slots` runs a :class:`dflash_gguf.decoding.DFlashDecoder` of N sequences on the same models in one
thread. Each step drafts every running request's block in one drafter decode and verifies them all in one
target decode; a waiting request starts, first come first served, when a slot is free and the KV cache has
room for it. Every response is what the request gives alone (greedy: token for token; seeded sampling: the
same tokens; unseeded: the same distribution).

One copy of the target's state. The slots borrow the Llama's own context (:meth:`dflash_gguf.Llama.serve_sequences`
makes it one unified KV cache of ``n_ctx`` cells for N sequences), as llama-server's slots share one cache of
``-c`` cells: memory is what one context costs, not N + 1 contexts, and a request may use every position of
``-c`` when the others leave room. Cells, not slots, are what runs out: admission waits for room, and a
request that would overflow the cache mid-generation gives its cells back and resumes where it was
(:mod:`dflash_gguf.decoding.scheduling`), losslessly and unseen by its client. A request on llama_cpp's own
path runs with the cache to itself (:meth:`Slots.lend`): llama_cpp removes positions of every sequence
(``kv_cache_seq_rm(-1, ...)``) and keeps its own prefix bookkeeping, so the slots finish what runs (new
requests wait), the Llama's views are reset, it runs, and the slots start again from an empty cache.
A Llama that cannot share its context (llama_cpp's own class, embeddings, a LoRA adapter) gets the former
layout: a context of the slots' own of N x n_ctx cells beside it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import threading
import time
import uuid
from collections import deque
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from dflash_gguf.decoding.constraints import request_constraints, tool_call_grammar
from dflash_gguf.server.responses import POLL_S, error_body, error_response
from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.runtime import Runtime
from dflash_gguf.requests.logprobs import Collector, CompletionLogprobs
from dflash_gguf.requests.defaults import sampling
from dflash_gguf.requests.responses import (chunk, completion_body, dflash_object, finish_reason, text_chunk_frame,
                                            usage, usage_chunk)
from dflash_gguf.requests.served import slots_plain_reason, slots_serve
from dflash_gguf.requests.stops import StopStrings
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.decoding.sequence import Request
from dflash_gguf.decoding.stats import GenerationStats

log = logging.getLogger("dflash_gguf.server")

class Job:
    """One request on its way through the slots; tokens come back to the event loop in ``queue``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request: Request, text: StopStrings):
        self.loop, self.request, self.text = loop, request, text
        self.id = 0
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False      # set by the event loop (client gone, timeout): ends at the next step
        self.stream = True          # False: a whole response, which needs no item before the end
        self.taken = 0              # items the event loop has taken from the queue so far
        self.n_tokens = 0
        self.why_plain: str | None = None   # why it decodes plainly (dflash off for it or for the server)
        self.echo = ""      # a completion's text starts with this (echo=true: the prompt, as llama_cpp)
        self.tool: str | None = None    # the function a chat reply calls (a named tool_choice): its arguments
        self.logprobs: Collector | None = None        # the generated tokens' log-probabilities, if asked for
        self.logprobs_offset = 0                      # ... the first one's text offset (llama_cpp: len(prompt))
        self.failed = False         # ended with an error of the engine thread's: nothing more goes to it
        request.consumer = self._consume

    def want_logprobs(self, k: int, end_tokens, offset0: int) -> None:
        """Report the generated tokens' log-probabilities and their ``k`` most likely alternatives."""
        self.logprobs = Collector(k, end_tokens)
        self.logprobs_offset = offset0
        self.request.logits_sink = self.logprobs.sink
        self.request.sink_from = max(len(self.request.prompt) - 1, 0)   # the rows that predict generated tokens

    def _consume(self, tokens: list[int]) -> int | None:
        want = 0 if self.cancelled else self.text(tokens)
        if self.logprobs is not None:
            self.logprobs.commit(tokens if want is None else tokens[:want])
        return want

    def logprobs_format(self, llm) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        return CompletionLogprobs(lambda t: llm.detokenize([t]), self.logprobs_offset, llm.token_bos())

    # ------------------------------------------------------------------ its answer's parts (dflash_gguf.requests.responses)
    def finish_reason(self) -> str:
        return finish_reason(self.request.stats.finish, self.tool)

    def usage(self) -> dict:
        return usage(len(self.request.prompt), self.n_tokens)

    def dflash_object(self, drafting: bool) -> dict | None:
        """The answer's ``dflash`` object (None: the server has no drafter)."""
        if not drafting:
            return None
        return dflash_object(self.request.stats if self.request.use_draft else None, self.why_plain)

    def body(self, model_id: str, text: str, chat: bool, drafting: bool, llm) -> dict:
        """The whole response, ``text`` its reply."""
        fmt = self.logprobs_format(llm)
        lp = None if fmt is None else fmt.take(self.logprobs.entries)
        if fmt is not None and lp is None:
            lp = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        return completion_body(model_id, text, chat, self.finish_reason(), self.usage(), self.dflash_object(drafting),
                               logprobs=lp, tool=self.tool, echo=self.echo)

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Slots:
    def __init__(self, llm, n: int):
        if n < 1:
            raise ValueError(f"--parallel must be >= 1, got {n}")
        self.llm, self.n = llm, n
        # the Llama's attention kernel (a request served here or there gives the same logits)
        flash = getattr(llm.context_params, "flash_attn_type", None) == 1
        opts = ContextOptions(n_ctx=llm.n_ctx(), n_batch=llm.n_batch, n_ubatch=llm.context_params.n_ubatch,
                              n_threads=llm.n_threads, n_seq=n, flash_attn=flash)
        # drafting as the Llama's (a hybrid target's rollback chosen for n sequences under the same cap)
        draft = llm.draft_settings() if hasattr(llm, "draft_settings") else None
        self.model = Model.borrow(llm._model.model, llm.model_path)
        share = getattr(llm, "serve_sequences", None)
        self.shared = bool(share is not None and share(n))
        if self.shared:   # the Llama's own context: one KV cache of n_ctx cells, every sequence may use all
            opts = replace(opts, shared=True, n_rs_seq=int(llm.context_params.n_rs_seq))
            target = Context.borrow(self.model, llm._ctx.ctx, opts)
            self.runtime = Runtime(target, getattr(llm, "_draft_model", None), draft)
        else:
            self.runtime = Runtime.open(self.model, getattr(llm, "_draft_model", None), opts, draft)
        self._lends: deque[_Lend] = deque()    # llama_cpp-path requests waiting for the cache (engine thread)
        self._lent: _Lend | None = None
        self.lent = 0                           # times the cache went to the Llama
        self.target, self.drafter, self.decoder = self.runtime.target, self.runtime.drafter, self.runtime.decoder
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[Job] = deque()     # admitted to the server, not yet to a slot (engine thread)
        self.n_waiting = 0                      # ... as the event loop counts them
        self._running: dict[int, Job] = {}
        self._next_id = 0
        self.steps = 0                          # batched steps so far
        self.sequences = 0                      # ... and the sequences in them (mean batch: sequences / steps)
        self._thread = threading.Thread(target=self._loop, name="dflash-slots", daemon=True)
        self._thread.start()
        log.info("--parallel %d: up to %d sequences per step, %s%s", n, n,
                 f"one KV cache of {self.target.n_cells} cells shared with the model's own context" if self.shared
                 else f"{self.target.n_ctx} positions each",
                 "" if self.drafter is None else f", drafting up to {self.decoder.n_draft} tokens each")

    # ------------------------------------------------------------------ the event loop's side
    @staticmethod
    def eligible(kw: dict) -> bool:
        """Whether a request with these keyword arguments runs in the slots (:func:`dflash_gguf.requests.served.slots_serve`)."""
        return slots_serve(kw)

    def submit(self, job: Job) -> None:
        self.n_waiting += 1
        self._jobs.put(job)

    def busy(self) -> int:
        return len(self._running)

    async def lend(self, deadline: float | None = None) -> "_Lend | None":
        """Wait until the slots' requests have finished and the cache is the Llama's (new slot requests wait
        meanwhile); None where the slots have contexts of their own. Give it back with :meth:`give_back`."""
        if not self.shared:
            return None
        lend = _Lend()
        self._jobs.put(lend)
        try:
            fut = asyncio.wrap_future(lend.future)
            if deadline is None:
                await fut
            else:
                await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.give_back(lend)
            raise
        return lend

    @staticmethod
    def give_back(lend: "_Lend | None") -> None:
        """The Llama is done with the cache (:meth:`lend`): the slots go on."""
        if lend is not None:
            lend.back.set()

    def figures(self) -> dict:
        return {"total": self.n, "busy": self.busy(), "waiting": self.n_waiting, "steps": self.steps,
                "sequences": self.sequences,
                "mean_batch": round(self.sequences / self.steps, 3) if self.steps else None,
                # the KV cache: cells in all (shared: the model's own context's), those held now, requests that
                # gave theirs back to resume later, times the cache went to a request on llama_cpp's own path
                "shared": self.shared, "cells": self.target.n_cells, "cells_used": self.decoder.cells_used(),
                "preempted": self.decoder.preempted, "lent": self.lent}

    # ------------------------------------------------------------------ the engine thread
    def _loop(self) -> None:
        while True:
            try:
                if not self._turn():
                    return
            except Exception as e:   # a fault of this loop's own: its requests fail, the thread serves on
                log.exception("the slots' engine loop failed")
                try:
                    self._recover(e)
                except Exception:
                    log.exception("resetting the batched engine failed")

    def _turn(self) -> bool:
        """Admit what waits, run one step, hand its tokens out; False once the server shuts down."""
        dec = self.decoder
        block = not dec.running and not self.waiting and not self._lends
        try:
            job = self._jobs.get(block=block)
            while True:
                if job is None:
                    self._fail_all(RuntimeError("the server is shutting down"))
                    return False
                if isinstance(job, _Lend):
                    self._lends.append(job)
                else:
                    self.waiting.append(job)
                job = self._jobs.get_nowait()
        except queue.Empty:
            pass
        if self._lends and not dec.running:
            self._lend_now(self._lends.popleft())
            return True
        # a request starts when a slot is free and the cache has room for it (shared cells: scheduling)
        while self.waiting and dec.free_slots and not self._lends and dec.room_for(len(self.waiting[0].request.prompt)):
            job = self.waiting.popleft()
            job.loop.call_soon_threadsafe(self._left_queue)
            if job.cancelled:
                job.put(("end", ""))
                continue
            self._next_id += 1
            job.id = self._next_id
            try:
                dec.admit(job.request, job.id)
            except Exception as e:   # a bad prompt: that request fails, the others go on
                job.put(("error", e))
                continue
            self._running[job.id] = job
        if not dec.running:
            return True
        n_running = dec.running
        try:
            results = dec.step()
            self.steps += 1
            self.sequences += n_running
        except Exception as e:   # the engine failed mid-step: every running request fails, caches reset
            log.exception("batched step failed")
            self._recover(e)
            return True
        for idx, toks, ended in results:
            j = self._running.get(idx)
            if j is None:
                continue
            if ended:
                del self._running[idx]
            try:
                self._deliver(j, toks, ended)
            except Exception as e:   # this request fails; the engine and the other requests go on
                log.exception("handing request %d its tokens failed", idx)
                self._fail(j, e)
        return True

    def _lend_now(self, lend: "_Lend") -> None:
        """The cache goes to the Llama until it gives it back (this thread waits): its views of the context are
        reset (its decoder's taps set as it reads them), and afterwards the slots' (they start empty)."""
        if not lend.future.set_running_or_notify_cancel():
            return                      # its request went away while it waited
        self._lent = lend
        try:
            self.target.clear()
            own = getattr(self.llm, "_decoder", None)
            if own is not None:
                own.rebind()
                own.reset()
            self.llm.n_tokens = 0       # llama_cpp's prefix bookkeeping: nothing of its is in the cache now
        except BaseException as e:
            lend.future.set_exception(e)
            self._lent = None
            return
        self.lent += 1
        lend.future.set_result(None)
        lend.back.wait()
        self._lent = None
        self.decoder.rebind()
        self.decoder.reset()

    def _deliver(self, j: Job, toks: list[int], ended: bool) -> None:
        """Give ``j`` what a step kept of it (``ended``: its slot is free again)."""
        if j.failed:
            return
        j.n_tokens += sum(t not in self.decoder.eog for t in toks)   # llama_cpp counts no end-of-generation token
        if ended and j.request.error is not None:   # its prompt could not be decoded
            j.put(("error", j.request.error))
        elif ended or (toks and j.stream):
            # the text so far, taken here, right after the consumer saw these tokens: it holds no
            # whole stop string unless the request ended on it (then it is cut before it)
            j.put(("end" if ended else "tokens", j.text.text()))

    def _fail(self, j: Job, e: BaseException) -> None:
        """``j`` ends with ``e``; a request still running keeps nothing of its next step, so its slot frees
        then (a cancelled job's consumer keeps no token)."""
        j.failed = j.cancelled = True
        try:
            j.put(("error", e))
        except Exception:   # its event loop is gone: nobody waits for it
            log.exception("reporting a failed request failed")

    def _recover(self, e: BaseException) -> None:
        """Every running request fails with ``e`` and the caches are reset; waiting requests stay."""
        dec = self.decoder
        try:
            dec.abandon()
            dec.reset()
        finally:
            for j in list(self._running.values()):
                self._fail(j, e)
            self._running.clear()

    def _left_queue(self) -> None:
        self.n_waiting -= 1

    def _fail_all(self, e: BaseException) -> None:
        for j in list(self._running.values()) + list(self.waiting):
            j.put(("error", e))
        self._running.clear()
        self.waiting.clear()

    def close(self) -> None:
        t = getattr(self, "_thread", None)
        if t is not None and t.is_alive():
            lent = self._lent
            if lent is not None:
                lent.back.set()
            self._jobs.put(None)
            t.join(timeout=30)
        if getattr(self, "runtime", None) is not None:
            self.runtime.close()


class _Lend:
    """A llama_cpp-path request's claim on the shared cache (:meth:`Slots.lend`)."""

    def __init__(self):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.back = threading.Event()


# ---------------------------------------------------------------------- a request's job
def make_job(slots: Slots, loop, prompt_ids: list[int], kw: dict, stops: list[str], chat: bool,
             offset0: int = 0) -> Job:
    """A job for ``prompt_ids`` (``offset0``: ``len(prompt)`` of the request's prompt as given, the first
    generated token's text offset in a completion's ``logprobs``)."""
    max_tokens = kw.get("max_tokens")
    room = max(slots.target.n_ctx - len(prompt_ids), 0)
    if max_tokens is None or max_tokens <= 0:
        max_tokens = room
    fmt = kw.get("response_format") if chat else None
    grammar = kw.get("grammar")
    tool = tool_call_grammar(kw.get("tools"), kw.get("tool_choice")) if chat else None
    if tool is not None:             # llama_cpp: the function's grammar replaces a grammar and JSON mode
        grammar, fmt = tool[1], None
    limits = request_constraints(slots.llm, prompt_ids, grammar, kw.get("logit_bias"),
                                 fmt if isinstance(fmt, dict) else None)
    why_plain = slots_plain_reason(kw.get("dflash"), bool(getattr(slots.llm, "dflash", True)))
    request = Request(prompt_ids, min(max_tokens, room), SamplingParams(**sampling(kw, chat)),
                      use_draft=why_plain is None, stats=GenerationStats(), constraints=limits)
    job = Job(loop, request, StopStrings(slots.model.token_bytes, stops, slots.decoder.eog))
    job.why_plain = why_plain
    job.tool = None if tool is None else tool[0]
    if chat and kw.get("logprobs"):                      # chat: logprobs=true, top_logprobs=k
        job.want_logprobs(int(kw.get("top_logprobs") or 0), slots.decoder.eog, offset0)
    elif not chat and kw.get("logprobs") is not None:    # completions: logprobs=k
        job.want_logprobs(int(kw["logprobs"]), slots.decoder.eog, offset0)
    return job


# ---------------------------------------------------------------------- serving a job (the event loop)
async def _watch(job: Job, request, deadline: float | None) -> None:
    """Every ``POLL_S`` while ``job`` is served: a passed deadline or a gone client puts its reason in the
    job's queue (after whatever the engine already sent). One timer per request, not one per token; the
    client is asked whether it is still there only when nothing reached it since the last look (a
    stream's writes show a gone client by themselves)."""
    taken = -1
    while True:
        await asyncio.sleep(POLL_S)
        if deadline is not None and time.monotonic() >= deadline:
            job.queue.put_nowait(("why", "timeout"))
            return
        if job.taken != taken:
            taken = job.taken
            continue
        if await request.is_disconnected():
            job.queue.put_nowait(("why", "disconnect"))
            return


async def _next(job: Job):
    """The job's next item from the engine thread, or (None, "timeout" | "disconnect") from its watch."""
    item = await job.queue.get()
    job.taken += 1
    return (None, item[1]) if item[0] == "why" else (item, None)


async def serve(srv, request, endpoint: str, job: Job, stream: bool, include_usage: bool, chat: bool):
    """Serve ``job`` in ``srv``'s slots (the app's ``_Server``); JSON or an SSE stream."""
    srv.metrics.in_flight += 1
    streaming = False
    deadline = time.monotonic() + srv.request_timeout if srv.request_timeout else None
    drafting = srv.slots.drafter is not None or srv.slots.decoder.n_copy > 0   # a drafter, or prompt lookup
    try:
        sl = srv.slots
        srv.admit(busy=sl.busy() + sl.n_waiting >= sl.n, waiting=sl.n_waiting, what="a slot")
        job.stream = stream
        srv.slots.submit(job)
        if stream:
            streaming = True
            srv.metrics.request(endpoint, 200)
            return StreamingResponse(_events(srv, request, job, deadline, include_usage, chat, drafting),
                                     media_type="text/event-stream")
        watch = asyncio.ensure_future(_watch(job, request, deadline))
        try:
            item, why = await _next(job)     # a whole response: the engine sends only its end
        finally:
            watch.cancel()
        if why is not None:
            job.cancelled = True
            return srv._stopped(endpoint, why)
        kind, text = item
        if kind == "error":
            raise text
        body = job.body(srv.model_id, text, chat, drafting, srv.llm)
        srv.metrics.generation(body.get("dflash"), body["usage"])
        srv.metrics.request(endpoint, 200)
        return JSONResponse(body)
    except Exception as e:
        return srv.failed(endpoint, e)
    finally:
        if not streaming:
            srv.metrics.in_flight -= 1


async def _events(srv, request, job: Job, deadline: float | None, include_usage: bool, chat: bool, drafting: bool):
    jid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}"
    created = int(time.time())
    hold = max((len(x) for x in job.text.stops), default=1) - 1   # a stop string may still be forming
    sent = 0
    fmt = job.logprobs_format(srv.llm)
    # the usual chunk (text only) from a frame made once; logprobs and tool calls go through chunk()
    frame = text_chunk_frame(jid, srv.model_id, chat, created) if fmt is None and job.tool is None else None
    watch = asyncio.ensure_future(_watch(job, request, deadline))
    try:
        if chat:
            first = chunk(jid, srv.model_id, None, None, chat, first=True, tool=job.tool, created=created)
            yield f"data: {json.dumps(first)}\n\n"
        while True:
            item, why = await _next(job)
            if why is not None:
                job.cancelled = True
                if why == "timeout":
                    err = srv.timed_out()
                    yield f"data: {json.dumps(error_body(str(err), err.type, None, 408))}\n\n"
                else:
                    srv.metrics.disconnects += 1
                    log.info("client disconnected: generation stopped")
                return
            kind, val = item
            if kind == "error":
                err = error_response(val)
                yield f"data: {err.body.decode()}\n\n"
                return
            upto = len(val) if kind == "end" else max(sent, len(val) - hold)
            # the log-probabilities of the tokens whose text is sent (at the end: all that are left, those
            # of a stop string's tokens too, as the whole response reports them)
            lp = None if fmt is None else fmt.take(job.logprobs.entries, None if kind == "end" else upto)
            if upto > sent or lp is not None:
                if frame is not None:
                    yield f"data: {frame[0]}{json.dumps(val[sent:upto])}{frame[1]}\n\n"
                else:
                    data = chunk(jid, srv.model_id, val[sent:upto], None, chat, logprobs=lp, tool=job.tool,
                                 created=created)
                    yield f"data: {json.dumps(data)}\n\n"
                sent = upto
            if kind == "end":
                break
        fin = chunk(jid, srv.model_id, None, job.finish_reason(), chat, tool=job.tool, created=created)
        info, used = job.dflash_object(drafting), job.usage()
        if info is not None:
            fin["dflash"] = info
        srv.metrics.generation(info, used)
        if include_usage:
            fin["usage"] = None
        yield f"data: {json.dumps(fin)}\n\n"
        if include_usage:
            yield f"data: {json.dumps(usage_chunk(fin, used))}\n\n"
        yield "data: [DONE]\n\n"
    except asyncio.CancelledError:
        job.cancelled = True
        srv.metrics.disconnects += 1
        raise
    finally:
        watch.cancel()
        job.cancelled = True     # a no-op once it ended; else its slot frees at the next step
        srv.metrics.in_flight -= 1

