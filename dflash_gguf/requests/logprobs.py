"""Log-probabilities of generated tokens, as llama_cpp reports them, from the rows the engine verified.

llama_cpp reports ``logprobs`` only for a model that keeps every position's logits (``logits_all``),
and turns each into a full-vocabulary Python sort per token. The batched engine hands a request's
sink the logits row that predicted each committed token (draft-verify or plain step alike: the
verify's rows are the target's own); :class:`Collector` turns each into that token's log-probability
and the ``k`` most likely tokens in numpy, with llama_cpp's own log-softmax
(``Llama.logits_to_logprobs``) and its order (descending; equal values: the larger id first), in the
engine thread. :class:`CompletionLogprobs` then builds llama_cpp's ``CompletionLogprobs`` from them
(tokens, text offsets, token and top log-probabilities; chat responses convert it as llama_cpp's chat
handler does), all at once or chunk by chunk for a stream.

llama_cpp's rules kept: a token's text is its piece decoded as UTF-8 with the bytes that do not decode
left out; its offset is the prompt's length (characters of a text prompt) plus the characters of the
completion before it; the end-of-generation token is no token of the completion; every token kept is
reported, those of a stop string too; ``top_logprobs`` maps text to log-probability (pieces with the
same text are one entry), the token's own added last.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import numpy as np


def log_softmax(row: np.ndarray) -> np.ndarray:
    """llama_cpp's ``Llama.logits_to_logprobs`` of one row (float32, the same operations)."""
    m = np.amax(row)
    if not np.isfinite(m):
        m = 0
    sub = np.subtract(row, m, dtype=np.single)
    with np.errstate(divide="ignore"):
        return sub - np.log(np.sum(np.exp(sub)))


def top_k(lp: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` largest entries of ``lp`` as (id, value), in llama_cpp's order: value descending, equal
    values by id descending (it sorts ``(value, id)`` pairs in reverse)."""
    if k <= 0:
        return ()
    k = min(k, len(lp))
    kth = np.partition(lp, len(lp) - k)[len(lp) - k]
    ids = np.flatnonzero(lp >= kth)
    order = np.lexsort((-ids, -lp[ids]))[:k]
    return tuple((int(ids[i]), float(lp[ids[i]])) for i in order)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Collector:
    """One request's log-probabilities, in the engine thread: :meth:`sink` is the request's
    ``logits_sink`` (the rows of a step's committed tokens, in order), :meth:`commit` takes the tokens of
    that step the request kept. ``entries`` grows as the request runs (read from another thread: appends
    only)."""

    def __init__(self, k: int, end_tokens: Collection[int]):
        self.k = k
        self.end_tokens = frozenset(int(t) for t in end_tokens)
        self.entries: list[TokenLogprob] = []
        self._rows: list[np.ndarray] = []

    def sink(self, pos: int, row: np.ndarray) -> None:
        self._rows.append(log_softmax(row))

    def commit(self, tokens: Sequence[int]) -> None:
        """The first ``len(tokens)`` rows sunk since the last call predicted these tokens; the rest (of
        tokens not kept) are dropped."""
        for tok, lp in zip(tokens, self._rows):
            tok = int(tok)
            if tok in self.end_tokens:
                break
            self.entries.append(TokenLogprob(tok, float(lp[tok]), top_k(lp, self.k)))
        self._rows.clear()


class CompletionLogprobs:
    """llama_cpp's ``CompletionLogprobs`` of a completion's entries, continued call by call.

    ``piece``: a token's text as llama_cpp's ``detokenize([token])`` gives it (bytes); ``offset0``: the
    first token's text offset (``len(prompt)`` of the request as given: characters of a text prompt, ids
    of a token-id prompt); ``bos``: the id llama_cpp leaves out of the tokens it reports."""

    def __init__(self, piece: Callable[[int], bytes], offset0: int, bos: int | None = None):
        self.piece, self.offset0, self.bos = piece, offset0, bos
        self._raw = b""          # the completion's bytes so far
        self._chars = 0          # ... decoded (llama_cpp: UTF-8, bytes that do not decode left out)
        self.done = 0            # entries reported so far
        self._cache: dict[int, str] = {}

    def _text(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.piece(token).decode("utf-8", errors="ignore")
        return s

    def take(self, entries: Sequence[TokenLogprob], upto: int | None = None) -> dict | None:
        """The next of ``entries`` (from the ``done``-th on): all of them, or (``upto``: characters of the
        completion's text sent so far) those whose text ends within it. None when there are none."""
        out: dict = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
        while self.done < len(entries):
            e = entries[self.done]
            raw = self._raw + self.piece(e.token)
            chars = len(raw.decode("utf-8", errors="ignore"))
            if upto is not None and chars > upto:
                break
            if e.token != self.bos:
                tok = self._text(e.token)
                top = {self._text(i): lp for i, lp in e.top}
                top.update({tok: e.logprob})
                out["tokens"].append(tok)
                out["text_offset"].append(self.offset0 + self._chars)
                out["token_logprobs"].append(e.logprob)
                out["top_logprobs"].append(top)
            self._raw, self._chars = raw, chars
            self.done += 1
        return out if out["tokens"] else None


def chat_logprobs(completion_logprobs: dict | None) -> dict | None:
    """A chat response's ``logprobs`` from a completion's, as llama_cpp's chat handler converts them."""
    from dflash_gguf.native.llama import llama_chat_format

    return llama_chat_format._convert_text_completion_logprobs_to_chat(completion_logprobs)
