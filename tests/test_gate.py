"""The speed gate picks the draft length with the most expected tokens per second, driven here by
synthetic drafters and costs (no model: tests/test_gate_decoder.py runs it inside a decoder)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.decoding.gate import DraftLength

pytestmark = pytest.mark.pure


def feed(gate: DraftLength, steps: int, accept, cost) -> list[int]:
    """Drive the gate with a synthetic drafter (accept(n) -> accepted) and cost(n) -> seconds."""
    chosen = []
    for _ in range(steps):
        n = gate.choose()
        chosen.append(n)
        gate.record(n, accept(n), cost(n))
    return chosen


def simulate(gate: DraftLength | int, cond, cost, rng, tokens: int) -> float:
    """Tokens per second over ``tokens`` tokens with a gate (or a fixed draft length): position i of a
    block is accepted with probability ``cond[i]`` once every position before it was; ``cost(n)``
    is a step's seconds."""
    toks = t = 0.0
    while toks < tokens:
        n = gate if isinstance(gate, int) else gate.choose()
        a = 0
        while a < n and rng.random() < cond[a]:
            a += 1
        if not isinstance(gate, int):
            gate.record(n, a, cost(n))
        toks += a + 1
        t += cost(n)
    return toks / t


def test_always_right_drafter_with_cheap_rows_drafts_the_whole_block():
    g = DraftLength(7)
    chosen = feed(g, 60, accept=lambda n: n, cost=lambda n: 1.0 + 0.05 * n)
    assert chosen[-20:].count(7) >= 18          # all but the scheduled plain probe


def test_never_right_drafter_turns_drafting_off():
    g = DraftLength(7)
    chosen = feed(g, 60, accept=lambda n: 0, cost=lambda n: 1.0 + 0.3 * n)
    tail = chosen[len(DraftLength.WARMUP):]
    assert tail.count(0) >= len(tail) - 3       # plain decoding except the n_max probes
    np.testing.assert_allclose(g.expected_tokens(), 1.0)


def test_costly_rows_pick_a_middle_length():
    # acceptance of position i (1-based) is 0.9**i: long blocks are rarely fully right
    rng = np.random.default_rng(0)

    def accept(n):
        a = 0
        while a < n and rng.random() < 0.9 ** (a + 1):
            a += 1
        return a

    g = DraftLength(7)
    chosen = feed(g, 400, accept=accept, cost=lambda n: 1.0 + 0.35 * n)
    # the true rates of this setup: P(accepted >= k) = 0.9^(1 + 2 + ... + k), a step costs 1 + 0.35 n;
    # n = 2 is best (1.546 tokens per unit), n = 3 within 0.3% of it, the full block 27% below
    reach = np.cumprod([0.9 ** i for i in range(1, 8)])
    rate = (1 + np.concatenate([[0.0], np.cumsum(reach)])) / (1.0 + 0.35 * np.arange(8))
    assert int(np.argmax(rate)) == 2
    usual = max(set(chosen[-100:]), key=chosen[-100:].count)
    assert rate[usual] >= (1 - DraftLength.PREFER_FULL) * rate.max(), (usual, rate)


def test_probing_backs_off_while_the_choice_holds_and_recovers():
    """A never-right drafter costs one full-block probe per PROBE_MAX steps once the choice holds; when
    the drafter turns right, drafting resumes within one probe interval."""
    g = DraftLength(7)
    right = {"now": False}
    chosen = feed(g, 800, accept=lambda n: n if right["now"] else 0, cost=lambda n: 1.0 + 0.3 * n)
    tail = chosen[400:]
    assert 0 < sum(n > 0 for n in tail) <= len(tail) // DraftLength.PROBE_MAX + 1
    right["now"] = True
    later = feed(g, 2 * DraftLength.PROBE_MAX, accept=lambda n: n if right["now"] else 0, cost=lambda n: 1.0 + 0.3 * n)
    first = next(i for i, n in enumerate(later) if n > 0)
    assert first <= DraftLength.PROBE_MAX and later[-20:].count(7) >= 18


