"""Sampling stays lossless: DFlash at temperature > 0 has the target's own output distribution.

Statistical test: chi-square goodness of fit of the empirical distribution of the first three
generated tokens against the exact distribution computed from the target's logits (top_k=2, so
8 outcomes; rare ones pooled, chi2_pvalue). At alpha = 0.001 a correct sampler is flagged in 0.1% of
runs (a false alarm), a wrong one (e.g. accepting drafts without the rejection rule, or sampling the
bonus from the wrong row) fails by a wide margin.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from collections import Counter

import numpy as np
import pytest

from dflash_gguf.demo import DEMO_DIR
from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.decoding.sampling import SamplingParams, distribution, surprise
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, SpecOptions

PROMPT = b"def main(argv):\n    parser = argparse.ArgumentParser("
ALPHA = 1e-3
POOL = 5.0      # outcomes expected fewer times than this share one cell of the chi-square test
K_TOKENS = 3
N_RUNS = 1500
TRAINED_TARGET = DEMO_DIR / "target.gguf"                                   # the shipped demo target and
TRAINED_DFLASH2 = DEMO_DIR.parent / "demo-dflash2" / "drafter.gguf"         # its trained DFlash2 drafter


def chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (series for the lower incomplete gamma)."""
    s, z = k / 2.0, x / 2.0
    term = math.exp(-z + s * math.log(z) - math.lgamma(s + 1)) if z > 0 else 0.0
    total, n = term, 0
    while term > 1e-15 * total and n < 10_000:
        n += 1
        term *= z / (s + n)
        total += term
    return max(0.0, 1.0 - total)


def chi2_pvalue(counts: Counter, exact: dict) -> float:
    """Pearson's test of ``counts`` against the ``exact`` probabilities of every outcome. Outcomes expected
    fewer than ``POOL`` times share one cell, and that cell takes in the next least likely outcomes until it
    too is expected ``POOL`` times: the statistic is no chi-square where a cell's expected count is tiny (one
    draw of an outcome expected 0.018 times weighs 54 on its own, p = 1e-10 over 8 outcomes, although a
    correct sampler draws it in 1.8% of 1500-sample runs)."""
    n = sum(counts.values())
    assert set(counts) <= set(exact), f"impossible outcomes sampled: {set(counts) - set(exact)}"
    by_expected = sorted(((n * p, counts.get(o, 0)) for o, p in exact.items()), key=lambda c: c[0])
    pooled_e = pooled_c = 0.0
    while by_expected and (by_expected[0][0] < POOL or 0 < pooled_e < POOL):
        e, c = by_expected.pop(0)
        pooled_e, pooled_c = pooled_e + e, pooled_c + c
    cells = [(c, e) for e, c in by_expected] + ([(pooled_c, pooled_e)] if pooled_e > 0 else [])
    if len(cells) < 2:
        raise AssertionError(f"nothing to test: one outcome carries the distribution ({exact})")
    stat = sum((c - e) ** 2 / e for c, e in cells)
    return chi2_sf(stat, len(cells) - 1)


@pytest.fixture(scope="module")
def setup(models):
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    pc = Context(tm, opts)
    yield pair, tm, dm, pc
    pc.close()
    dm.close()
    tm.close()


def exact_distribution(ctx: Context, prompt: list[int], sp: SamplingParams) -> dict:
    """P(t1, t2, t3) from the target's logits, one prefix at a time (every path through the candidates;
    mirostat's state carried along each path)."""
    def dist_after(prefix, mu):
        ctx.clear()
        ctx.decode(np.array(prefix, np.int32), 0, out_row0=len(prefix) - 1)
        ids, p = distribution(ctx.logits_row(len(prefix) - 1).copy(), sp, mu=mu)
        return {int(i): float(q) for i, q in zip(ids, p)}

    out = {}

    def walk(prefix, prob, mu):
        if len(prefix) == len(prompt) + K_TOKENS:
            out[tuple(prefix[len(prompt):])] = prob
            return
        for tok, q in dist_after(prefix, mu).items():
            walk(prefix + [tok], prob * q, mu - sp.mirostat_eta * (surprise(q) - sp.mirostat_tau))

    walk(list(prompt), 1.0, 2.0 * sp.mirostat_tau)
    return out


SP = SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0)
SP_TYPICAL = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, typical_p=0.6)
# mirostat v2 with a tau that truncates this target's rows to a few tokens, and mu moving between them
SP_MIROSTAT = SamplingParams(temperature=1.0, mirostat_mode=2, mirostat_tau=1.5, mirostat_eta=0.5)


