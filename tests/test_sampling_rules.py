"""The sampler chain and rejection sampling of dflash_gguf.decoding.sampling on small arrays, with exact
expectations (tests/test_sampling.py checks the distributions end to end against llama.cpp on real
decodes; these pin each rule down for ``make mutate``)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf.decoding import sampling as S
from dflash_gguf.decoding.constraints import Constraints
from dflash_gguf.decoding.sampling import SamplingParams, TokenChooser, apply_penalties, constrained_argmax, distribution

pytestmark = pytest.mark.pure

LOGITS = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)


def softmax(x):
    e = np.exp(np.asarray(x, float) - max(x))
    return e / e.sum()


# ----------------------------------------------------------------------------- SamplingParams
def test_params_flags():
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repeat_penalty=1.1).has_penalties and SamplingParams(frequency_penalty=0.1).has_penalties
    assert SamplingParams(presence_penalty=-0.1).has_penalties
    assert not SamplingParams(repeat_penalty=1.1, penalty_last_n=0).has_penalties
    assert SamplingParams(repeat_penalty=1.1, penalty_last_n=-1).has_penalties
    assert SamplingParams(seed=1).is_repeatable and not SamplingParams().is_repeatable
    assert not SamplingParams(seed=1, repeatable=False).is_repeatable and SamplingParams(repeatable=True).is_repeatable


def test_typical_keeps_the_tokens_nearest_the_entropy():
    """p = 1/2, 1/4, 1/8, 1/8: entropy 1.75 bits, surprises 1, 2, 3, 3 bits, so the most typical token
    is the second (|2 - 1.75|), then the first, then the two last; kept until the mass exceeds typical_p,
    and returned best first."""
    lg = np.log([0.5, 0.25, 0.125, 0.125]).astype(np.float32)
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    for mass, kept in ((0.2, [1]), (0.25, [1, 0]), (0.5, [1, 0]), (0.8, [0, 1, 2]), (0.99, [0, 1, 2, 3])):
        ids, p = distribution(lg, SamplingParams(**{**sp.__dict__, "typical_p": mass}))
        want = sorted(kept)
        assert ids.tolist() == want, mass
        kept_p = np.array([0.5, 0.25, 0.125, 0.125])[want]
        np.testing.assert_allclose(p, kept_p / kept_p.sum())
    # after typical, top-p and min-p see the kept tokens only (llama.cpp's order: typical first)
    ids, _ = distribution(lg, SamplingParams(temperature=1.0, top_k=0, top_p=0.6, min_p=0.0, typical_p=0.8))
    assert ids.tolist() == [0, 1]           # of 0.5, 0.25, 0.125 (renormalised): 0.57 < 0.6, 0.86 >= 0.6
    ids, _ = distribution(lg, SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, typical_p=0.5))
    assert ids.tolist() == [0]              # top-k first: of 2/3, 1/3 (entropy 0.64 nats, surprises 0.41 and
    #                                         1.10) the first is the more typical, and its 2/3 exceeds 0.5


def _apply_llama_cpp(smpl, logits: np.ndarray) -> np.ndarray:
    """llama.cpp's sampler ``smpl`` applied to ``logits`` (then freed): the candidates it leaves."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")    # the reference (absent under --pure)

    from dflash_gguf.decoding.constraints import TOKEN_DATA
    buf = np.zeros(len(logits), dtype=TOKEN_DATA)
    buf["id"], buf["logit"] = np.arange(len(logits)), logits
    arr = llama_cpp.llama_token_data_array(data=buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)),
                                           size=len(logits), selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(smpl, ctypes.byref(arr))
    llama_cpp.llama_sampler_free(smpl)
    return buf[:arr.size]


