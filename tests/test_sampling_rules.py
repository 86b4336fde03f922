"""The sampler chain and rejection sampling of dflash_gguf.sampling on small arrays, with exact
expectations (tests/test_sampling.py checks the distributions end to end against llama.cpp on real
decodes; these pin each rule down for ``make mutate``)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.sampling import SamplingParams, TokenChooser, apply_penalties, distribution

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


def test_typical_p_is_unsupported_only_when_it_filters():
    why = "typical_p < 1 is not implemented in the speculative sampler"
    assert SamplingParams(temperature=0.7, typical_p=0.9).unsupported() == why
    for sp in (SamplingParams(temperature=0.7, typical_p=1.0), SamplingParams(typical_p=0.9),
               SamplingParams(temperature=-1.0, typical_p=0.9)):
        assert sp.unsupported() is None


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


def test_the_same_seed_draws_the_same_tokens():
    sp = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    a, b = TokenChooser(sp), TokenChooser(sp)
    seq = [a.pick(LOGITS, []) for _ in range(40)]
    assert seq == [b.pick(LOGITS, []) for _ in range(40)] and len(set(seq)) > 1


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
    c = TokenChooser(sp)
    c.rng = Rng(u)
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


@pytest.mark.parametrize("u, accepted", [(P[1] - 1e-6, True), (P[1] + 1e-6, False)])
def test_a_deterministic_proposal_is_accepted_with_its_target_probability(u, accepted):
    c = chooser(SP, u)
    ok, tok = c.verify(LOGITS, 0, [])
    assert ok is accepted
    if accepted:
        assert tok == 0 and not c.rng.seen
    else:                                              # resampled from p without the draft
        want = P.copy()
        want[1] = 0.0
        np.testing.assert_allclose(c.rng.seen[0], want / want.sum())
        assert tok == 3


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
