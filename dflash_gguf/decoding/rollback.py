"""Rollback: after a verify pass, keep the first ``k`` of its rows in the target's memory.

One object per kind, all with the same small interface:

* :class:`AttentionRollback` (``seq_rm``) - attention KV: drop the rejected positions;
* :class:`SnapshotRollback` (``snapshot``) - recurrent/hybrid targets whose context keeps per-token
  state snapshots (``n_rs_seq`` >= tokens drafted): the same removal, llama.cpp restores the state;
* :class:`CheckpointRollback` (``checkpoint``) - recurrent/hybrid targets without snapshots: a host copy
  of the recurrent state before the verify, restored on rejection, then the committed rows re-decoded.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dflash_gguf.errors import InvalidArgumentError, RollbackError

if TYPE_CHECKING:      # the rules need no native library (tests/test_rollback_rules.py runs without it)
    from dflash_gguf.native.engine import Context

KINDS = ("seq_rm", "snapshot", "checkpoint")


class Rollback:
    name = "?"
    partial_prefix = False   # may the cache be cut back to any earlier prefix (prompt reuse)?

    def __init__(self, ctx: Context, seq: int = 0):
        self.ctx = ctx
        self.seq = seq

    def save(self, n_drafted: int) -> bytes | None:
        """Called before a verify of ``n_drafted`` drafted rows; returns what :meth:`keep` needs."""
        return None

    def keep(self, pos: int, k: int, rows: np.ndarray, saved: bytes | None) -> None:
        """The verify decoded ``rows`` at ``pos``; keep the first ``k`` of them (k < len(rows))."""
        if not self.ctx.truncate(pos + k, self.seq):
            raise RollbackError(f"target refused to roll back from {pos + len(rows)} to {pos + k} "
                                f"(rollback={self.name}, n_rs_seq={self.ctx.n_rs_seq})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class AttentionRollback(Rollback):
    name = "seq_rm"
    partial_prefix = True


class SnapshotRollback(Rollback):
    name = "snapshot"


class CheckpointRollback(Rollback):
    name = "checkpoint"

    def save(self, n_drafted: int) -> bytes | None:
        return self.ctx.save_seq(self.seq) if n_drafted > 0 else None

    def keep(self, pos: int, k: int, rows: np.ndarray, saved: bytes | None) -> None:
        if saved is None:
            raise RollbackError("checkpoint rollback without a saved state")
        self.ctx.restore_seq(saved, self.seq)
        if not self.ctx.truncate(pos, self.seq):
            raise RollbackError(f"could not drop the rejected rows after restoring the state at {pos}")
        self.ctx.decode(rows[:k].copy(), pos, out_row0=k, seq=self.seq)   # replay the committed rows


_BY_NAME = {c.name: c for c in (AttentionRollback, SnapshotRollback, CheckpointRollback)}


# --------------------------------------------------------------------------- memory
def recurrent_state_bytes(ctx: Context) -> int:
    """Bytes of one copy of the sequence's recurrent state (what a snapshot or a checkpoint holds).

    Measured on ``ctx`` (a recurrent/hybrid target): one token is decoded so that the sequence has
    a state, its size is read through llama.cpp's state API, and the memory is cleared again.
    """
    ctx.clear()
    try:
        ctx.decode(np.zeros(1, dtype=np.int32), 0)
        return len(ctx.save_seq())
    finally:
        ctx.clear()


def choose_for_memory(state_bytes: int, n_draft: int, cap_bytes: int | None) -> str:
    """The rollback kind for a hybrid target drafting ``n_draft`` tokens within ``cap_bytes``.

    Snapshots keep ``n_draft`` extra copies of the recurrent state inside llama.cpp (no replay: the
    fastest); a checkpoint keeps one host copy and re-decodes the committed rows after a rejection.
    ``cap_bytes=None``: no cap (snapshots).
    """
    if n_draft <= 0:
        return "checkpoint"
    if cap_bytes is None or n_draft * state_bytes <= cap_bytes:
        return "snapshot"
    if state_bytes > cap_bytes:
        raise InvalidArgumentError(
            f"a rollback memory cap of {cap_bytes / 2**20:.1f} MiB is below one copy of this target's recurrent "
            f"state ({state_bytes / 2**20:.1f} MiB), which every rollback needs: raise rollback_memory_mb to at least "
            f"{-(-state_bytes // 2**20)}, or decode plainly (dflash=False)")
    return "checkpoint"


def make_rollback(ctx: Context, n_draft: int, want: str = "auto", seq: int = 0) -> Rollback:
    """The rollback for sequence ``seq`` of ``ctx`` drafting up to ``n_draft`` tokens per step (``want``:
    auto or a kind)."""
    m = ctx.model
    natural = "checkpoint" if (m.is_recurrent or m.is_hybrid) else "seq_rm"
    if natural == "checkpoint" and ctx.n_rs_seq >= max(n_draft, 1):
        natural = "snapshot"
    kind = natural if want == "auto" else want
    if kind not in _BY_NAME:
        raise InvalidArgumentError(f"unknown rollback kind {want!r} (auto, {', '.join(KINDS)})")
    if kind == "seq_rm" and natural != "seq_rm":
        raise InvalidArgumentError(f"{m.arch} has recurrent state: seq_rm rollback cannot serve it")
    if kind == "snapshot" and ctx.n_rs_seq < n_draft:
        raise InvalidArgumentError(f"snapshot rollback needs n_rs_seq >= {n_draft}, target has {ctx.n_rs_seq}")
    return _BY_NAME[kind](ctx, seq)