def _llama_cpp_chain(logits: np.ndarray, sp: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The candidates and probabilities llama.cpp's own chain (as llama_cpp builds it for sampling,
    min_keep 1) leaves for ``dist`` to draw from."""
    llama_cpp = pytest.importorskip("llama_cpp")    # the reference (absent under --pure)

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    for smpl in (llama_cpp.llama_sampler_init_top_k(sp.top_k), llama_cpp.llama_sampler_init_typical(sp.typical_p, 1),
                 llama_cpp.llama_sampler_init_top_p(sp.top_p, 1), llama_cpp.llama_sampler_init_min_p(sp.min_p, 1),
                 llama_cpp.llama_sampler_init_temp(sp.temperature)):
        llama_cpp.llama_sampler_chain_add(chain, smpl)
    out = _apply_llama_cpp(chain, logits)
    out = out[np.argsort(out["id"])]
    return out["id"].astype(np.int64), softmax(out["logit"])


@pytest.mark.parametrize("seed", range(6))
def test_the_chain_matches_llama_cpps_own_samplers(seed):
    """Differential: random logits (a peaked and a flat vocabulary, spread like a real model's), random
    settings of every filter, typical_p among them; the same candidates and probabilities as llama.cpp's
    C samplers, unless a candidate sits within float32 rounding of a cut-off (then both sets are valid)."""
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(40):
        n = int(rng.choice([50, 1000, 5000]))
        logits = (rng.standard_normal(n) * rng.choice([1.0, 3.0, 8.0])).astype(np.float32)
        sp = SamplingParams(temperature=float(rng.choice([0.3, 0.8, 1.5])), top_k=int(rng.choice([0, 5, 40, 400])),
                            top_p=float(rng.choice([1.0, 0.95, 0.7])), min_p=float(rng.choice([0.0, 0.05, 0.2])),
                            typical_p=float(rng.choice([1.0, 0.9, 0.5, 0.2])))
        ids, p = distribution(logits, sp)
        ref_ids, ref_p = _llama_cpp_chain(logits, sp)
        if set(ids.tolist()) ^ set(ref_ids.tolist()):
            near = _near_a_cut(logits, sp)
            assert near, f"{sp}: ours keeps {sorted(ids.tolist())[:20]}, llama.cpp {ref_ids.tolist()[:20]}"
            continue
        order = np.argsort(ids)
        np.testing.assert_array_equal(ids[order], ref_ids)
        np.testing.assert_allclose(p[order], ref_p, rtol=1e-4, atol=1e-7)
        checked += 1
    assert checked >= 36            # boundary cases are rare; most trials compare exactly


def _near_a_cut(logits: np.ndarray, sp: SamplingParams) -> bool:
    """Whether a cumulative-mass cut-off of this chain lands within float32 rounding of a boundary
    (llama.cpp sums in float32, this module in float64): move each mass by 1e-5 and see the set change."""
    base = set(distribution(logits, sp)[0].tolist())
    for field in ("typical_p", "top_p"):
        v = getattr(sp, field)
        if v >= 1.0:
            continue
        for d in (-1e-5, 1e-5):
            moved = SamplingParams(**{**sp.__dict__, field: v + d})
            if set(distribution(logits, moved)[0].tolist()) != base:
                return True
    return False


# ----------------------------------------------------------------------------- penalties
def test_penalties_follow_llama_cpp():
    sp = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5, penalty_last_n=3)
    history = [0, 1, 0, 3, 0]                       # last 3: 3, 0 (x1 each)... window = [0, 3, 0]
    out = apply_penalties(LOGITS, history, sp)
    want = LOGITS.copy()
    want[0] = 2.0 / 2.0 - 2 * 0.25 - 0.5            # positive: divided; seen twice in the window
    want[3] = 3.0 / 2.0 - 1 * 0.25 - 0.5
    np.testing.assert_array_equal(out, want)
    assert out.dtype == np.float32 and LOGITS[0] == 2.0   # a copy
    neg = apply_penalties(LOGITS, [1], SamplingParams(repeat_penalty=2.0))
    assert neg[1] == -2.0 and neg[0] == 2.0          # non-positive: multiplied
    zero = apply_penalties(np.array([0.0, 1.0], np.float32), [0], SamplingParams(repeat_penalty=2.0))
    assert zero[0] == 0.0
    whole = apply_penalties(LOGITS, history, SamplingParams(frequency_penalty=1.0, penalty_last_n=-1))
    assert whole[0] == 2.0 - 3 and whole[1] == -1.0 - 1 and whole[3] == 3.0 - 1
    last = apply_penalties(LOGITS, history, SamplingParams(frequency_penalty=1.0, penalty_last_n=1))
    assert last[0] == 2.0 - 1 and last[3] == 3.0 and last[1] == -1.0      # only the last token
    small = apply_penalties(LOGITS, [2], SamplingParams(repeat_penalty=2.0))
    assert small[2] == 0.25                           # 0 < 0.5 <= 1 is positive: divided


def test_no_penalty_or_no_history_returns_the_logits():
    assert apply_penalties(LOGITS, [0], SamplingParams()) is LOGITS
    assert apply_penalties(LOGITS, [], SamplingParams(repeat_penalty=1.5)) is LOGITS


# ----------------------------------------------------------------------------- the filter chain
def test_raw_distribution_for_negative_temperature():
    ids, p = distribution(LOGITS, SamplingParams(temperature=-1.0, top_k=1, top_p=0.1, min_p=0.9))
    assert ids.tolist() == [3, 0, 5, 2, 1, 4]          # every token, best first; no filter applies
    np.testing.assert_allclose(p, softmax(LOGITS[[3, 0, 5, 2, 1, 4]]))


@pytest.mark.parametrize("top_k, want", [(2, [3, 0]), (1, [3]), (0, [3, 0, 5, 2, 1, 4]), (6, [3, 0, 5, 2, 1, 4]),
                                         (99, [3, 0, 5, 2, 1, 4]), (5, [3, 0, 5, 2, 1])])
def test_top_k(top_k, want):
    ids, p = distribution(LOGITS, SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0))
    assert ids.tolist() == want
    np.testing.assert_allclose(p, softmax(LOGITS[want]))


def test_top_p_keeps_the_smallest_prefix_reaching_it():
    full = softmax(LOGITS[[3, 0, 5, 2, 1, 4]])
    cum = np.cumsum(full)                              # 0.574, 0.785, 0.863, 0.911, ...
    for top_p, n in [(cum[0] - 1e-9, 1), (cum[0] + 1e-6, 2), (cum[1] - 1e-6, 2), (cum[2] + 1e-6, 4), (0.01, 1), (0.9999, 6)]:
        ids, p = distribution(LOGITS, SamplingParams(temperature=1.0, top_k=0, top_p=float(top_p), min_p=0.0))
        assert len(ids) == n, (top_p, n)
        np.testing.assert_allclose(p, softmax(LOGITS[ids]))


def test_min_p_can_leave_the_best_token_alone():
    ids, p = distribution(LOGITS, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5))
    assert ids.tolist() == [3] and p.tolist() == [1.0]


def test_ties_keep_the_lower_id_first_and_top_k_finds_the_best_k():
    rng = np.random.default_rng(3)
    lg = rng.integers(0, 4, 400).astype(np.float32)            # many ties
    for sp in (SamplingParams(temperature=-1.0), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
               SamplingParams(temperature=1.0, top_k=400, top_p=1.0, min_p=0.0)):
        ids, _ = distribution(lg, sp)
        assert ids.tolist() == sorted(range(400), key=lambda i: (-lg[i], i)), sp
    ids, _ = distribution(lg, SamplingParams(temperature=1.0, top_k=150, top_p=1.0, min_p=0.0))
    assert (lg[ids] == np.sort(lg)[::-1][:150]).all()  # the best 150 (which of equal ones: any)
    real = rng.normal(size=300).astype(np.float32)
    for k in (2, 10, 299):
        ids, _ = distribution(real, SamplingParams(temperature=1.0, top_k=k, top_p=1.0, min_p=0.0))
        assert ids.tolist() == np.argsort(-real, kind="stable")[:k].tolist()


def test_the_same_seed_draws_the_same_tokens_at_each_position():
    """A token is drawn from its position's own stream: the same seed, the same draw at every position,
    however it is asked for (a pick, or the verify of any draft) and however often."""
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    a, b = TokenChooser(sp), TokenChooser(sp)
    seq = [a.pick(LOGITS, [0] * i) for i in range(40)]
    assert seq == [b.pick(LOGITS, [0] * i) for i in range(40)] and len(set(seq)) > 1
    assert [b.verify(LOGITS, 4, [0] * i)[1] for i in range(40)] == seq
    assert [a.pick(LOGITS, [0] * 7) for _ in range(5)] == [seq[7]] * 5
    a.accept([0] * 3)                                   # three tokens kept: position i is now extra i - 3
    assert a.pick(LOGITS, [0] * 4) == seq[7]
    other = TokenChooser(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=12))
    assert [other.pick(LOGITS, [0] * i) for i in range(40)] != seq


def test_min_p_keeps_tokens_within_its_ratio_of_the_best():
    # min_p 0.3: keep logits >= 3.0 + ln 0.3 = 1.796: ids 3 and 0
    ids, _ = distribution(LOGITS, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.3))
    assert ids.tolist() == [3, 0]
    ids, _ = distribution(LOGITS, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=float(np.exp(-1.0))))
    assert ids.tolist() == [3, 0]                      # exactly at the bound: kept
    ids, _ = distribution(LOGITS, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
    assert len(ids) == 6


def test_temperature_scales_the_kept_logits():
    ids, p = distribution(LOGITS, SamplingParams(temperature=0.5, top_k=3, top_p=1.0, min_p=0.0))
    assert ids.tolist() == [3, 0, 5]
    np.testing.assert_allclose(p, softmax(LOGITS[[3, 0, 5]] / 0.5))


def test_filters_apply_in_order():
    """top-k then top-p (on the top-k's renormalised distribution) then min-p, then temperature."""
    ids, p = distribution(LOGITS, SamplingParams(temperature=2.0, top_k=3, top_p=0.7, min_p=0.05))
    top3 = softmax(LOGITS[[3, 0, 5]])                  # 0.665, 0.245, 0.090: top_p 0.7 keeps 2
    assert np.cumsum(top3)[0] < 0.7 <= np.cumsum(top3)[1]
    assert ids.tolist() == [3, 0]
    np.testing.assert_allclose(p, softmax(LOGITS[[3, 0]] / 2.0))


# ----------------------------------------------------------------------------- TokenChooser
class Rng:
    """A stand-in for numpy's Generator: random() gives ``u``; choice() records p and takes its argmax."""

    def __init__(self, u):
        self.u, self.seen = u, []

    def random(self):
        return self.u

    def choice(self, n, p):
        p = np.asarray(p, float)
        assert len(p) == n and abs(p.sum() - 1.0) < 1e-9
        self.seen.append(p)
        return int(np.argmax(p))


def chooser(sp, u=0.5, history=()):
    """A chooser whose random numbers are ``Rng(u)``'s (every position's stream too)."""
    c = TokenChooser(sp)
    c.rng = Rng(u)
    c.stream = lambda position: c.rng
    c.accept(history)
    return c


def test_greedy_pick_and_verify_use_the_penalised_argmax():
    sp = SamplingParams(repeat_penalty=10.0)
    c = chooser(sp, history=[3])                      # 3.0 / 10 = 0.3: token 0 (2.0) is best now
    assert c.pick(LOGITS, []) == 0 and c.pick(LOGITS, [0]) == 5      # extra counts as history
    assert c.verify(LOGITS, 0, []) == (True, 0) and c.verify(LOGITS, 3, []) == (False, 0)
    assert chooser(SamplingParams()).pick(LOGITS, [3]) == 3          # no penalties: plain argmax
    assert c.history == [3]
    c.accept(np.array([5, 0]))
    assert c.history == [3, 5, 0] and all(type(t) is int for t in c.history)


def test_sampled_pick_draws_from_the_chain():
    sp = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    c = chooser(sp)
    assert c.pick(LOGITS, []) == 3
    np.testing.assert_allclose(c.rng.seen[0], softmax(LOGITS[[3, 0, 5]]))


SP = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
P = softmax(LOGITS[[3, 0, 5]])                         # ids 3, 0, 5


@pytest.mark.parametrize("draft, accepted", [(3, True), (0, False), (5, False)])
def test_a_deterministic_proposal_is_kept_exactly_when_it_is_the_positions_draw(draft, accepted):
    """The target draws its token from p (here the stand-in's draw is p's likeliest, id 3): a drafted
    token equal to it is kept, any other is replaced by it."""
    c = chooser(SP)
    assert c.verify(LOGITS, draft, []) == (accepted, 3)
    np.testing.assert_allclose(c.rng.seen[0], P)


def test_a_deterministic_proposal_is_kept_with_its_target_probability():
    """Over many seeds a drafted token is kept with probability p(token), and what replaces it follows
    p without it (the residual of a one-hot proposal)."""
    kept, instead = 0, np.zeros(3)
    for seed in range(20000):
        ok, tok = TokenChooser(replace(SP, seed=seed)).verify(LOGITS, 0, [])
        kept += ok
        if not ok:
            instead[[3, 0, 5].index(tok)] += 1
    assert abs(kept / 20000 - P[1]) < 4 * np.sqrt(P[1] * (1 - P[1]) / 20000)
    assert instead[1] == 0
    residual = P[[0, 2]] / P[[0, 2]].sum()
    assert abs(instead[0] / instead.sum() - residual[0]) < 0.02


def test_a_proposal_outside_the_targets_candidates_is_rejected_and_p_kept():
    c = chooser(SP, 0.0)
    ok, tok = c.verify(LOGITS, 4, [])                  # id 4 is not in the top 3
    assert not ok and tok == 3
    np.testing.assert_allclose(c.rng.seen[0], P)


def test_a_proposal_distribution_uses_min_one_p_over_q_and_the_residual():
    q_ids = np.array([5, 0, 1])                        # deliberately unsorted
    q_p = np.array([0.2, 0.7, 0.1])
    p0 = P[1]                                          # target p of token 0: 0.245 < q 0.7
    c = chooser(SP, p0 / 0.7 - 1e-6)                   # u * q_d < p_d: accepted
    assert c.verify(LOGITS, 0, [], (q_ids, q_p)) == (True, 0)
    c = chooser(SP, p0 / 0.7 + 1e-6)                   # rejected: residual max(p - q, 0)
    ok, tok = c.verify(LOGITS, 0, [], (q_ids, q_p))
    r = np.maximum(P - np.array([0.0, 0.7, 0.2]), 0.0)  # q on the target's ids 3, 0, 5
    assert not ok and tok == 3
    np.testing.assert_allclose(c.rng.seen[0], r / r.sum())


def test_a_residual_of_zero_falls_back_to_p():
    q_ids = np.array([3, 0, 5])
    c = chooser(SP, 0.9)                               # 0.9 * q(5) = 1.8 p(5) > p(5): rejected
    ok, tok = c.verify(LOGITS, 5, [], (q_ids, P * np.array([1.0, 1.0, 2.0])))   # q >= p: residual 0
    assert not ok
    np.testing.assert_allclose(c.rng.seen[0], P)


# ---------------------------------------------------------------------- the chain, as pure functions
def _masked_reference(logits, ok, sp):
    """llama.cpp's chain with the grammar first: the disallowed tokens' logits are -inf."""
    ids = np.nonzero(ok)[0]
    sub, p = distribution(logits[ids], sp)
    return dict(zip(ids[sub].tolist(), p.tolist()))


@pytest.mark.parametrize("walk", [4, 256], ids=["short-walk", "default-walk"])
@pytest.mark.parametrize("density", [0.002, 0.05, 0.6])
def test_constrained_choices_equal_a_masked_reference(monkeypatch, walk, density):
    """Greedy: the best allowed token (lowest id on a tie); sampled: the distribution of the chain run
    on the allowed tokens only - whether the answer is the argmax, in the walk, or past it."""
    monkeypatch.setattr(S, "GRAMMAR_WALK", walk)
    rng = np.random.default_rng(int(density * 1000) + walk)
    n = 3000
    for trial in range(30):
        logits = rng.normal(size=n).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits, 1)            # many ties
        ok = rng.random(n) < density
        ok[rng.integers(n)] = True
        allowed = lambda ids, ok=ok: ok[ids]   # noqa: E731
        masked = np.where(ok, logits, -np.inf)
        assert constrained_argmax(logits, allowed) == int(np.argmax(masked))
        if trial % 3 == 0:
            continue    # which of several tied tokens top-k keeps is not defined (llama.cpp's nor numpy's)
        for sp in (SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05),
                   SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                   SamplingParams(temperature=-1.0)):
            ids, p = distribution(logits, sp, allowed)
            got = dict(zip(ids.tolist(), p.tolist()))
            ref = _masked_reference(logits, ok, sp)
            assert got.keys() == ref.keys()
            assert max(abs(got[k] - ref[k]) for k in ref) < 1e-9
    argmax_allowed = np.zeros(n, bool)
    argmax_allowed[int(np.argmax(logits))] = True
    calls = []
    constrained_argmax(logits, lambda ids: calls.append(len(ids)) or argmax_allowed[ids])
    assert calls == [1], "an allowed argmax costs one question to the grammar"


