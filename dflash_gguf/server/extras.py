"""What the server answers from the model without generating: ``/v1/embeddings``, llama-server's
``/tokenize`` and ``/detokenize``, llama_cpp.server's ``/extras/tokenize`` (``/count``) and
``/extras/detokenize``.

Embeddings come from a llama.cpp context of their own (:class:`Embedder`) on the server model's weights,
made at the first request: the generation context, its cache and the DFlash state are never touched.
A generative GGUF names no pooling, so its states are mean-pooled (llama-server's ``--pooling mean``;
llama_cpp.server would answer one vector per token, which OpenAI clients cannot read); a GGUF that
names mean, CLS or last-token pooling gets its own. Vectors are not normalized, as llama_cpp's
``create_embedding`` returns them.
"""
from __future__ import annotations

import base64
import struct
from typing import List, Literal, Optional, Union

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from dflash_gguf.server.responses import BadRequest, ServingError

Ids = List[int]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmbeddingRequest(_Strict):
    input: Union[str, List[str], Ids, List[Ids]]
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None


class TokenizeRequest(_Strict):           # llama-server's
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Strict):         # llama-server's and llama_cpp.server's
    tokens: Ids
    model: Optional[str] = None


class ExtrasTokenizeRequest(_Strict):     # llama_cpp.server's
    input: str
    model: Optional[str] = None


class Embedder:
    """A context with embeddings on, sharing ``llm``'s model, decoding one input at a time."""

    POOLED = ("mean", "cls", "last")

    def __init__(self, llm):
        from dflash_gguf.native.llama import llama_cpp
        from dflash_gguf.native.llama import _internals

        self.llm = llm
        arch = llm.metadata.get("general.architecture", "")
        named = {1: "mean", 2: "cls", 3: "last"}.get(int(llm.metadata.get(f"{arch}.pooling_type", 0) or 0))
        self.pooling = named or "mean"
        kind = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
                "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}[self.pooling]
        gen = llm.context_params
        p = llama_cpp.llama_context_default_params()
        # the whole input in one micro-batch (pooling reads every row of the sequence at once), at most the
        # Llama's n_batch, as llama-server limits an input to its micro-batch: a context as long as
        # the generation's would reserve a compute buffer for that many rows of logits
        p.n_ctx = p.n_batch = p.n_ubatch = min(llm.n_ctx(), llm.n_batch)
        p.n_seq_max = 1
        p.n_threads, p.n_threads_batch = gen.n_threads, gen.n_threads_batch
        p.flash_attn_type, p.type_k, p.type_v, p.offload_kqv = gen.flash_attn_type, gen.type_k, gen.type_v, \
            gen.offload_kqv
        p.embeddings, p.pooling_type = True, kind
        self.n_ctx, self.n_embd = p.n_ctx, llm.n_embd()
        # on the model's exit stack: freed before the model, whoever closes first
        self.ctx = _internals.LlamaContext(model=llm._model, params=p, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=self.n_ctx, embd=0, n_seq_max=1, verbose=False)
        self._lib = llama_cpp

    def embed(self, ids: list[int]) -> list[float]:
        self.ctx.kv_cache_clear()
        self.batch.reset()
        self.batch.add_sequence(ids, 0, True)
        self.ctx.decode(self.batch)
        ptr = self._lib.llama_get_embeddings_seq(self.ctx.ctx, 0)
        if not ptr:
            raise RuntimeError("llama.cpp returned no pooled embedding")
        return ptr[: self.n_embd]

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()


def _check_ids(llm, ids: list[int], where: str) -> None:
    """Token ids must be in the vocabulary (llama.cpp would abort on a bad id)."""
    n_vocab = llm.n_vocab()
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise BadRequest(f"{where}: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})", where)


