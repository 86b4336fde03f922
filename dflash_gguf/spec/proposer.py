"""Proposers: where a step's drafted tokens come from.

:class:`DrafterProposer` asks the DFlash drafter (one C call per block). :class:`OverrideProposer`
still runs the drafter - its cost is paid and its cache stays exactly as without the override - and
then replaces the proposal with a function of the context: an oracle for tests, replayed acceptance
profiles for benchmarks.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dflash_gguf import _bindings as B
from dflash_gguf.engine import Context


class Proposer:
    def propose(self, drafter: Context, pos: int, pending: int, n: int, out: np.ndarray,
                context: Callable[[], list[int]]) -> int:
        """Write up to ``n`` proposed tokens for positions ``pos + 1 ..`` into ``out``; return how many.

        ``pending`` is the last chosen token (at ``pos``, not yet decoded); ``context()`` gives the
        tokens before it (built only when a proposer asks).
        """
        raise NotImplementedError


class DrafterProposer(Proposer):
    def propose(self, drafter, pos, pending, n, out, context):
        return B.check(B.lib.llama_dflash_draft(drafter.cptr, 0, pos, pending, n, B.ffi.from_buffer("llama_token[]", out)),
                       "drafting a block")


class OverrideProposer(DrafterProposer):
    """Runs the drafter, then proposes ``fn(context + [pending], n)`` instead of its tokens."""

    def __init__(self, fn: Callable[[list[int], int], Sequence[int]]):
        self.fn = fn

    def propose(self, drafter, pos, pending, n, out, context):
        n = super().propose(drafter, pos, pending, n, out, context)
        out[:n] = np.asarray(self.fn(context() + [pending], n), dtype=np.int32)[:n]
        return n