def test_a_never_right_drafter_ends_the_warmup_early_and_probes_with_short_blocks():
    """Two full blocks without one token right end the warm-up (its other lengths cannot change the
    choice); probes while decoding plainly draft PROBE_SHORT tokens, not a whole block."""
    g = DraftLength(15)
    chosen = feed(g, 200, accept=lambda n: 0, cost=lambda n: 1.0 + 0.3 * n)
    assert chosen[:4] == [15, 15, 0, 0]
    assert all(n in (0, DraftLength.PROBE_SHORT) for n in chosen[4:]), chosen
    assert 0 < sum(n > 0 for n in chosen[4:]) <= 200 // DraftLength.PROBE_EVERY
    # a drafter right at least once keeps the whole warm-up (its cost curve is what the choice needs)
    g = DraftLength(15)
    chosen = feed(g, len(DraftLength.WARMUP), accept=lambda n: 1, cost=lambda n: 1.0 + 0.3 * n)
    assert chosen == [15, 15, 0, 0, 7, 15]


def test_cost_model_treats_the_drafter_call_as_a_step():
    """A drafter call costs the same for any n >= 1 and nothing at n = 0: lengths never measured are
    priced from the drafting steps only, so a cheap plain step does not make short blocks look cheap
    (a CPU profile: t1 52 ms, draft 107 ms, verify 112 ms at 2 rows to 223 ms at 16)."""
    def cost(n):
        return 0.052 if n == 0 else 0.107 + 0.105 + 0.0078 * (n + 1)

    g = DraftLength(15)
    for n in (15, 0, 7, 1):
        g.record(n, 0, cost(n))
    model = g.step_cost()
    for n in (2, 4, 10, 12):
        assert model[n] == pytest.approx(cost(n), rel=0.05), (n, model[n], cost(n))
    # with a strong drafter (each position right 88.5% of the times it is reached) the whole block pays most
    g.hits[:] = 8.85
    g.tries[:] = 10
    rate = g.expected_tokens() / model
    assert int(np.argmax(rate)) >= 12


def test_an_unlucky_start_does_not_pin_the_choice():
    """Deep positions seldom reached lean on the positions before them, and plain decoding chosen over
    a drafter that does get tokens right is re-probed soon: over 1024 tokens the gate gets within a
    few percent of the best fixed length (a simulation with the CPU cost profile above and the demo
    pair's per-position acceptance; 30 seeds, deterministic). The gate before these two rules got
    0.94 of the best fixed length here."""
    # P(position i accepted | reached), from the demo pair's measured P(a >= i) 0.78 0.68 0.61 ...
    reach = [0.78, 0.68, 0.61, 0.56, 0.51, 0.46, 0.42]
    cond = [reach[0]] + [reach[i] / reach[i - 1] for i in range(1, 7)] + [0.913] * 8
    def cost(n):
        return 0.058 if n == 0 else 0.107 + 0.105 + 0.0078 * (n + 1)

    def run(policy, seed):
        return simulate(DraftLength(15) if policy is None else policy, cond, cost, np.random.default_rng(seed), 1024)

    gate = np.mean([run(None, s) for s in range(30)])
    best = max(np.mean([run(n, s) for s in range(30)]) for n in (7, 12, 15))
    assert gate >= 0.96 * best, (gate, best)


def test_a_gate_kept_between_calls_matches_the_best_fixed_length():
    """A Llama keeps its gate from one call to the next: after the first call it drafts what the best
    fixed length drafts. Simulated with the cost curve measured on the 1.7B Q4_0 scale pair (ms: a
    plain step, one drafter call, verify of k = 1..16 rows: 16 rows cost less than 15 there, AMX
    tiles) and the demo and strong per-position profiles, 40 draw sequences of 6 calls x 128 tokens
    (BENCHMARKS.md section 5c)."""
    t1, draft = 58.9, 104.1
    verify = [58.9, 109.7, 116.6, 119.1, 119.4, 120.7, 134.8, 151.6, 168.6, 175.8, 188.0, 201.7, 209.6, 227.4,
              231.6, 220.1]

    def cost(n):
        return (t1 if n == 0 else draft + verify[n]) / 1000

    reach = [0.78, 0.68, 0.61, 0.56, 0.51, 0.46, 0.42]
    demo = [reach[0]] + [reach[i] / reach[i - 1] for i in range(1, 7)] + [0.913] * 8

    for cond in (demo, [0.885] * 15):
        best = max(np.mean([simulate(n, cond, cost, np.random.default_rng(s), 6 * 128) for s in range(40)])
                   for n in (7, 12, 14, 15))
        kept = []
        for s in range(40):
            rng, g = np.random.default_rng(s), DraftLength(15)
            kept += [simulate(g, cond, cost, rng, 128) for _ in range(6)][1:]   # the first call pays the warm-up
        assert np.mean(kept) >= 0.97 * best, (np.mean(kept), best)