def embedding_inputs(llm, inp, n_ctx: int) -> list[list[int]]:
    """The token ids of each input: texts tokenized as llama_cpp's ``embed`` does (BOS added, special
    tokens as text)."""
    if isinstance(inp, str):
        inp = [inp]
    elif inp and isinstance(inp[0], int):
        inp = [inp]
    if not inp:
        raise BadRequest("input must not be empty", "input")
    out = []
    for i, x in enumerate(inp):
        where = f"input[{i}]"
        ids = llm.tokenize(x.encode("utf-8")) if isinstance(x, str) else list(x)
        if not x or not ids:
            raise BadRequest(f"{where} must not be empty", "input")
        _check_ids(llm, ids, where)
        if len(ids) > n_ctx:
            raise BadRequest(f"{where} has {len(ids)} tokens, more than the {n_ctx} an embedding takes here "
                             "(the model's n_batch: split the text)", "input")
        out.append(ids)
    return out


def _encoded(vec: list[float], fmt: str):
    if fmt == "float":
        return vec
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")   # OpenAI's: float32, little-endian


def _piece(llm, t: int):
    """A token's text as llama-server gives it: a string, or its bytes where they are no whole UTF-8."""
    raw = llm.detokenize([t], special=True)   # (llama_cpp 0.3.36's token_to_piece returns its whole buffer)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def unavailable(why: str) -> ServingError:
    return ServingError(501, f"embeddings are not available here: {why}. Serve an embedding model on its own "
                             "(python -m dflash_gguf.server -m EMBEDDING.gguf, without a drafter)",
                        "invalid_request_error", "embeddings_unavailable")


def add_routes(app: FastAPI, srv) -> None:
    llm = srv.llm

    def ok(endpoint: str, body):
        srv.metrics.request(endpoint, 200)
        return body

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest):
        if not hasattr(llm, "_model") or not hasattr(llm, "context_params"):
            return srv.failed("/v1/embeddings", unavailable("the server holds no llama_cpp.Llama"))
        if body.dimensions is not None and body.dimensions != llm.n_embd():
            raise BadRequest(f"dimensions must be the model's embedding size, {llm.n_embd()} (no shortening)",
                             "dimensions")
        ids = embedding_inputs(llm, body.input, min(llm.n_ctx(), llm.n_batch))

        def job():
            if srv.embedder is None:
                try:
                    srv.embedder = Embedder(llm)
                except (ValueError, RuntimeError) as e:   # llama.cpp made no context for it
                    raise unavailable(f"llama.cpp refused an embedding context on this model ({e})") from e
            return [srv.embedder.embed(x) for x in ids]

        # on the worker, between a running generation's steps: its context is a different one
        try:
            vectors = await srv.run(job)
        except ServingError as e:
            return srv.failed("/v1/embeddings", e)
        n = sum(len(x) for x in ids)
        return ok("/v1/embeddings", {
            "object": "list", "model": srv.model_id, "usage": {"prompt_tokens": n, "total_tokens": n},
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
                     for i, v in enumerate(vectors)]})

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ids = llm.tokenize(body.content.encode("utf-8"), add_bos=body.add_special, special=body.parse_special) \
            if body.content else []
        if body.with_pieces:
            return ok("/tokenize", {"tokens": [{"id": t, "piece": _piece(llm, t)} for t in ids]})
        return ok("/tokenize", {"tokens": ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_ids(llm, body.tokens, "tokens")
        text = llm.detokenize(body.tokens, special=True).decode("utf-8", errors="replace")
        return ok("/detokenize", {"content": text})

    # llama_cpp.server's: BOS added, special tokens parsed
    @app.post("/extras/tokenize")
    async def extras_tokenize(body: ExtrasTokenizeRequest):
        return ok("/extras/tokenize", {"tokens": llm.tokenize(body.input.encode("utf-8"), special=True)})

    @app.post("/extras/tokenize/count")
    async def extras_count(body: ExtrasTokenizeRequest):
        return ok("/extras/tokenize/count", {"count": len(llm.tokenize(body.input.encode("utf-8"), special=True))})

    @app.post("/extras/detokenize")
    async def extras_detokenize(body: DetokenizeRequest):
        _check_ids(llm, body.tokens, "tokens")
        return ok("/extras/detokenize", {"text": llm.detokenize(body.tokens).decode("utf-8", errors="replace")})
