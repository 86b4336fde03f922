"""Proposers: where a step's drafted tokens come from.

:class:`DrafterProposer` asks the DFlash drafter (one C call per step: a block for every sequence). :class:`OverrideProposer`
still runs the drafter - its cost is paid and its cache stays exactly as without the override - and
then replaces each sequence's proposal with a function of its context: an oracle for tests, replayed acceptance
profiles for benchmarks. :class:`LatticeProposer` serves DFlash2 drafters at temperature > 0: it
samples each drafted token from the selector's top-k distribution and returns that distribution
(q) for the acceptance rule.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dflash_gguf.native import _bindings as B
from dflash_gguf.native.engine import Context


class Proposer:
    # whether propose() fills ``conf`` whatever the drafter (a replayed trace); else a drafter with a
    # confidence head does
    confidence = False

    def propose(self, drafter: Context, seqs: np.ndarray, pos: np.ndarray, pending: np.ndarray, n: int,
                out: np.ndarray, context: Callable[[int], list[int]], conf: np.ndarray | None = None) -> int:
        """Propose up to ``n`` tokens for each sequence ``i`` of a step, into ``out[i, :]``; return how many
        (the same for every sequence).

        Sequence ``i`` is llama.cpp's sequence ``seqs[i]``; ``pending[i]`` is its last chosen token (at
        ``pos[i]``, not yet decoded); ``context(i)`` gives the tokens before it (built only when a
        proposer asks). One drafter decode serves every sequence. ``conf`` (a DSpark drafter with a
        confidence head): each drafted token's confidence, into ``conf[i, :]``.
        """
        raise NotImplementedError


class DrafterProposer(Proposer):
    def propose(self, drafter, seqs, pos, pending, n, out, context, conf=None):
        i32 = "int32_t[]"
        args = (drafter.cptr, len(seqs), B.ffi.from_buffer(i32, seqs), B.ffi.from_buffer(i32, pos),
                B.ffi.from_buffer("llama_token[]", pending), n, B.ffi.from_buffer("llama_token[]", out))
        what = "drafting a block" if len(seqs) == 1 else f"drafting a block for each of {len(seqs)} sequences"
        if conf is None:
            return B.check(B.lib.llama_dflash_draft_seqs(*args), what)
        # rows of n values: out and conf are laid out as the C call writes them
        assert out.shape[1] == n and conf.shape[1] == n and conf.dtype == np.float32 and conf.flags.c_contiguous
        return B.check(B.lib.llama_dflash_draft_seqs_conf(*args, B.ffi.from_buffer("float[]", conf)), what)


class OverrideProposer(DrafterProposer):
    """Runs the drafter, then proposes ``fn(context + [pending], n)`` instead of its tokens."""

    def __init__(self, fn: Callable[[list[int], int], Sequence[int]]):
        self.fn = fn

    def propose(self, drafter, seqs, pos, pending, n, out, context, conf=None):
        n = super().propose(drafter, seqs, pos, pending, n, out, context, conf)
        for i in range(len(seqs)):
            out[i, :n] = np.asarray(self.fn(context(i) + [int(pending[i])], n), dtype=np.int32)[:n]
        return n


class LatticeProposer:
    """DFlash2 at temperature > 0: drafted tokens sampled from the selector's lattice (patch 0008).

    For block row i the lattice holds top_k candidate ids and, for each candidate p of row i - 1,
    transition scores over row i's candidates. Row i's proposal distribution is
    softmax(scores[pred] / temperature) over its candidates, given the candidate drawn for row i - 1
    (row 1: the anchor, index 0); the drafted token is drawn from it with the request's random
    generator, and ``(ids, q)`` per row goes to the acceptance rule (accept with min(1, p/q)).
    """

    def __init__(self, top_k: int, n_max: int):
        self.k = top_k
        self.width = top_k + top_k * top_k
        self.buf = np.zeros((max(n_max, 1), self.width), dtype=np.float32)

    def propose(self, drafter: Context, seq: int, pos: int, pending: int, n: int, out: np.ndarray,
                rng: np.random.Generator, temperature: float,
                limits=None) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        """``limits``: the request's :class:`~dflash_gguf.decoding.constraints.Constraints`; with a grammar, each row
        draws only among the candidates it allows after the tokens drawn before (the block ends at a row
        where it allows none), and that masked distribution is the row's q."""
        got = B.check(B.lib.llama_dflash_draft_lattice(drafter.cptr, seq, pos, pending, n,
                                                       B.ffi.from_buffer("float[]", self.buf), self.buf.size),
                      "drafting a block (DFlash2 lattice)")
        k, t = self.k, temperature if temperature > 0 else 1.0
        grammar = limits is not None and limits.grammar is not None
        qs, pred = [], 0
        for i in range(got):
            row = self.buf[i]
            scores = row[k + pred * k:k + (pred + 1) * k].astype(np.float64) / t
            q = np.exp(scores - scores.max())
            ids = row[:k].astype(np.int64)
            if grammar:
                q = q * limits.allowed(out[:i].tolist())(ids.astype(np.int32))
                if q.sum() <= 0:
                    return i, qs
            q /= q.sum()
            pred = int(rng.choice(k, p=q))
            out[i] = ids[pred]
            uniq, inv = np.unique(ids, return_inverse=True)      # a token listed twice: its q is the sum
            qs.append((uniq, np.bincount(inv, weights=q, minlength=len(uniq))))
        return got, qs