def test_a_grammar_that_allows_nothing_says_so():
    with pytest.raises(S.NoTokenAllowed):
        constrained_argmax(np.zeros(50, np.float32), lambda ids: np.zeros(len(ids), bool))


def test_processors_see_the_ids_up_to_their_row():
    seen = []

    def proc(ids, scores):
        seen.append(ids.tolist())
        out = scores.copy()
        out[ids[-1]] += 100.0           # favour repeating the last id
        return out

    ch = TokenChooser(SamplingParams(temperature=0.0), Constraints([proc], prompt=[7, 8]))
    logits = np.zeros(20, np.float32)
    assert ch.pick(logits, []) == 8 and ch.pick(logits, [3]) == 3
    ch.accept([5])
    assert ch.pick(logits, [4, 9]) == 9
    assert seen == [[7, 8], [7, 8, 3], [7, 8, 5, 4, 9]]
    assert logits.max() == 0, "the decoder's logits row is never written"


def _asked(ok):
    """A grammar test over a fixed mask that records the sizes of the questions it was asked."""
    sizes = []

    def allowed(ids):
        assert ids.dtype.kind == "i"
        sizes.append(len(ids))
        return ok[ids]
    return allowed, sizes


def test_the_grammar_is_asked_the_argmax_then_the_walk_then_everything(monkeypatch):
    """What a constrained greedy row asks: the argmax alone; if refused, the GRAMMAR_WALK best; the whole
    vocabulary only when none of them is allowed or the answer ties the walk's last logit."""
    monkeypatch.setattr(S, "GRAMMAR_WALK", 8)
    logits = np.arange(100, dtype=np.float32)[::-1].copy()        # token i has logit 99 - i
    ok = np.zeros(100, bool)
    ok[3] = True
    allowed, sizes = _asked(ok)
    assert constrained_argmax(logits, allowed) == 3 and sizes == [1, 8]
    ok[:] = False
    ok[50] = True
    allowed, sizes = _asked(ok)
    assert constrained_argmax(logits, allowed) == 50 and sizes == [1, 8, 100]
    tie = logits.copy()
    tie[8] = tie[7]                               # the walk's last (id 7) ties id 8, just outside it
    ok[:] = False
    ok[7] = ok[8] = True
    allowed, sizes = _asked(ok)
    assert constrained_argmax(tie, allowed) == 7 and sizes == [1, 8, 100]   # judged over everything
    ok[:] = False
    ok[6] = True                                   # second to last in the walk, above its edge: found there
    allowed, sizes = _asked(ok)
    assert constrained_argmax(logits, allowed) == 6 and sizes == [1, 8]
    assert constrained_argmax(logits, None) == 0
    small = np.array([1.0, 3.0, 2.0], np.float32)  # a vocabulary smaller than the walk: asked about all of it
    allowed, sizes = _asked(np.array([True, False, True]))
    assert constrained_argmax(small, allowed) == 2 and sizes == [1, 3]
    with pytest.raises(S.NoTokenAllowed, match="^the grammar allows no token here$"):
        constrained_argmax(small, lambda ids: np.zeros(len(ids), bool))
    exact = np.linspace(1, 0, 8).astype(np.float32)   # a vocabulary the size of the walk: asked about all of it
    allowed, sizes = _asked(np.array([False] * 7 + [True]))
    assert constrained_argmax(exact, allowed) == 7 and sizes == [1, 8]