@pytest.mark.parametrize("proposer", ["oracle", "drafter"])
def test_dflash_sampling_matches_target_distribution(setup, proposer):
    pair, tm, dm, pc = setup
    prompt = tm.tokenize(PROMPT)
    exact = exact_distribution(pc, prompt, SP)
    assert abs(sum(exact.values()) - 1) < 1e-6

    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    greedy = list(DFlashDecoder(pc, None).generate(prompt, K_TOKENS, stop_tokens=[]))
    hook = (lambda ctx, n: greedy[len(ctx) - len(prompt):][:n]) if proposer == "oracle" else None
    dec = DFlashDecoder(tc, dc, SpecOptions(), OverrideProposer(hook) if hook else None)
    counts, st = Counter(), GenerationStats()
    for seed in range(N_RUNS):
        sp = SamplingParams(**{**SP.__dict__, "seed": seed})
        counts[tuple(dec.generate(prompt, K_TOKENS, sampling=sp, stats=st, stop_tokens=[]))] += 1
    dc.close()
    tc.close()
    if proposer == "oracle":
        assert st.drafted > 0 and 0 < st.accepted < st.drafted   # both accept and reject paths ran
    p = chi2_pvalue(counts, exact)
    assert p > ALPHA, f"DFlash samples do not follow the target distribution (p={p:.2e}): {counts} vs {exact}"


@pytest.mark.parametrize("sp0", [SP_TYPICAL, SP_MIROSTAT], ids=["typical", "mirostat"])
def test_typical_p_and_mirostat_keep_the_target_distribution(setup, sp0):
    """typical_p < 1 (llama.cpp's locally typical filter after top-k) and mirostat v2 (its state moved by
    every decided token, rows of one step included) through DFlash with the drafter and with an oracle:
    the same distribution as the target's own chain. The filter must matter here: it leaves out outcomes
    the wider setting allows."""
    pair, tm, dm, pc = setup
    prompt = tm.tokenize(PROMPT)
    exact = exact_distribution(pc, prompt, sp0)
    if sp0.mirostat:
        assert 4 <= len(exact) < 200    # a few candidates per row
    else:
        wider = exact_distribution(pc, prompt, SamplingParams(**{**sp0.__dict__, "typical_p": 1.0}))
        assert set(exact) < set(wider)
    assert abs(sum(exact.values()) - 1) < 1e-6
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    greedy = list(DFlashDecoder(pc, None).generate(prompt, K_TOKENS, stop_tokens=[]))
    for hook in (None, lambda ctx, n: greedy[len(ctx) - len(prompt):][:n]):
        dec = DFlashDecoder(tc, dc, SpecOptions(), OverrideProposer(hook) if hook else None)
        counts, st = Counter(), GenerationStats()
        for seed in range(N_RUNS):
            sp = SamplingParams(**{**sp0.__dict__, "seed": seed})
            counts[tuple(dec.generate(prompt, K_TOKENS, sampling=sp, stats=st, stop_tokens=[]))] += 1
        assert st.drafted > 0
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"typical_p samples do not follow the target distribution (p={p:.2e}): {counts} vs {exact}"
    dc.close()
    tc.close()


@pytest.mark.parametrize("sp", [SP, SP_TYPICAL, SP_MIROSTAT], ids=["top-k", "typical", "mirostat"])
def test_plain_llama_cpp_sampler_matches_the_same_distribution(setup, sp):
    """Checks sampling.distribution() reproduces llama.cpp's own chain (the 'plain' side)."""
    import llama_cpp

    pair, tm, dm, pc = setup
    prompt = tm.tokenize(PROMPT)
    exact = exact_distribution(pc, prompt, sp)
    llm = llama_cpp.Llama(model_path=str(pair.target), n_ctx=256, n_batch=64, verbose=False, seed=0,
                          flash_attn=True)   # same attention kernel as our contexts (llama.cpp auto = on)
    counts = Counter()
    for seed in range(600):
        llm.set_seed(seed)
        out = []
        for t in llm.generate(prompt, temp=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                              typical_p=sp.typical_p, repeat_penalty=1.0, mirostat_mode=sp.mirostat_mode,
                              mirostat_tau=sp.mirostat_tau, mirostat_eta=sp.mirostat_eta):
            out.append(t)
            if len(out) == K_TOKENS:
                break
        counts[tuple(out)] += 1
    llm.close()
    p = chi2_pvalue(counts, exact)
    assert p > ALPHA, f"llama.cpp samples disagree with sampling.distribution (p={p:.2e})"