# ---------------------------------------------------------------- a measured cost prior (decoding.calibration)
def test_a_cost_prior_turns_a_never_right_drafter_off_after_two_short_blocks():
    """With this machine's costs known, the warm-up is short probes until one is right, at most
    WARMUP_GIVE_UP (2): a drafter that gets nothing right costs two probe blocks, not the six warm-up
    steps (three of them full blocks) of a gate without them."""
    cost = lambda n: 1.0 + 0.3 * n  # noqa: E731
    prior = np.array([cost(n) for n in range(8)])
    g = DraftLength(7, prior)
    chosen = feed(g, 30, accept=lambda n: 0, cost=cost)
    assert g.probe_len == 1 and chosen[:2] == [1, 1] and chosen[2:24] == [0] * 22, chosen   # rows cost 0.3: 1
    cold = feed(DraftLength(7), 30, accept=lambda n: 0, cost=cost)
    assert sum(n > 0 for n in cold[:24]) >= 2           # the warm-up without a prior drafts more


def test_a_cost_prior_keeps_a_good_drafter_on_full_blocks_from_the_start():
    cost = lambda n: 1.0 + 0.05 * n  # noqa: E731
    g = DraftLength(7, np.array([cost(n) for n in range(8)]))
    chosen = feed(g, 20, accept=lambda n: n, cost=cost)
    assert chosen[0] == g.probe_len == 3 and chosen[1:20] == [7] * 19, chosen      # 3 rows: 0.1 a step
    # a first probe that misses is followed by a second: a good drafter is not sent to plain decoding
    # by one unlucky draw (its first token right 78% of the time: one probe alone missed 22% of starts)
    first = iter([0])
    g = DraftLength(7, np.array([cost(n) for n in range(8)]))
    chosen = feed(g, 20, accept=lambda n: next(first, n), cost=cost)
    assert chosen[:2] == [3, 3] and chosen[2:20] == [7] * 18, chosen


def test_a_cost_prior_settles_on_the_analytic_best_length():
    """Rows cost 0.25 each on top of a 1.0 step, position i right with probability 0.7 once all before
    it were: tokens per second (1 + sum_{i<=n} 0.7^i) / (1 + 0.25 n) peaks at n = 2 (1.46; n = 3:
    1.45, full block 1.14, plain 1.0). The gate's usual length must be within its 3% tie band of that."""
    p, row = 0.7, 0.25
    rate = [(1 + sum(p ** i for i in range(1, n + 1))) / (1 + row * n) for n in range(8)]
    assert int(np.argmax(rate)) == 2
    rng = np.random.default_rng(0)

    def accept(n):
        a = 0
        while a < n and rng.random() < p:
            a += 1
        return a

    chosen = feed(DraftLength(7, np.array([1 + row * n for n in range(8)])), 400, accept, lambda n: 1 + row * n)
    usual = max(set(chosen[100:]), key=chosen[100:].count)
    assert rate[usual] >= (1 - DraftLength.PREFER_FULL) * max(rate), (usual, rate)
    assert usual not in (0, 7)


def test_a_drafter_right_deep_in_its_blocks_is_found_where_only_long_blocks_pay():
    """A small target (the demo pair quantized to Q8_0 on a Zen 4: a plain step 0.21 ms, a block of 7
    drafted tokens 1.1 ms): drafting pays only with long blocks mostly right. This drafter gets its first
    token right 85% of the time and, once right, each next one 95%: whole blocks give 6.1 tokens a step,
    1.18x plain decoding here. Short probes alone see the first position, and the estimate carries its
    rate to the deep ones (7-token blocks worth 4.8 tokens: 0.93x): a gate decoding plainly must probe
    whole blocks while their deep positions are unknown, find them right, and draft."""
    cond = [0.85] + [0.95] * 6
    cost = lambda n: 1.0 if n == 0 else 2.4 + 0.4 * n  # noqa: E731
    full = (1 + sum(np.prod(cond[:i]) for i in range(1, 8))) / cost(7)
    assert full > 1.15
    wins = 0
    for seed in range(5):
        rng = np.random.default_rng(seed)
        g = DraftLength(7, np.array([cost(n) for n in range(8)]))
        assert g.probe_len == 1
        warm = simulate(g, cond, cost, rng, 600)
        chosen = feed(g, 200, accept=lambda n, rng=rng: next(a for a in range(n + 1) if a == n or rng.random() >= cond[a]),
                      cost=cost)
        wins += sum(n >= 5 for n in chosen) >= 150 and warm > 1.0
    assert wins >= 4, wins


