"""The rollback kinds of dflash_gguf.decoding.rollback against a recording stand-in for the target
context: what each kind asks of llama.cpp, in what order, and which kind is chosen. (tests/test_hybrid.py
checks they are exact on real hybrid targets.)"""
from __future__ import annotations

import types

import numpy as np
import pytest

from dflash_gguf.errors import InvalidArgumentError, RollbackError
from dflash_gguf.decoding.rollback import (KINDS, AttentionRollback, CheckpointRollback, SnapshotRollback,
                                       choose_for_memory, make_rollback, recurrent_state_bytes)

pytestmark = pytest.mark.pure


class Ctx:
    def __init__(self, arch="qwen3", recurrent=False, hybrid=False, n_rs_seq=0, truncates=True, state=b"S" * 10):
        self.model = types.SimpleNamespace(arch=arch, is_recurrent=recurrent, is_hybrid=hybrid)
        self.n_rs_seq, self.ok, self.state, self.calls = n_rs_seq, truncates, state, []
        self.seqs = []   # the sequence id of each call

    def truncate(self, n, seq=0):
        self.calls.append(("truncate", n))
        self.seqs.append(seq)
        return self.ok

    def save_seq(self, seq=0):
        self.calls.append(("save",))
        self.seqs.append(seq)
        return self.state

    def restore_seq(self, b, seq=0):
        self.calls.append(("restore", b))
        self.seqs.append(seq)

    def decode(self, rows, pos, out_row0=None, seq=0):
        assert rows.dtype == np.int32                # token ids, as llama_batch takes them
        self.calls.append(("decode", list(rows), pos, out_row0))
        self.seqs.append(seq)

    def clear(self):
        self.calls.append(("clear",))


ROWS = np.array([7, 8, 9, 10], dtype=np.int32)


@pytest.mark.parametrize("cls", [AttentionRollback, SnapshotRollback])
def test_removal_kinds_drop_the_rejected_rows(cls):
    c = Ctx()
    r = cls(c)
    assert r.save(3) is None and c.calls == []
    r.keep(20, 2, ROWS, None)
    assert c.calls == [("truncate", 22)]
    c.ok = False
    with pytest.raises(RollbackError, match=r"from 24 to 22 \(rollback=" + r.name):
        r.keep(20, 2, ROWS, None)
    assert repr(r) == f"{cls.__name__}()"


def test_names_and_prefix_reuse():
    assert (AttentionRollback.name, SnapshotRollback.name, CheckpointRollback.name) == KINDS
    assert AttentionRollback.partial_prefix and not SnapshotRollback.partial_prefix
    assert not CheckpointRollback.partial_prefix


def test_checkpoint_saves_restores_and_replays_the_committed_rows():
    c = Ctx(hybrid=True)
    r = CheckpointRollback(c)
    assert r.save(0) is None and c.calls == []          # nothing drafted: nothing to undo
    assert r.save(1) == c.state and c.calls == [("save",)]
    c.calls.clear()
    saved = r.save(3)
    assert saved == c.state and c.calls == [("save",)]
    c.calls.clear()
    r.keep(20, 2, ROWS, saved)
    assert c.calls == [("restore", c.state), ("truncate", 20), ("decode", [7, 8], 20, 2)]
    with pytest.raises(RollbackError, match="^checkpoint rollback without a saved state$"):
        r.keep(20, 2, ROWS, None)
    c.ok = False
    with pytest.raises(RollbackError, match="could not drop the rejected rows after restoring the state at 20"):
        r.keep(20, 2, ROWS, saved)


def test_recurrent_state_bytes_measures_one_copy_and_clears():
    c = Ctx(hybrid=True, state=b"x" * 123)
    assert recurrent_state_bytes(c) == 123
    assert c.calls == [("clear",), ("decode", [0], 0, None), ("save",), ("clear",)]


@pytest.mark.parametrize("ctx, want, n_draft, kind", [
    (Ctx(), "auto", 7, AttentionRollback),
    (Ctx(hybrid=True), "auto", 7, CheckpointRollback),
    (Ctx(recurrent=True), "auto", 7, CheckpointRollback),
    (Ctx(hybrid=True, n_rs_seq=7), "auto", 7, SnapshotRollback),
    (Ctx(hybrid=True, n_rs_seq=6), "auto", 7, CheckpointRollback),
    (Ctx(hybrid=True, n_rs_seq=1), "auto", 0, SnapshotRollback),
    (Ctx(hybrid=True, n_rs_seq=0), "auto", 0, CheckpointRollback),
    (Ctx(hybrid=True, n_rs_seq=7), "checkpoint", 7, CheckpointRollback),
    (Ctx(hybrid=True, n_rs_seq=7), "snapshot", 7, SnapshotRollback),
    (Ctx(), "seq_rm", 7, AttentionRollback),
])
def test_make_rollback_picks_the_kind(ctx, want, n_draft, kind):
    r = make_rollback(ctx, n_draft, want) if want != "auto" else make_rollback(ctx, n_draft)
    assert type(r) is kind and r.ctx is ctx


def test_make_rollback_refuses_what_cannot_be_exact():
    with pytest.raises(InvalidArgumentError, match=r"unknown rollback kind 'magic' \(auto, seq_rm, snapshot, checkpoint\)"):
        make_rollback(Ctx(), 7, "magic")
    with pytest.raises(InvalidArgumentError, match="qwen35 has recurrent state: seq_rm rollback cannot serve it"):
        make_rollback(Ctx(arch="qwen35", hybrid=True), 7, "seq_rm")
    with pytest.raises(InvalidArgumentError, match="snapshot rollback needs n_rs_seq >= 7, target has 6"):
        make_rollback(Ctx(hybrid=True, n_rs_seq=6), 7, "snapshot")


def test_choose_for_memory():
    mib = 2 ** 20
    assert choose_for_memory(10 * mib, 15, None) == "snapshot"
    assert choose_for_memory(10 * mib, 15, 150 * mib) == "snapshot"
    assert choose_for_memory(10 * mib, 15, 150 * mib - 1) == "checkpoint"
    assert choose_for_memory(10 * mib, 0, None) == "checkpoint"
    assert choose_for_memory(10 * mib, 1, 10 * mib) == "snapshot"
    assert choose_for_memory(10 * mib, 2, 10 * mib) == "checkpoint"       # one copy fits exactly
    with pytest.raises(InvalidArgumentError, match=r"cap of 9.5 MiB is below one copy .* \(10.0 MiB\).* at least 10,"):
        choose_for_memory(10 * mib, 15, int(9.5 * mib))
    with pytest.raises(InvalidArgumentError, match="at least 11,"):
        choose_for_memory(10 * mib + 1, 15, 10 * mib)


@pytest.mark.parametrize("kind", ["seq_rm", "checkpoint"])
def test_a_rollback_acts_on_its_own_sequence(kind):
    """In a context of several sequences each sequence's rollback touches that sequence only."""
    ctx = Ctx(recurrent=kind == "checkpoint")
    rb = make_rollback(ctx, 3, kind, seq=2)
    saved = rb.save(3)
    rb.keep(5, 2, ROWS, saved)
    assert ctx.calls and ctx.seqs == [2] * len(ctx.calls)


def test_the_default_sequence_is_zero():
    """Without a sequence id a rollback acts on sequence 0 (a one-sequence context's only one)."""
    for rb in (make_rollback(ctx := Ctx(), 3), AttentionRollback(ctx)):
        rb.keep(5, 2, ROWS, rb.save(3))
    assert ctx.seqs == [0, 0]