def test_chi2_detects_a_wrong_distribution():
    exact = {(0,): 0.5, (1,): 0.3, (2,): 0.2}
    assert chi2_pvalue(Counter({(0,): 500, (1,): 300, (2,): 200}), exact) > 0.5
    assert chi2_pvalue(Counter({(0,): 600, (1,): 250, (2,): 150}), exact) < ALPHA
    assert abs(chi2_sf(24.322, 7) - 0.001) < 2e-5


# the DSpark pair's distribution of its first three tokens (test_dspark): one outcome has probability 1.2e-5
RARE_TAIL = {(0,): 0.0500, (1,): 0.2548, (2,): 0.0314, (3,): 1.194e-5, (4,): 0.00653, (5,): 0.4804, (6,): 0.1707,
             (7,): 0.00613}


def test_chi2_false_alarms_stay_near_alpha_with_a_rare_outcome():
    """A correct sampler's runs are flagged about ALPHA of the time, also where an outcome is expected 0.018 times
    in a run and shows up once (1.8% of runs): that one draw alone is no evidence."""
    rng = np.random.default_rng(0)
    keys, p = list(RARE_TAIL), np.array(list(RARE_TAIL.values()))
    runs = rng.multinomial(N_RUNS, p / p.sum(), size=4000)
    flagged = sum(chi2_pvalue(Counter(dict(zip(keys, r))), RARE_TAIL) < ALPHA for r in runs)
    assert flagged <= 4000 * 3 * ALPHA
    # ... and that outcome drawn 25 times is still caught (its pooled cell: 34 draws where 9.2 are expected)
    rare = Counter({(0,): 75, (1,): 375, (2,): 47, (3,): 25, (4,): 10, (5,): 710, (6,): 249, (7,): 9})
    assert chi2_pvalue(rare, RARE_TAIL) < ALPHA


@pytest.mark.parametrize("penalties", [dict(repeat_penalty=1.3), dict(frequency_penalty=0.7, presence_penalty=0.4),
                                       dict(repeat_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2)])
def test_greedy_penalties_match_llama_cpp(setup, penalties):
    import llama_cpp

    pair, tm, dm, pc = setup
    prompt = tm.tokenize(b"    for key, value in sorted(items):\n        if")
    llm = llama_cpp.Llama(model_path=str(pair.target), n_ctx=256, n_batch=64, verbose=False, seed=0,
                          flash_attn=True)   # same attention kernel as our contexts (llama.cpp auto = on)
    ref = []
    for t in llm.generate(prompt, temp=0.0, **penalties):
        ref.append(t)
        if len(ref) == 60:
            break
    llm.close()
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    sp = SamplingParams(temperature=0.0, penalty_last_n=64, **penalties)
    st = GenerationStats()
    out = list(DFlashDecoder(tc, dc).generate(prompt, len(ref), sampling=sp, stats=st))
    dc.close()
    tc.close()
    assert out == ref
    assert st.steps > 0


@contextlib.contextmanager
def dflash2_decoder(target, drafter, spec: SpecOptions):
    """A DFlash2 decoder on fresh contexts, the prompt and the target's exact distribution after it."""
    tm, dm = Model(target), Model(drafter)
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    pc, tc = Context(tm, opts), Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    try:
        prompt = tm.tokenize(PROMPT)
        exact = exact_distribution(pc, prompt, SP)
        dec = DFlashDecoder(tc, dc, spec)
        assert dec.info.kind == "dflash2" and dec.lattice is not None
        yield dec, prompt, exact
    finally:
        dc.close(), tc.close(), pc.close(), dm.close(), tm.close()


def sample_counts(dec: DFlashDecoder, prompt: list[int], stats: GenerationStats, seeded: bool = True) -> Counter:
    """How often each first-K_TOKENS sequence came out of N_RUNS requests (seeds 0.., or unseeded). Seeded
    ones are not marked repeatable: they draw from the drafter's own distribution (its lattice) with the
    seed's stream, as unseeded requests do (a repeatable request drafts point masses)."""
    counts = Counter()
    for seed in range(N_RUNS):
        sp = SamplingParams(**{**SP.__dict__, "seed": seed if seeded else None, "repeatable": False})
        counts[tuple(dec.generate(prompt, K_TOKENS, sampling=sp, stats=stats, stop_tokens=[]))] += 1
    return counts


