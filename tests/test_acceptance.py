"""Acceptance and statistics as pure functions on arrays (no model needed)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf.decoding.sampling import SamplingParams, TokenChooser, distribution
from dflash_gguf.decoding.acceptance import cut_at_stop, greedy_accept, sampled_accept
from dflash_gguf.decoding.stats import GenerationStats, acceptance_length

pytestmark = pytest.mark.pure


@pytest.mark.parametrize("draft, target, want", [
    ([], [7], [7]),                                   # nothing drafted: the target's own token
    ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),          # all accepted + bonus token
    ([5, 6, 7], [5, 9, 7, 8], [5, 9]),                # first mismatch at 1: keep 5, then the target's 9
    ([5, 6, 7], [4, 6, 7, 8], [4]),                   # rejected at once
    ([5, 6, 7], [5, 6, 1, 8], [5, 6, 1]),
])
def test_greedy_accept(draft, target, want):
    assert greedy_accept(np.array(draft, np.int32), np.array(target, np.int32)) == want


def test_greedy_accept_needs_one_more_target_row():
    with pytest.raises(ValueError, match="3 drafted tokens need 4 target rows"):
        greedy_accept(np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.int32))


def test_cut_at_stop():
    assert cut_at_stop([1, 2, 3, 4], {3}) == [1, 2, 3]
    assert cut_at_stop([1, 2, 3, 4], {9}) == [1, 2, 3, 4]
    assert cut_at_stop([3, 3], {3}) == [3]


def test_sampled_accept_greedy_chain_equals_greedy_accept():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(5, 50)).astype(np.float32)
    target = rows.argmax(axis=1).astype(np.int32)
    for draft in (target[:4], np.array([target[0], target[1], 3, 4], np.int32)):
        draft = draft.copy()
        if draft[2] == target[2]:
            draft[2] = (draft[2] + 1) % 50
        got = sampled_accept(draft, lambda i: rows[i], TokenChooser(SamplingParams(temperature=0.0)))
        assert got == greedy_accept(draft, target)


def _twelve_tokens(seed: int, sampler_seed: int):
    """Random logits over 12 tokens, a sampling setup, and the exact target distribution p."""
    logits = np.random.default_rng(seed).normal(scale=1.5, size=12).astype(np.float32)
    sp = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=sampler_seed)
    ids, probs = distribution(logits, sp)
    p = np.zeros(12)
    p[ids] = probs
    return logits, sp, p


def _assert_follows(counts: np.ndarray, p: np.ndarray) -> None:
    expected = p * counts.sum()
    mask = expected > 0
    chi2 = float((((counts - expected) ** 2)[mask] / expected[mask]).sum())
    assert counts[~mask].sum() == 0
    assert chi2 < 31.3, (chi2, counts, expected)      # 0.1% critical value at 11 degrees of freedom


def test_sampled_accept_first_token_has_the_target_distribution():
    """A fixed (one-hot) proposal, kept when it is the position's draw: the first committed token ~ p
    exactly, and the draft is kept with probability p(draft), as rejection sampling keeps it."""
    logits, sp, p = _twelve_tokens(1, 123)
    d = int(np.argsort(p)[-2])                                 # a plausible but not the best token
    draft = np.array([d, 0], np.int32)
    counts, kept = np.zeros(12), 0
    for seed in range(6000):
        chooser = TokenChooser(replace(sp, seed=seed))
        got = sampled_accept(draft, lambda i: logits, chooser)
        counts[got[0]] += 1
        kept += len(got) > 1
    _assert_follows(counts, p)
    assert abs(kept / 6000 - p[d]) < 4 * np.sqrt(p[d] * (1 - p[d]) / 6000), (kept / 6000, p[d])


@pytest.mark.parametrize("q_case", ["overlap", "disjoint", "equal"])
def test_sampled_accept_with_a_proposal_distribution_keeps_the_target_distribution(q_case):
    """Drafts drawn from q (DFlash2's selector distribution), accepted with min(1, p/q) and resampled
    from max(0, p - q): the committed token ~ p exactly, whatever q is; acceptance is higher the
    closer q is to p."""
    logits, sp, p = _twelve_tokens(2, 7)
    if q_case == "equal":
        q_ids, q = np.arange(12), p.copy()
    elif q_case == "overlap":       # 4 candidates: two of p's likeliest, two others
        q_ids = np.array([int(np.argmax(p)), int(np.argsort(p)[-3]), 0, 5])
        q = np.array([0.4, 0.1, 0.3, 0.2])
    else:                           # tokens p gives (almost) nothing: every draft rejected
        q_ids, q = np.array([int(np.argmin(p))]), np.array([1.0])
    chooser = TokenChooser(sp)
    n, counts, accepted = 6000, np.zeros(12), 0
    for _ in range(n):
        k = int(chooser.rng.choice(len(q_ids), p=q))
        draft = np.array([q_ids[k]], np.int32)
        got = sampled_accept(draft, lambda i: logits, chooser, [(q_ids, q)])
        counts[got[0]] += 1
        accepted += len(got) == 2
    _assert_follows(counts, p)
    overlap = float(sum(min(p[t], w) for t, w in zip(q_ids, q)))   # P(accept) = sum min(p, q)
    assert accepted / n == pytest.approx(overlap, abs=0.03)


def test_stats_observe_step_and_merge():
    a, b = GenerationStats(), GenerationStats()
    a.observe_step(3, 2)
    a.observe_step(0, 0)            # no drafting: not a step
    a.observe_step(5, 5)
    b.observe_step(7, 0)
    b.t_verify, b.n_generated = 0.5, 4
    assert (a.steps, a.drafted, a.accepted) == (2, 8, 7)
    assert a.drafted_per_pos == [2, 2, 2, 1, 1] and a.accepted_per_pos == [2, 2, 1, 1, 1]
    assert a.tau == pytest.approx(acceptance_length(7, 2)) == pytest.approx(4.5)
    a.merge(b)
    assert (a.steps, a.drafted, a.accepted) == (3, 15, 7)
    assert a.drafted_per_pos == [3, 3, 3, 2, 2, 1, 1] and a.accepted_per_pos == [2, 2, 1, 1, 1, 0, 0]
    assert a.accepted_per_step == [2, 5, 0] and a.t_verify == 0.5 and a.n_generated == 4
    d = a.as_dict()
    assert d["acceptance_length"] == round((7 + 3) / 3, 4) and d["steps"] == 3
    assert acceptance_length(0, 0) == 0.0