def test_a_sampled_row_asks_the_walk_for_the_top_k_allowed(monkeypatch):
    """Sampling (top-k): the best max(GRAMMAR_WALK, 4 k) are asked at once; they give the k best allowed
    tokens unless fewer than k are allowed there or the k-th ties the walk's edge (then everything)."""
    monkeypatch.setattr(S, "GRAMMAR_WALK", 8)
    logits = np.linspace(5, -5, 200).astype(np.float32)
    sp = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    ok = np.zeros(200, bool)
    ok[[1, 4, 6, 9, 30]] = True
    allowed, sizes = _asked(ok)
    ids, p = distribution(logits, sp, allowed)
    assert ids.tolist() == [1, 4, 6] and sizes == [12]             # 4 x top_k = 12 > GRAMMAR_WALK
    assert abs(p.sum() - 1) < 1e-12 and (np.diff(p) < 0).all()
    ok[:] = False
    ok[[1, 4, 6, 30]] = True                                        # exactly top_k allowed within the walk
    for t_ in (1.0, 0.5):
        allowed, sizes = _asked(ok)
        ids, _ = distribution(logits, SamplingParams(temperature=t_, top_k=3, top_p=1.0, min_p=0.0), allowed)
        assert ids.tolist() == [1, 4, 6] and sizes == [12], t_
    ok[:] = False
    ok[[1, 4, 30]] = True                                           # only two allowed within the walk
    allowed, sizes = _asked(ok)
    ids, _ = distribution(logits, sp, allowed)
    assert ids.tolist() == [1, 4, 30] and sizes == [12, 200]
    ok[:] = False
    ok[[1, 2, 11]] = True
    edge = logits.copy()
    edge[12] = edge[11]                                             # the 3rd allowed (the walk's last) ties id 12
    allowed, sizes = _asked(ok)
    ids, _ = distribution(edge, sp, allowed)
    assert ids.tolist() == [1, 2, 11] and sizes == [12, 200]
    one = SamplingParams(temperature=1.0, top_k=1, top_p=1.0, min_p=0.0)
    ok[:] = False
    ok[[0, 5]] = True
    allowed, sizes = _asked(ok)
    assert distribution(logits, one, allowed)[0].tolist() == [0] and sizes == [8]   # the walk is at least 8
    for whole in (SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
                  SamplingParams(temperature=-1.0, top_k=3),
                  SamplingParams(temperature=1.0, top_k=200, top_p=1.0, min_p=0.0)):
        allowed, sizes = _asked(ok)
        assert sorted(distribution(logits, whole, allowed)[0].tolist()) == [0, 5] and sizes == [200], whole