def test_a_cost_prior_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="8 entries"):
        DraftLength(7, np.ones(5))


@pytest.mark.parametrize("row, expect", [(0.0, 4), (0.02, 4), (0.034, 3), (0.049, 3), (0.051, 2), (0.099, 2),
                                         (0.11, 1), (0.5, 1)])
def test_a_probe_drafts_the_tokens_that_come_nearly_free(row, expect):
    """With a prior, a probe drafts the most tokens (up to PROBE_SHORT) whose rows together cost at
    most PROBE_FREE (0.1) of a plain step beyond drafting one: (n - 1) * row <= 0.1."""
    prior = np.array([1.0] + [1.5 + row * (n - 1) for n in range(1, 8)])
    g = DraftLength(7, prior)
    assert g.probe_len == expect
    assert feed(g, 1, accept=lambda n: 0, cost=lambda n: prior[n]) == [expect]
    assert DraftLength(7).probe_len == DraftLength.PROBE_SHORT      # no prior: the fixed length


@pytest.mark.parametrize("draft_cost", [0.2, 1.5, 2.4])
def test_probes_of_a_never_right_drafter_cost_at_most_the_budget(draft_cost):
    """A step that drafts costs the plain step (1.0) plus the drafter call (``draft_cost``) plus 0.05
    a row. While the drafter is never right, probes after the first may cost at most PROBE_BUDGET of
    the time plain decoding takes (with the PROBE_EVERY floor: cheap probes are not spaced wider),
    and they still happen (a drafter that starts being right is found)."""
    cost = lambda n: 1.0 if n == 0 else 1.0 + draft_cost + 0.05 * n  # noqa: E731
    g = DraftLength(7, np.array([cost(n) for n in range(8)]))
    steps = 600
    chosen = feed(g, steps, accept=lambda n: 0, cost=cost)
    probes = [i for i, n in enumerate(chosen) if n > 0]
    warm = DraftLength.WARMUP_GIVE_UP                   # the warm-up's probes: steps 0 and 1
    assert probes[:warm] == list(range(warm)) and len(probes) >= warm + steps // (2 * DraftLength.PROBE_MAX)
    extra = sum(cost(chosen[i]) - cost(0) for i in probes[warm:])
    gaps = np.diff(probes[warm - 1:])
    if (cost(g.probe_len) - 1.0) / DraftLength.PROBE_EVERY > DraftLength.PROBE_BUDGET:
        assert extra <= DraftLength.PROBE_BUDGET * steps * cost(0), (extra, probes)
        assert gaps.min() > DraftLength.PROBE_EVERY
    else:
        assert gaps.min() == DraftLength.PROBE_EVERY


@pytest.mark.parametrize("surcharge", [0.0, 3.0])
def test_probes_of_a_drafter_that_could_pay_but_does_not_keep_to_the_budget(surcharge):
    """A tiny pair: a drafting step costs the plain step (1.0) plus a drafter call (2.4) plus 0.5 a row,
    so a full block would pay only with nearly every token right, and this drafter gets its first token
    right and no other: plain decoding wins, but the drafter is not "never right". Its probes come soon
    at first (a dip may pass) and back off to PROBE_MAX; from there they cost at most PROBE_BUDGET of
    plain decoding's time, counting what each probe step cost (``surcharge``: the features kept while
    decoding plainly injected, the switch from plain steps, on top of a settled step of its length)."""
    cost = lambda n: 1.0 if n == 0 else 3.4 + 0.5 * n  # noqa: E731
    g = DraftLength(7, np.array([cost(n) for n in range(8)]))
    assert g._could_pay()
    steps, settled = 3000, 600
    chosen = [0]
    for _ in range(steps):
        n = g.choose()
        g.record(n, min(n, 1), cost(n) + (surcharge if n and not chosen[-1] else 0.0))   # after a plain step
        chosen.append(n)
    chosen = chosen[1:]
    assert g._could_pay() and chosen.count(0) > 0.95 * steps
    probes = [i for i, n in enumerate(chosen) if n > 0]
    late = [i for i in probes if i >= settled]
    assert len(late) >= (steps - settled) // (4 * DraftLength.PROBE_MAX), probes     # they still happen
    each = [cost(chosen[i]) + surcharge - cost(0) for i in late]
    # the budget over the late steps, give or take one probe (where the first of them falls)
    assert sum(each) <= DraftLength.PROBE_BUDGET * (steps - settled) * cost(0) + max(each), (each, np.diff(late))
    assert np.diff(late).min() > DraftLength.PROBE_MAX