class MarkovProposer:
    """DSpark at temperature > 0: drafted tokens drawn through the Markov head's chain.

    The drafter's graph adds to block row i's logits the bias ``scale * markov_w2 @ markov_w1[prev]``, where
    ``prev`` is the token drafted for row i - 1 (row 0: the anchor) along the graph's own argmax chain; the
    rest of the row does not depend on ``prev``. So once a drawn token leaves that chain, the row's logits
    given what was drawn are exactly ``logits_i - bias(argmax prev) + bias(drawn prev)``. Each row's proposal
    q is the softmax of those logits at the request's temperature over the row's ``CANDIDATES`` best ids
    (any q is lossless as long as the acceptance rule gets the q the token was drawn from; the cut keeps
    the bias to a few rows of ``markov_w2``). The weights are read from the drafter's GGUF, a row at a time,
    on the first sampled request.
    """

    CANDIDATES = 64

    @staticmethod
    def available() -> bool:
        """Whether the GGUF reader it reads the weights with is installed (the build installs it; without
        it a sampled DSpark block is the greedy chain, a point-mass proposal, lossless too)."""
        import importlib.util
        return importlib.util.find_spec("gguf") is not None

    def __init__(self, path, n_vocab: int):
        self.path, self.n_vocab = path, n_vocab
        self._w = None

    def _weights(self):
        if self._w is None:
            from dflash_gguf.paths import import_gguf
            gguf = import_gguf()
            GGUFReader, dequantize = gguf.GGUFReader, gguf.quants.dequantize
            t = {x.name: x for x in GGUFReader(self.path).tensors}

            def rows(name):
                x = t[name]
                return lambda ids: np.asarray(dequantize(x.data[ids], x.tensor_type), dtype=np.float64)
            scale = float(np.asarray(t["markov_w2.scale"].data, dtype=np.float64).reshape(-1)[0]) \
                if "markov_w2.scale" in t else 1.0
            t2d = None
            if "d2t" in t:      # a reduced draft head: its row j scores target token d2t[j]
                d2t = np.asarray(t["d2t"].data, dtype=np.int64).reshape(-1)
                t2d = np.full(self.n_vocab, -1, dtype=np.int64)
                t2d[d2t] = np.arange(len(d2t))
            self._w = (rows("markov_w1.weight"), rows("markov_w2.weight"), scale, t2d)
        return self._w

    def bias(self, prev: int, ids: np.ndarray) -> np.ndarray:
        """The Markov head's bias on target tokens ``ids`` after ``prev``."""
        w1, w2, scale, t2d = self._weights()
        if t2d is None:
            return scale * (w2(ids) @ w1(np.array([prev]))[0])
        out = np.zeros(len(ids))
        j = t2d[ids]
        has = j >= 0
        if has.any():
            out[has] = scale * (w2(j[has]) @ w1(np.array([prev]))[0])
        return out

    def propose(self, drafter: Context, row0: int, chain: np.ndarray, anchor: int, n: int, out: np.ndarray,
                rng: np.random.Generator, temperature: float,
                limits=None) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        """Draw ``n`` tokens into ``out`` from the drafter's logits rows ``row0 .. row0 + n - 1`` of its last
        decode (``chain``: their argmax ids, the graph's own chain after ``anchor``). ``limits``: the request's
        :class:`~dflash_gguf.decoding.constraints.Constraints`; with a grammar each row draws only among the
        candidates it allows after the tokens drawn before (the block ends at a row where it allows none).
        Returns how many were drawn and each one's (ids, q)."""
        t = temperature if temperature > 0 else 1.0
        grammar = limits is not None and limits.grammar is not None
        qs, drawn_prev, graph_prev = [], int(anchor), int(anchor)
        for i in range(n):
            row = drafter.logits_row(row0 + i)
            k = min(self.CANDIDATES, len(row))
            ids = np.argpartition(row, -k)[-k:]
            lg = row[ids].astype(np.float64)
            if drawn_prev != graph_prev:
                lg += self.bias(drawn_prev, ids) - self.bias(graph_prev, ids)
            q = np.exp((lg - lg.max()) / t)
            if grammar:
                q = q * limits.allowed(out[:i].tolist())(ids.astype(np.int32))
            if not np.isfinite(q).all() or q.sum() <= 0:
                return i, qs
            q /= q.sum()
            tok = int(ids[rng.choice(k, p=q)])
            out[i] = tok
            qs.append((ids.astype(np.int64), q))
            drawn_prev, graph_prev = tok, int(chain[i])
        return n, qs