class _FakeConstraints:
    """Constraints with a grammar of fixed masks per number of earlier tokens, recording what it saw."""

    processors: list = []

    def __init__(self, masks):
        self.masks, self.asked, self.kept = masks, [], []

    def __bool__(self):
        return True

    def allowed(self, extra):
        self.asked.append(list(extra))
        mask = self.masks[len(extra)]
        return lambda ids: mask[ids]

    def accept(self, tokens):
        self.kept.append(list(tokens))


def test_the_chooser_judges_each_row_under_its_own_grammar_state():
    logits = np.array([5.0, 4.0, 3.0, 2.0, 1.0], np.float32)
    masks = [np.array([False, True, True, True, True]), np.array([False, False, True, True, True]),
             np.array([True, True, True, True, True])]
    c = _FakeConstraints(masks)
    greedy = TokenChooser(SamplingParams(temperature=0.0), c)
    assert greedy.constraints is c
    assert greedy.pick(logits, []) == 1 and greedy.verify(logits, 2, [1]) == (True, 2)
    assert greedy.verify(logits, 3, [1, 2]) == (False, 0)
    assert c.asked == [[], [1], [1, 2]]
    greedy.accept([1, 2, 0])
    assert c.kept == [[1, 2, 0]] and greedy.history == [1, 2, 0]
    c2 = _FakeConstraints(masks)
    sampled = [TokenChooser(SamplingParams(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, seed=s), c2)
               for s in range(40)]
    picks = {ch.pick(logits, [5]) for ch in sampled}
    assert picks == {2, 3} and c2.asked[0] == [5]                   # the two best the grammar allows
    for ch in sampled:                                               # a forbidden draft is always replaced
        ok, tok = ch.verify(logits, 0, [])
        assert not ok and tok in (1, 2)
    assert TokenChooser(SamplingParams(), None).constraints is None
    assert TokenChooser(SamplingParams(), Constraints()).constraints is None, "nothing to constrain: the fast path"