def test_a_wrong_prior_gives_way_to_measured_steps():
    """A prior measured on a busy machine says blocks of 4 or more cost 4x what they do: the first real
    step of a length weighs as much as the prior, so a few probes of the whole block correct it and
    a drafter that is always right gets full blocks (with the prior believed, the gate would stay at 3)."""
    true = lambda n: 1.0 + 0.05 * n  # noqa: E731
    prior = np.array([true(n) * (4.0 if n >= 4 else 1.0) for n in range(8)])
    g = DraftLength(7, prior)
    chosen = feed(g, 80, accept=lambda n: n, cost=true)
    assert chosen[-20:] == [7] * 20, chosen
    assert abs(g.cost[7] - true(7)) < 0.1 * true(7)


def test_a_kept_history_plans_from_the_first_step():
    """A gate started from the pair's kept acceptance history (decoding.history) skips the warm-up's
    probing blocks: a drafter known to be right drafts its whole block from step one, one known to be
    never right decodes plainly from step one, and a middling one's first call (64 tokens) is as fast as
    a warmed-up gate's (within 5%) and at least a fresh gate's, on average over many starts."""
    cost = lambda n: 1.0 + 0.05 * n  # noqa: E731
    prior = np.array([cost(n) for n in range(8)])
    right = DraftLength(7, prior)
    right.start_from(np.full(7, 32.0), np.full(7, 32.0))
    assert feed(right, 10, accept=lambda n: n, cost=cost) == [7] * 10
    never = DraftLength(7, prior)
    never.start_from(np.zeros(7), np.array([32.0] + [0.0] * 6))
    assert feed(never, 10, accept=lambda n: 0, cost=cost) == [0] * 10
    # a history that says plain decoding wins (rows dear, half the tokens right) is not re-probed soon
    dear = lambda n: 1.0 + 0.5 * n  # noqa: E731
    plain = DraftLength(7, np.array([dear(n) for n in range(8)]))
    half = np.array([32.0 * 0.5 ** i for i in range(7)])
    plain.start_from(half * 0.5, half)
    assert feed(plain, 12, accept=lambda n: min(n, 1), cost=dear) == [0] * 12

    cond = [0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4]
    tries = np.array([32.0 * np.prod(cond[:i]) for i in range(7)])
    warm = DraftLength(7, prior)
    simulate(warm, cond, cost, np.random.default_rng(999), 5000)
    fresh, kept, warmed = [], [], []
    for seed in range(200):
        fresh.append(simulate(DraftLength(7, prior), cond, cost, np.random.default_rng(seed), 64))
        g = DraftLength(7, prior)
        g.start_from(tries * np.array(cond), tries)
        kept.append(simulate(g, cond, cost, np.random.default_rng(seed), 64))
        warmed.append(simulate(warm, cond, cost, np.random.default_rng(seed), 64))
    assert np.mean(kept) >= max(np.mean(fresh), 0.95 * np.mean(warmed))


@pytest.mark.parametrize("hits,tries", [
    (np.zeros(6), np.full(7, 8.0)),                      # a history of another block length
    (np.zeros(7), np.full(1, 8.0)),
    (np.array([-1.0] + [0.0] * 6), np.full(7, 8.0)),     # negative counts
    (np.array([8.5] + [0.0] * 6), np.full(7, 8.0)),      # more hits than draws
    (np.zeros(7), np.full(7, DraftLength.FEW_DRAWS - 0.5)),   # too few draws to plan on
])
def test_a_kept_history_that_cannot_be_the_gates_own_is_refused(hits, tries):
    g = DraftLength(7, np.ones(8))
    with pytest.raises(ValueError, match="0 <= hits <= tries and at least"):
        g.start_from(hits, tries)
    assert g.tries.sum() == 0
    # the edges are histories it can have: every token right, nothing right, just enough draws
    g.start_from(np.full(7, 8.0), np.full(7, 8.0))
    g.start_from(np.zeros(7), np.full(7, float(DraftLength.FEW_DRAWS)))