def test_dflash2_samples_from_the_selector_and_keeps_the_target_distribution(models):
    """A DFlash2 drafter at temperature > 0: drafts are drawn from its selector's top-k distribution
    (patch 0008's lattice; q is not one-hot), accepted with min(1, p/q); the first three tokens still
    follow the target's exact distribution, and a request with a seeded stream repeats itself."""
    pair = models.pair("qwen3", "dflash2", 8)
    with dflash2_decoder(pair.target, pair.drafter, SpecOptions()) as (dec, prompt, exact):
        calls, qs = [0], []
        inner = dec.lattice.propose

        def spy(*a, **k):
            calls[0] += 1
            n, q = inner(*a, **k)
            qs.extend(q)
            return n, q
        dec.lattice.propose = spy
        st = GenerationStats()
        counts = sample_counts(dec, prompt, st)
        assert calls[0] > 0 and st.drafted > 0
        assert all(abs(q.sum() - 1) < 1e-9 for _, q in qs) and any(q.max() < 1 for _, q in qs)
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"DFlash2 samples do not follow the target distribution (p={p:.2e})"
        sp = SamplingParams(temperature=0.8, seed=11, repeatable=False)
        first = list(dec.generate(prompt, 24, sampling=sp))
        assert list(dec.generate(prompt, 24, sampling=sp)) == first


def test_dflash2_lattice_on_the_trained_drafter_keeps_the_target_distribution():
    """The shipped DFlash2 demo drafter (``data/demo-dflash2``, trained): its selector's q is peaked and
    often right, so unlike the random drafter above most drafts are accepted through min(1, p/q) and the
    rejections draw from the residual max(0, p - q) with q's mass partly outside the target's top-2.
    The first three tokens still follow the target's exact distribution."""
    with dflash2_decoder(TRAINED_TARGET, TRAINED_DFLASH2, SpecOptions()) as (dec, prompt, exact):
        st = GenerationStats()
        counts = sample_counts(dec, prompt, st)
        assert st.accepted > 0.2 * st.drafted, (st.accepted, st.drafted)   # the accept path carries the test (~30%)
        assert st.accepted < st.drafted                                     # and rejections happen
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"DFlash2 samples do not follow the target distribution (p={p:.2e})"


def test_unseeded_sampling_is_gated_and_keeps_the_target_distribution(monkeypatch):
    """A sampled request without a seed goes through the speed gate (its own acceptance history, kept
    across calls; the greedy gate is not touched), so its draft length changes from step to step; the
    first three tokens still follow the target's exact distribution. A seeded request is gated too (its
    text does not depend on what is drafted). The gate's choices follow timings; measured ones differ between machines (on a slow
    verify the gate rightly decodes this tiny pair plainly and nothing is drafted to test), so the gate
    is charged a cost model in which drafting pays, the prior included, and the unseeded random
    generators are numbered: what the gate chooses is then the same on every machine."""
    from dflash_gguf.decoding import calibration
    from dflash_gguf.decoding.sampling import TokenChooser

    def model_cost(n):
        return 1e-3 * (1 + 0.1 * n)        # a step drafting n tokens costs a plain step and 10% a token
    monkeypatch.setattr(calibration, "step_costs", lambda dec: np.array([model_cost(n) for n in range(dec.n_draft + 1)]))
    monkeypatch.setattr(calibration, "check_prior", lambda *a: True)   # the model prior is never cached

    numbered = itertools.count()
    init = TokenChooser.__init__

    def numbered_init(self, sp, constraints=None):
        init(self, sp, constraints)
        if sp.seed is None:
            self.rng = np.random.default_rng(next(numbered))
            self._key = next(numbered)
    monkeypatch.setattr(TokenChooser, "__init__", numbered_init)

    with dflash2_decoder(TRAINED_TARGET, TRAINED_DFLASH2, SpecOptions(adaptive=True)) as (dec, prompt, exact):
        lengths = Counter()
        record = dec.gate_sampled.record

        def spy(n, a, seconds, **kw):
            lengths[n] += 1
            record(n, a, model_cost(n), **kw)
        dec.gate_sampled.record = spy
        st = GenerationStats()
        counts = sample_counts(dec, prompt, st, seeded=False)
        assert len(lengths) >= 2 and st.accepted > 0, lengths        # the gate chose; drafts were kept
        assert dec.gate.steps == 0                                    # greedy requests keep their own gate
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"gated DFlash2 samples do not follow the target distribution (p={p:.2e})"
        steps = dec.gate_sampled.steps
        list(dec.generate(prompt, 24, sampling=SamplingParams(temperature=0.8, seed=3)))
        assert dec.gate_sampled.steps > steps                         # a seeded request is gated too
