"""The decoder with its speed gate: lossless whatever length the gate drafts, fed each step's measured
seconds, every target pass counted, and a new run started where a batch's gate did not take the step
before (the gate's own rules: tests/test_gate.py)."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.decoding.gate import DraftLength
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, Request, SpecOptions

PROMPT = b"def main(argv):\n    parser = argparse.ArgumentParser("


@pytest.mark.parametrize("proposer", ["oracle", "wrong", "drafter"])
def test_adaptive_decoder_is_lossless(models, proposer):
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1)
    pc = Context(tm, opts)
    prompt = tm.tokenize(PROMPT)
    ref = list(DFlashDecoder(pc, None).generate(prompt, 120, stop_tokens=[]))
    full = prompt + ref
    hooks = {"oracle": lambda ctx, n: full[len(ctx):len(ctx) + n],
             "wrong": lambda ctx, n: [(t + 1) % 512 for t in full[len(ctx):len(ctx) + n]],
             "drafter": None}
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    hook = hooks[proposer]
    dec = DFlashDecoder(tc, dc, SpecOptions(adaptive=True), OverrideProposer(hook) if hook else None)
    recorded = []
    record = dec.gate.record
    dec.gate.record = lambda n, a, seconds, **kw: (recorded.append((n, seconds)), record(n, a, seconds, **kw))
    st = GenerationStats()
    out = list(dec.generate(prompt, 120, stats=st, stop_tokens=[]))
    assert out == ref
    assert dec.gate is not None and dec.gate.steps > len(DraftLength.WARMUP)
    if proposer == "oracle":
        # every drafted token accepted, and the gate's acceptance estimate says so (whether full blocks
        # then beat plain steps is this machine's costs: on this tiny pair at 1 thread, oracle blocks of
        # 8 are within about 10% of plain decoding, either way)
        # (the estimate from a few draws is drawn towards an even chance: past one right probe it does not
        # yet take the drafter for one always right, but never for one worse than a coin)
        assert st.drafted > 0 and st.accepted == st.drafted
        g = dec.gate
        assert g.tries[0] > 0 and np.allclose(g.hits, g.tries), (g.hits, g.tries)
        e = g.expected_tokens()
        assert np.all(np.diff(e) > 0.5 ** np.arange(1, len(e))), e
    # the gate is fed each step's measured seconds (a probe's length may keep the prior's cost): its
    # estimates for the lengths it drafted, summed over its steps, are of the order of the generation's
    # own seconds (a constant or a wrong unit would be far off)
    lengths = Counter(n for n, _ in recorded)
    estimate = sum(dec.gate.cost[n] * k for n, k in lengths.items())
    measured = st.t_total - st.t_prefill
    assert 0.2 < estimate / measured < 5, (lengths, dec.gate.cost, measured)
    for c in (dc, tc, pc):
        c.close()
    dm.close()
    tm.close()


def test_target_passes_count_every_pass_that_commits(models):
    """GenerationStats.passes (the demo's "target passes") counts the gate's plain steps too, not only
    the drafting steps: every target decode that commits tokens (the prompt's, which gives the first)."""
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1)
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    prompt = tm.tokenize(PROMPT)
    calls = []
    decode = tc.decode
    tc.decode = lambda rows, pos, **kw: (calls.append(len(rows)), decode(rows, pos, **kw))[1]
    # a drafter that is never right: the gate drafts a probe, then decodes plainly
    wrong = OverrideProposer(lambda ctx, n: [(ctx[-1] + 7) % 512] * n)
    dec = DFlashDecoder(tc, dc, SpecOptions(adaptive=True, calibrate=False), wrong)
    st = GenerationStats()
    out = list(dec.generate(prompt, 60, stats=st, stop_tokens=[]))
    assert len(out) == st.n_generated == 60
    # one pass per step, the first with the prompt's tail (it fits one); each commits its accepted tokens + 1
    assert len(calls) == st.passes == 60 - st.accepted
    assert st.steps < st.passes                                      # plain steps happened and count
    for c in (dc, tc):
        c.close()
    dm.close()
    tm.close()


def test_a_step_whose_gate_did_not_take_the_step_before_starts_a_run(models, monkeypatch):
    """Batched steps use one gate per batch size: before a step after another size's step, a plain step or
    a prefill, the decoder starts a new run on that gate right before it chooses; steps of the same gate
    in a row do not. After a prefill the run is a switch's; after another size's step it goes on from
    that gate's run (a step of the same length in a row is as settled, whatever the batch size)."""
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_seq=2)
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    events = []
    choose, new_run = DraftLength.choose, DraftLength.new_run
    monkeypatch.setattr(DraftLength, "choose", lambda g: (events.append(("choose", g)), choose(g))[1])
    monkeypatch.setattr(DraftLength, "new_run",
                        lambda g, after=None: (events.append(("new", g)), afters.append(after), new_run(g, after))[2])
    afters = []
    prefill = DFlashDecoder._prefill
    monkeypatch.setattr(DFlashDecoder, "_prefill",
                        lambda self, *a, **k: (events.append(("prefill", None)), prefill(self, *a, **k))[1])
    advance = DFlashDecoder._advance

    def fused(self, seqs):   # a step with a joining prompt's tail in it is a prefill for the gates
        heads = any(len(s.head) for s in seqs)
        out = advance(self, seqs)
        if heads:
            events.append(("prefill", None))
        return out
    monkeypatch.setattr(DFlashDecoder, "_advance", fused)
    dec = DFlashDecoder(tc, dc, SpecOptions(adaptive=True, calibrate=False))
    prompt = tm.tokenize(PROMPT)
    events.clear()
    dec.generate_batch([Request(prompt, 40, stop_tokens=[]), Request(prompt[:-3], 12, stop_tokens=[])])
    chooses = [(i, g) for i, (kind, g) in enumerate(events) if kind == "choose"]
    gates = {id(g) for _, g in chooses}
    assert len(gates) == 2, "steps of two sequences, then of one: two gates"
    switched = settled = 0
    for (i, g), (j, before) in zip(chooses[1:], chooses[:-1]):
        started = events[i - 1] == ("new", g)
        prefilled = any(kind == "prefill" for kind, _ in events[j:i])
        if g is not before or prefilled:
            switched += g is not before
            assert started, "the first step of a gate after another gate's step (or a prefill) starts a run"
            after = afters[sum(1 for kind, _ in events[:i - 1] if kind == "new")]
            assert after is (None if prefilled else before), "it goes on from the other gate's run, not a prefill's"
        else:
            settled += 1
            assert not started, "a step right after its own gate's step is a settled one"
    assert switched >= 1 and settled >= 1
    for c in (dc, tc):
        c.close()
    dm.close()
    tm.close()
