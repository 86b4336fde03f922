"""bench.confidence's replay of recorded DSpark steps: every policy's text is plain decoding's, alone and
with several sequences decoded together, and each recorded step keeps what it recorded."""
from __future__ import annotations

import numpy as np

from dflash_gguf.bench.confidence import TraceBook, load_traces, measure_batch


def test_recorded_steps_load_as_confidences_and_accepted_counts(tmp_path):
    name, steps = load_traces("demo-dspark")
    assert name == "demo-dspark" and len(steps) > 100
    assert all(0 <= a <= len(c) and all(0.0 <= x <= 1.0 for x in c) for c, a in steps)
    f = tmp_path / "t.json"
    f.write_text('[{"accepted": 9, "confidence": [0.5]}]')
    try:
        load_traces(str(f))
    except ValueError as e:
        assert "accepted" in str(e)
    else:
        raise AssertionError("a step that accepts more than it drafted was taken")


def test_a_trace_book_gives_each_sequence_its_own_continuation_wrong_at_the_recorded_step():
    refs = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 30, 40, 50, 60, 70, 80, 90]]
    steps = [([0.9, 0.8, 0.1], 2), ([0.7, 0.2, 0.2], 0)]
    book = TraceBook(refs, steps, n_vocab=100)
    out, conf = np.zeros((3, 3), dtype=np.int32), np.zeros((3, 3), dtype=np.float32)
    contexts = [[1, 2], [1, 2, 30, 40], [5, 5]]
    pending = np.array([3, 50, 5], dtype=np.int32)
    n = _replace(book, 3, out, conf, contexts, pending)     # the drafter's own call skipped
    assert n == 3
    assert out[0].tolist() == [4, 5, 7]                  # 2 right, the third made wrong
    assert out[1].tolist()[0] != 60                      # none right
    assert out[2].tolist() == [6, 6, 6] and book.diverged == 1       # no reference starts with [5, 5, 5]
    np.testing.assert_allclose(conf[0], [0.9, 0.8, 0.1])


def _replace(book, n, out, conf, contexts, pending):
    """TraceBook.propose past its drafter call (DrafterProposer.propose) on plain arrays."""
    from dflash_gguf.decoding.proposer import DrafterProposer

    saved = DrafterProposer.propose
    DrafterProposer.propose = lambda self, drafter, seqs, pos, pend, n, out, context, conf=None: n
    try:
        seqs = np.arange(len(contexts), dtype=np.int32)
        return TraceBook.propose(book, None, seqs, seqs, pending, n, out, lambda j: contexts[j], conf)
    finally:
        DrafterProposer.propose = saved


def test_every_policy_decoding_sequences_together_gives_plain_decodings_text(models):
    pair = models.pair()
    _, steps = load_traces("demo-dspark")
    r = measure_batch(pair.target, pair.drafter, steps, sequences=2, tokens=24, trials=1, threads=1, n_draft=4)
    assert r["all_equal_plain"]
    assert {"plain", "fixed 1", "fixed 4", "history", "confidence", "oracle"} <= set(r["tokens_per_second"])
    assert r["tau"]["fixed 4"] > 1.0 and r["tau"]["plain"] == 1.0     # recorded steps keep tokens; plain keeps one a pass
    # the oracle verifies only what each sequence's step keeps, and keeps what the whole block keeps
    assert r["tau"]["oracle"] == r["tau"]["fixed 4"]
    assert r["of_oracle"]["oracle"] == 1.0


def test_the_oracle_verifies_exactly_what_each_sequence_keeps():
    """verify_accepted cuts each sequence's block to the count its recorded step accepts, whatever was drafted."""
    from types import SimpleNamespace

    from dflash_gguf.bench.confidence import verify_accepted

    book = TraceBook([[1, 2, 3, 4, 5, 6, 7, 8]], [([0.5] * 4, 3), ([0.5] * 4, 1)], n_vocab=100, oracle=True)
    dec = SimpleNamespace(proposer=book, policy=SimpleNamespace())
    verify_accepted(dec, book)
    out = np.zeros((2, 4), dtype=np.int32)
    _replace(book, 4, out, None, [[1, 2], [9]], np.array([3, 9], dtype=np.int32))
    assert book.accepted == {0: 3, 1: 0}          # the second context starts no reference: nothing kept
    plan = SimpleNamespace(lengths=[4, 4])
    dec.policy.verify_rows([SimpleNamespace(slot=0), SimpleNamespace(slot=1)], plan, None, False)
    assert plan.lengths == [3, 0]