def test_best_first_is_the_m_best_ids_lowest_id_first_on_ties():
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(2, 60))
        logits = rng.normal(size=n).astype(np.float32)
        if trial % 2:
            logits = np.round(logits, 1)
        m = int(rng.integers(1, n + 1))
        want = np.argsort(-logits, kind="stable")[:m]
        got = S._best_first(logits, m)
        assert got.tolist()[:m - 1] == want.tolist()[:m - 1] or logits[got[-1]] == logits[want[-1]]
        assert sorted(logits[got].tolist(), reverse=True) == logits[want].tolist()
        if trial % 2 == 0:
            assert got.tolist() == want.tolist()
    for n, m in ((5000, 256), (151_936, 256), (3000, 1000)):    # sizes where numpy's selection partitions
        logits = rng.normal(size=n).astype(np.float32)
        assert S._best_first(logits, m).tolist() == np.argsort(-logits, kind="stable")[:m].tolist()


def _llama_cpp_mirostat_set(logits: np.ndarray, sp: SamplingParams) -> int:
    """How many candidates llama.cpp's mirostat sampler (fresh: mu = 2 tau) leaves before its draw."""
    llama_cpp = pytest.importorskip("llama_cpp")    # the reference (absent under --pure)

    smpl = (llama_cpp.llama_sampler_init_mirostat_v2(1, sp.mirostat_tau, sp.mirostat_eta) if sp.mirostat_mode == 2
            else llama_cpp.llama_sampler_init_mirostat(len(logits), 1, sp.mirostat_tau, sp.mirostat_eta, S.MIROSTAT_M))
    return len(_apply_llama_cpp(smpl, logits))


