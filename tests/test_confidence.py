"""Verify lengths from a drafter's confidence (dflash_gguf.decoding.confidence), as properties that
survive retuning: the allocation is the best one for the step's cost, the calibration learns what the
target accepts, and on replayed traces the chosen lengths beat every fixed length."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_gguf.decoding.confidence import Calibration, allocate, rows_cost

pytestmark = pytest.mark.pure


def _rate(rates, counts, cost):
    reach = [np.cumprod(r) for r in rates]
    gain = len(rates) + sum(float(reach[s][:counts[s]].sum()) for s in range(len(rates)))
    return gain / cost(sum(counts))


@pytest.mark.parametrize("seed", range(40))
def test_allocation_is_the_best_of_all_allocations(seed):
    rng = np.random.default_rng(seed)
    n_seqs = int(rng.integers(1, 4))
    rates = [rng.uniform(0, 1, int(rng.integers(1, 6))) ** rng.uniform(0.2, 3) for _ in range(n_seqs)]
    c0, c1 = rng.uniform(5, 20), rng.uniform(0.1, 4)

    def cost(rows):
        return c0 + c1 * rows
    got = allocate(rates, cost)
    assert all(1 <= k <= len(r) for k, r in zip(got, rates))
    best = max(_rate(rates, c, cost) for c in itertools.product(*[range(1, len(r) + 1) for r in rates]))
    assert _rate(rates, got, cost) >= best - 1e-12


def test_sure_tokens_are_all_verified_and_hopeless_ones_are_not():
    def cost(rows):
        return 10.0 + rows
    assert allocate([np.ones(7)], cost) == [7]
    assert allocate([np.full(7, 0.01)], cost) == [1]
    # a confident sequence beside a hopeless one gets the rows
    assert allocate([np.full(6, 0.95), np.full(6, 0.02)], cost) == [6, 1]
    # rows that cost nothing are always worth verifying
    assert allocate([np.full(5, 0.1)], lambda rows: 10.0) == [5]


def test_a_tie_verifies_no_more_rows():
    """More work for the same rate is not taken."""
    assert allocate([np.ones(3)], lambda rows: 2.0 + 2.0 * rows) == [1]


def test_confidences_outside_0_1_fall_in_the_end_bins():
    c = Calibration()
    np.testing.assert_allclose(c.rates(np.array([-0.5, 1.5])), [0.0, 1.0])
    c.observe(np.array([1.0, 0.999, 0.01]), verified=3, accepted=2)
    assert c.tries[-1] == 2 and c.hits[-1] == 2 and c.tries[0] == 1 and c.hits[0] == 0
    c.observe(np.array([1.3, -0.2]), verified=2, accepted=1)
    assert c.tries[-1] == pytest.approx(3, rel=0.01) and c.tries[0] == pytest.approx(2, rel=0.01)


def test_rows_cost_interpolates_the_gates_lengths():
    cost = rows_cost(np.array([10.0, 12.0, 14.0, 20.0]), n_seqs=2)
    assert cost(2) == 12.0 and cost(4) == 14.0 and cost(5) == 17.0 and cost(6) == 20.0


def test_calibration_learns_what_the_target_accepts():
    rng = np.random.default_rng(0)
    over = Calibration()      # a head that says 0.9 where the target accepts 30%
    for _ in range(400):
        raw = np.full(6, 0.9)
        acc = 0
        while acc < 6 and rng.random() < 0.3:
            acc += 1
        over.observe(raw, 6, acc)
    assert abs(over.rates(np.array([0.9]))[0] - 0.3) < 0.06
    fresh = Calibration()     # taken at its word until it has judged tokens
    np.testing.assert_allclose(fresh.rates(np.array([0.2, 0.7])), [0.2, 0.7])


def test_tokens_never_judged_do_not_count():
    c = Calibration()
    c.observe(np.array([0.55, 0.55, 0.55, 0.95]), verified=2, accepted=2)   # the last two were not verified
    assert c.tries.sum() == 2 and c.hits.sum() == 2
    c.observe(np.array([0.55, 0.55, 0.55]), verified=3, accepted=0)         # the first rejected: one judged
    assert c.tries.sum() == pytest.approx(3, rel=0.01) and c.hits.sum() == pytest.approx(2, rel=0.01)


def _replay(trace, choose, cost):
    """Tokens per second over a replayed trace: each step's drafted tokens' raw confidences and how many
    the target would accept; ``choose(raw)`` -> rows verified."""
    tokens = seconds = 0.0
    for raw, would in trace:
        k = choose(raw)
        tokens += 1 + min(would, k)
        seconds += cost(k)
    return tokens / seconds


@pytest.mark.parametrize("skew", [0.6, 1.0, 1.6], ids=["underconfident", "calibrated", "overconfident"])
def test_on_a_replayed_trace_the_chosen_lengths_beat_every_fixed_length(skew):
    """A drafter whose per-token acceptance varies from step to step (easy and hard stretches of text)
    and whose head scores it (true rate ** skew): learnt online, the confidence cut does at least as well
    as the best fixed length over the run, with verify rows costing what they cost on a CPU (a 16-row
    verify about 3x a one-row decode)."""
    rng = np.random.default_rng(1)
    n = 8
    trace = []
    for _ in range(3000):
        p = np.clip(rng.beta(2, 2) + rng.normal(0, 0.05, n), 0.02, 0.98) * np.linspace(1, 0.8, n)
        would = 0
        while would < n and rng.random() < p[would]:
            would += 1
        trace.append((p ** skew, would))

    def cost(k):
        return 1.0 + 0.13 * (k + 1) + (0.35 if k else 0.0)     # a decode row, verify rows, the drafter
    cal = Calibration()

    def confident(raw):
        k = allocate([cal.rates(raw)], cost)[0]
        return k

    tokens = seconds = 0.0
    for raw, would in trace:
        k = confident(raw)
        tokens += 1 + min(would, k)
        seconds += cost(k)
        cal.observe(raw, k, min(would, k))
    ours = tokens / seconds
    fixed = max(_replay(trace, lambda raw, k=k: k, cost) for k in range(1, n + 1))
    assert ours >= fixed