@pytest.mark.parametrize("mode", [1, 2])
def test_mirostat_candidates_match_llama_cpp(mode):
    """Differential: the candidates mirostat v1 / v2 draws from at a request's start (mu = 2 tau), on random
    logits of several spreads and taus, are llama.cpp's (its sampler's truncated size)."""
    rng = np.random.default_rng(mode)
    sizes = set()
    for _ in range(60):
        n = int(rng.choice([200, 2000]))
        logits = (rng.standard_normal(n) * rng.choice([1.0, 3.0, 6.0])).astype(np.float32)
        sp = SamplingParams(temperature=0.8, mirostat_mode=mode, mirostat_tau=float(rng.choice([1.0, 3.0, 5.0])))
        ids, p = distribution(logits, sp)
        assert len(ids) == _llama_cpp_mirostat_set(logits, sp), sp
        np.testing.assert_array_equal(ids, np.argsort(-logits, kind="stable")[:len(ids)])
        np.testing.assert_allclose(p, softmax(logits[ids]), rtol=1e-6)
        sizes.add(len(ids))
    assert len(sizes) > 10          # the truncation varies: the test sees many cut-offs


def test_mirostat_state_follows_each_decided_token():
    """mu moves by each token's surprise (bits, under the truncated distribution): mu' = mu - eta (s - tau),
    row by row within a step, and the step's kept tokens decide the state the next step starts from."""
    lg = np.log([0.5, 0.25, 0.125, 0.0625, 0.0625]).astype(np.float32)
    sp = SamplingParams(temperature=1.0, mirostat_mode=2, mirostat_tau=2.5, mirostat_eta=0.5, seed=0)
    ch = TokenChooser(sp)
    ids, p = distribution(lg, sp, mu=5.0)             # 2 tau: every token's surprise (1..4 bits) <= 5
    assert len(ids) == 5
    tok = ch.pick(lg, [])
    s = -np.log2(p[list(ids).index(tok)])
    mu1 = 5.0 - 0.5 * (s - 2.5)
    assert ch._mu == pytest.approx([5.0, mu1])
    ids1, _ = distribution(lg, sp, mu=mu1)
    assert len(ids1) == int(np.sum(-np.log2(softmax(lg)) <= mu1 + 1e-6))
    ok, tok2 = ch.verify(lg, 1, [tok])
    assert len(ch._mu) == 3
    ch.pick(lg, [])                                     # the step restarts: its first row again
    assert len(ch._mu) == 2
    ch.verify(lg, 1, [tok])
    kept = ch._mu[2]
    ch.accept([tok, tok2])
    assert ch._mu == [kept]
