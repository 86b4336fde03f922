"""Each rule of the speed gate (dflash_gguf.decoding.gate.DraftLength), one at a time, with exact expectations:
the cost model, the acceptance estimate, the probes (length, spacing, what they probe, what a right
probe does), the warm-up, the tie band, re-planning and the cost updates. tests/test_gate.py checks
the gate's choices as a whole (simulated drafters; tests/test_gate_decoder.py real decoders); these pin each rule down so that
changing one shows (``make mutate``)."""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.decoding.gate import DraftLength as G

pytestmark = pytest.mark.pure


class _Given:
    """An attribute of Fixed: setting it counts as a change of what the plan rests on (the gate's last
    evaluation is dropped), as the gate's own updates do."""

    def __set_name__(self, owner, name):
        self.name = "_" + name

    def __get__(self, obj, owner=None):
        return getattr(obj, self.name)

    def __set__(self, obj, value):
        setattr(obj, self.name, np.asarray(value, float))
        obj._evaluated = None


class Fixed(G):
    """A gate whose acceptance estimate and cost model are given, to test choose() alone."""
    fixed_expected = _Given()
    fixed_cost = _Given()

    def __init__(self, n_max, expected, cost, prior=None):
        super().__init__(n_max, prior)
        self.fixed_expected = expected
        self.fixed_cost = cost

    def expected_tokens(self):
        return self.fixed_expected

    def step_cost(self):
        return self.fixed_cost


def probe_steps(g: G, steps: int, accept, cost) -> list[int]:
    """Drive ``g`` for ``steps`` steps (``accept(n)`` tokens right of n drafted, ``cost[n]`` seconds a
    step): the steps at which it drafted."""
    at = []
    for step in range(steps):
        n = g.choose()
        if n:
            at.append(step)
        g.record(n, accept(n), cost[n])
    return at


def past_warmup(g: G) -> G:
    g.steps = g._warmup
    g._next_probe = 10**9
    return g


# ----------------------------------------------------------------------------- the cost model
def test_no_cost_known_is_a_flat_unit_cost():
    np.testing.assert_array_equal(G(7).step_cost(), np.ones(8))


def test_one_cost_known_is_used_for_every_length():
    g = G(7)
    g.cost[3] = 2.5
    np.testing.assert_array_equal(g.step_cost(), np.full(8, 2.5))


def test_plain_and_one_drafting_length_give_a_line_through_both():
    g = G(7)
    g.cost[0], g.cost[7] = 1.0, 2.4
    np.testing.assert_allclose(g.step_cost(), 1.0 + 0.2 * np.arange(8))


def test_two_drafting_lengths_give_the_line_plain_keeps_its_own_cost():
    """The drafter call is a step at n = 1, not a slope: plain's cost stays out of the fit."""
    g = G(7)
    g.cost[0], g.cost[2], g.cost[6] = 0.5, 2.0, 3.0
    want = 2.0 + 0.25 * (np.arange(8) - 2)
    want[0] = 0.5
    np.testing.assert_allclose(g.step_cost(), want)
    g.cost[4] = 2.5                             # on the line: the least-squares fit is unchanged
    np.testing.assert_allclose(g.step_cost(), want)


def test_a_falling_line_is_flattened():
    g = G(7)
    g.cost[0], g.cost[2], g.cost[6] = 0.5, 3.0, 2.0
    want = np.full(8, 2.5)
    want[0], want[2], want[6] = 0.5, 3.0, 2.0   # measured lengths keep their measurements
    np.testing.assert_allclose(g.step_cost(), want)


def test_the_fit_is_least_squares():
    g = G(7)
    g.cost[1], g.cost[2], g.cost[3] = 1.0, 3.0, 2.0      # slope 0.5 through the mean (2, 2)
    np.testing.assert_allclose(g.step_cost()[[0, 4, 7]], [1.0, 3.0, 4.5])


# ----------------------------------------------------------------------------- the acceptance estimate
def test_nothing_seen_expects_one_token_a_step():
    np.testing.assert_array_equal(G(7).expected_tokens(), np.ones(8))


def test_decayed_counts_below_one_still_count():
    g = G(2)
    g.hits[:] = [0.5, 0.0]
    g.tries[:] = [0.5, 0.0]                      # half a draw, right: pooled (0.5 + 2 x 0.5) / (0.5 + 2)
    pooled = (0.5 + 2 * 0.5) / (0.5 + 2)
    c1 = (0.5 + 2 * pooled) / (0.5 + 2)
    np.testing.assert_allclose(g.expected_tokens(), [1, 1 + c1, 1 + c1 + c1 * c1])


def test_expected_tokens_from_counts_and_the_prior_of_the_position_before():
    g = G(3)
    g.hits[:] = [3, 1, 0]
    g.tries[:] = [4, 3, 0]
    pooled = (4 + 2 * 0.5) / (7 + 2)             # every position's draws, drawn towards 0.5 by 2 pseudo-draws
    c1 = (3 + 2 * pooled) / (4 + 2)
    c2 = (1 + 2 * c1) / (3 + 2)
    c3 = c2                                      # never reached: the estimate of the position before
    want = 1 + np.array([0, c1, c1 + c1 * c2, c1 + c1 * c2 + c1 * c2 * c3])
    np.testing.assert_allclose(g.expected_tokens(), want)


# ----------------------------------------------------------------------------- probes
def test_probe_length_is_the_fixed_one_without_a_prior():
    assert G(7).probe_len == G.PROBE_SHORT and G(2).probe_len == 2


@pytest.mark.parametrize("c0", [1.0, 2.0])
def test_probe_length_takes_rows_up_to_exactly_the_free_share(c0):
    """A row exactly at the PROBE_FREE bound still counts; the bound is PROBE_FREE x a plain step."""
    c1 = 1.5 * c0
    prior = np.array([c0, c1, c1, c1 + G.PROBE_FREE * c0, c1 + 2 * G.PROBE_FREE * c0, 9, 9, 9])
    assert G(7, prior).probe_len == 3


@pytest.mark.parametrize("scale", [0.01, 2.0])
def test_probe_gap_spends_the_budget(scale):
    """gap = (probe step - plain step) / (PROBE_BUDGET x plain step), within PROBE_EVERY .. 4 PROBE_MAX."""
    for extra, gap in [(0.1, G.PROBE_EVERY), (1.5, 60), (2.45, 98), (50.0, 4 * G.PROBE_MAX)]:
        prior = np.array([1.0] + [1.0 + extra] * 7) * scale
        assert G(7, prior).probe_every == gap, (extra, gap)


def test_a_slow_step_after_a_probe_counts_as_outlier_plain_steps():
    """A step after a probe that took far longer than a plain one (the OS, a page fault) adds OUTLIER - 1
    plain steps to the probe's cost, not what it took."""
    g = G(7, np.array([0.5] + [1.5] * 7))
    g._plan = 0
    g.record(g.probe_len, 0, 2.0)
    g.record(0, 0, 10.0)
    assert g._probe_seen == pytest.approx(2.0 + (G.OUTLIER - 1) * 0.5)
    g.record(0, 0, 0.75)                            # a step within it: its own excess
    assert g._probe_seen == pytest.approx(2.0 + (G.OUTLIER - 1) * 0.5 + 0.25)


def test_probe_gap_reaches_past_four_probe_max_steps_within_probe_longest_seconds():
    """A tiny pair's probe costs tens of plain steps: the budget's gap may pass 4 PROBE_MAX steps, up to
    PROBE_LONGEST seconds of plain decoding; a larger target's stays at 4 PROBE_MAX."""
    for c0, extra, gap in [(1e-4, 50.0, 2000), (1e-4, 500.0, int(G.PROBE_LONGEST / 1e-4)), (1e-2, 50.0, 4 * G.PROBE_MAX)]:
        prior = np.array([1.0] + [1.0 + extra] * 7) * c0
        assert G(7, prior).probe_every == gap, (c0, extra)


def test_probe_gap_counts_what_probes_cost_when_that_is_more():
    """A probe while decoding plainly costs its whole step (the kept features injected, the switch from
    plain): its measured cost sets the gap where it exceeds the settled cost of a step of its length,
    as an EMA; a probe cheaper than that leaves the settled cost in charge."""
    prior = np.array([1.0] + [2.5] * 7)
    g = G(7, prior)
    g._plan = 0
    assert g._probe_gap() == 60                     # (2.5 - 1) / 0.025
    g.record(g.probe_len, 0, 4.0)
    assert g._probe_seen == 4.0 and g._probe_gap() == 120      # (4 - 1) / 0.025
    g.record(g.probe_len, 1, 6.0)                   # (one token right: the whole share, test below)
    assert g._probe_seen == 5.0 and g._probe_gap() == 160      # the EMA: (4 + 6) / 2
    h = G(7, prior)
    h._plan = 0
    h.record(h.probe_len, 0, 1.5)
    assert h._probe_gap() == 60
    k = G(7, prior)                                  # a drafting plan's steps are no probes of plain
    k._plan = 7
    k.record(7, 0, 9.0)
    assert np.isnan(k._probe_seen)
    m = G(7, prior)                                  # nor are plain steps; a 1-token probe is one
    m._plan = 0
    m.record(0, 0, 9.0)
    assert np.isnan(m._probe_seen)
    m.record(1, 0, 4.0)
    assert m._probe_seen == 4.0
    u = G(7)                                         # a probe's length not measured yet: the probes' cost
    u.cost[0] = 1.0
    u._probe_seen = 4.0
    assert u._probe_gap() == 120


def test_fruitless_probes_stretch_the_gap_up_to_the_longest():
    """Each acceptance probe in a row that gets nothing right, past the first, halves the share of plain
    decoding's time probes may take (at most FRUITLESS times), up to the longest gap; a probe that gets a
    token right restores the whole share. Run through choose(): a never-right drafter is probed 15 times
    in 4,000 steps where the whole share alone (PROBE_MAX steps apart) probed it 44 times."""
    prior = np.array([1.0] + [2.5] * 7)
    g = G(7, prior)
    g._plan = 0
    gaps = []
    for _ in range(6):
        g.record(g.probe_len, 0, 2.5)
        gaps.append(g._probe_gap())
    assert gaps == [60, 120, 240, 384, 384, 384]     # 1.5 / (0.025 / 2^k) steps; 4 PROBE_MAX at most
    g.record(g.probe_len, 1, 2.5)
    assert g._probe_gap() == 60
    g.record(0, 0, 1.0)                              # plain steps between probes change nothing
    assert g._fruitless == 0

    def probes(fruitless: int) -> list[int]:
        h = G(7, prior)
        h.FRUITLESS = fruitless
        return probe_steps(h, 4000, lambda n: 0, prior)
    stretched, whole = probes(G.FRUITLESS), probes(0)
    assert (len(stretched), len(whole)) == (15, 44)
    assert np.diff(stretched)[-5:].tolist() == [384] * 5 and np.diff(whole)[-5:].tolist() == [96] * 5


def test_right_probes_that_leave_plain_decoding_the_winner_stretch_the_gap_past_unpaid():
    """Each acceptance probe in a row that gets a token right and still leaves plain decoding the winner at
    the next re-planning, past UNPAID of them, halves the share probes may take (at most FRUITLESS times,
    as fruitless probes do), up to the longest gap; a drafting plan ends the run, and a fruitless probe
    does not count. Through choose(): a drafter right on its first token whose blocks cost 2.5 plain steps
    (plain decoding wins at its 1.8 tokens a step, all tokens right would win) is probed 14 times in 4,000
    steps where the whole share probed it 46 times."""
    prior = np.array([1.0] + [2.5] * 7) * 1e-3
    expected = [1.0, 1.8, 1.9, 2.0, 2.0, 2.0, 2.0, 2.0]

    def run(unpaid: int) -> tuple[list[int], G]:
        h = Fixed(7, expected, prior, prior)
        h.UNPAID = unpaid
        return probe_steps(h, 4000, lambda n: min(n, 1), prior), h
    (stretched, g), (whole, _) = run(G.UNPAID), run(10**6)
    assert (len(stretched), len(whole)) == (14, 46)
    assert np.diff(stretched).tolist() == [5, 4, 8, 16, 64, 240] + [480] * 7   # 1.5 / (0.025 / 2^k) steps
    assert np.diff(whole)[-5:].tolist() == [96] * 5
    assert g._plan == 0 and g._unpaid == 13 and g._probe_gap() == 480
    g.record(g.probe_len, 0, prior[1])                        # a fruitless probe: the run of right ones holds
    g.steps += G.REPLAN_EVERY - g.steps % G.REPLAN_EVERY - 1
    g._next_probe = 10**9
    assert g.choose() == 0 and g._unpaid == 13
    g._unpaid = G.UNPAID + 1                                  # one past UNPAID: half the share
    assert g._probe_gap() == 120
    g._unpaid = G.UNPAID
    assert g._probe_gap() == 60
    g.record(g.probe_len, 1, prior[1])
    g.fixed_expected = [1.0, 1.8, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]   # now drafting wins: the run ends
    g.steps += G.REPLAN_EVERY - g.steps % G.REPLAN_EVERY - 1
    assert g.choose() == 7 and g._unpaid == 0 and not g._probe_right


def test_the_plain_steps_after_a_probe_charge_their_excess_to_the_probe():
    """The PROBE_TAIL plain steps after a probe run slow (the switch back: on the demo pair a plain step
    more at first, fading over ten to twenty steps); their summed excess over a plain step is the probe's
    cost too, weighted as the probe was in the EMA, a step below a plain one taking back from it (noise) but
    never below nothing. A drafting step after it, a step of another sequence of the same batch, or a new
    call ends the tail."""
    prior = np.array([1.0] + [2.5] * 7)
    g = G(7, prior)
    g._plan = 0
    g.record(g.probe_len, 0, 4.0)
    g.record(0, 0, 1.0, same_step=True)             # the probe step's other sequence: not a step after
    g.record(0, 0, 2.0)                             # 1.0 over a plain step
    assert g._probe_seen == 5.0 and g._probe_gap() == 160      # (5 - 1) / 0.025
    g.record(0, 0, 9.0)                             # a step slower than OUTLIER plain ones counts as that
    assert g._probe_seen == 6.0
    g.record(0, 0, 0.5)                             # a step below a plain one takes back (noise) ...
    assert g._probe_seen == 5.5
    tail, used = 1.5, 3
    while tail >= 0 and used < G.PROBE_TAIL - 2:    # ... down to the probe step's own cost, not below
        tail -= float(g.cost[0])                    # (faster steps lower the plain cost as they come)
        g.record(0, 0, 0.0)
        used += 1
    assert tail < 0 and g._probe_seen == pytest.approx(4.0)
    for _ in range(G.PROBE_TAIL - used):            # the tail's last steps ...
        tail += 0.1
        g.record(0, 0, float(g.cost[0]) + 0.1)
    assert g._probe_seen == pytest.approx(4.0 + max(tail, 0.0))
    seen = g._probe_seen
    g.record(0, 0, float(g.cost[0]) + 5.0)          # ... then no more
    assert g._probe_seen == seen
    g.record(g.probe_len, 0, 4.0)                   # a second probe: half of the EMA, so is its excess
    c = float(g.cost[0])
    g.record(0, 0, 1.5 * c)
    assert g._probe_seen == pytest.approx(0.5 * (seen + 4.0) + 0.25 * c)
    for follow, new_run in [((7, 0, 9.0), False), ((0, 0, 9.0), True)]:
        h = G(7, prior)
        h._plan = 0
        h.record(h.probe_len, 0, 4.0)
        if new_run:
            h.new_run()
        h._plan = follow[0]                         # the gate drafts now (a plan's step, not a probe)
        h.record(*follow)
        assert h._probe_seen == 4.0, (follow, new_run)
        h._plan = 0
        h.record(0, 0, 2.0)                         # ... and the tail has ended: a plain step after adds nothing
        assert h._probe_seen == 4.0, (follow, new_run)
    # no prior: a 4-token probe's cost is known, a 1-token step's is not - plain's cost is what counts
    u = G(7)
    u.cost[0], u._plan = 1.0, 0
    u.record(4, 0, 4.0)
    u.record(0, 0, 2.0)
    assert np.isnan(u.cost[1]) and u._probe_seen == 5.0
    # a plain cost of 0 (nothing known to compare with): the step after adds nothing
    z = G(7, np.array([0.0] + [2.5] * 7))
    z._plan = 0
    z.record(z.probe_len, 0, 4.0)
    z.record(0, 0, 3.0)
    assert z._probe_seen == 4.0


def test_a_steady_plain_plan_at_the_longest_gap_probes_within_the_budget():
    """Plain decoding re-chosen at every re-plan doubles the gap up to PROBE_MAX (a drafter that can pay
    comes back soon after a dip); from there, probes that cost more than PROBE_BUDGET allows at that gap
    (a tiny pair) are spaced by the budget, and cheap ones keep PROBE_MAX."""
    exp = np.linspace(1.0, 3.0, 8)                  # right often enough that a full block could pay
    for extra, want in [(5.0, 200), (1.0, G.PROBE_MAX)]:
        cost = np.array([1.0] + [4.0] * 7)
        g = past_warmup(Fixed(7, exp, cost, prior=np.array([1.0] + [1.0 + extra] * 7)))
        assert g._could_pay()
        gaps = []
        for _ in range(12):
            g._next_probe = 10**9                   # re-plans only (the probes' own steps aside)
            replan(g)
            gaps.append(g.probe_every)
        assert gaps[:5] == [G.PROBE_SOON * 2 ** i for i in range(5)], gaps     # 4, 8, 16, 32, 64
        assert gaps[5:] == [want] * 7, (extra, gaps)


def test_probe_gap_is_the_default_while_plain_is_unmeasured():
    g = G(7)
    g.cost[g.probe_len] = 3.0
    assert g._probe_gap() == G.PROBE_EVERY
    g.cost[0] = 0.0
    assert g._probe_gap() == G.PROBE_EVERY


@pytest.mark.parametrize("plan, probes", [(0, [4, 4, 4, 4]), (7, [0, 0, 0, 0]), (3, [7, 7, 0, 0])])
def test_what_a_probe_drafts(plan, probes):
    """Plain plan: a short block; the whole block: a plain step; a middle length: both ends in turn;
    a probe that re-measures a cost (not the plain plan's) takes two steps."""
    g = past_warmup(G(7))
    g._plan = plan
    got = []
    for _ in range(4):
        g.steps += 1
        g._next_probe = g.steps
        got.append(g._scheduled())
    assert got == probes


def test_a_plain_plan_probes_the_whole_block_while_its_deep_positions_are_unknown():
    """Decoding plainly, an acceptance probe drafts the whole block while a position the estimate says is
    reached at least half the time has fewer than FEW_DRAWS draws, if the first token is right at least
    half the time and whole blocks could pay with every token right; else a short block."""
    could = np.array([1.0] + [2.4 + 0.4 * n for n in range(1, 8)])      # 8 tokens for 5.2: could pay
    never = np.array([1.0] + [4.0 + 1.0 * n for n in range(1, 8)])      # 8 tokens for 11: never pays

    def probe(prior=could, hits=(3.0,), tries=(4.0,)):
        g = past_warmup(G(7, prior))
        g._plan = 0
        g.hits[:len(hits)], g.tries[:len(tries)] = hits, tries
        g.steps += 1
        g._next_probe = g.steps
        n = g._scheduled()
        assert g.probing
        return n

    assert G(7, could).probe_len == 1
    assert probe() == 7
    assert probe(hits=(2.0,)) == 7                            # right exactly half the time
    assert probe(hits=(1.9,)) == 1                            # ... less often: a short probe
    assert probe(hits=(0.0,), tries=(0.0,)) == 1              # nothing drawn yet
    assert probe(prior=never) == 1                            # whole blocks could not pay anyway
    few, many = G.FEW_DRAWS - 0.1, G.FEW_DRAWS
    # every position drawn FEW_DRAWS times: known; one past the first drawn fewer: not
    assert probe(hits=(many,) * 7, tries=(many,) * 7) == 1
    assert probe(hits=(many,) * 6 + (few,), tries=(many,) * 6 + (few,)) == 7
    # the second position drawn often and never right: the third, drawn seldom, is seldom reached
    assert probe(hits=(8.0, 0.0), tries=(8.0, 8.0)) == 1
    # ... right on half its draws: the third is reached about half the time, and drawn too seldom
    g = G(7)
    g.hits[:2], g.tries[:2] = (8.0, 4.0), (8.0, 8.0)
    e = g.expected_tokens()
    assert e[2] - e[1] >= 0.5 and probe(hits=(8.0, 4.0), tries=(8.0, 8.0)) == 7


def _plain_probe(prior, hits=(3.0,), tries=(4.0,)) -> int:
    g = past_warmup(G(7, np.asarray(prior, float)))
    g._plan = 0
    g.hits[:len(hits)], g.tries[:len(tries)] = hits, tries
    g.steps += 1
    g._next_probe = g.steps
    return g._scheduled()


@pytest.mark.parametrize("c0, c7, whole", [
    (1.0, 7.0, True),      # 8 tokens in 7 plain steps' time: 1.14 > 1.1
    (1.0, 7.5, False),     # ... in 7.5: 1.07
    (1.0, 8.5, False),     # 0.94: less than plain decoding even with every token right
    (2.0, 14.0, True),     # the same ratio at another plain cost
    (1.1, 8.0, False),     # exactly HOPE better (8 / 8 == 1.1 / 1.1): not more
])
def test_whole_block_probes_need_whole_blocks_to_beat_plain_by_hope(c0, c7, whole):
    """(n_max + 1) tokens a whole block could give, against HOPE more than plain decoding's one a step."""
    prior = [c0] + list(np.linspace(2 * c0, c7, 7))
    assert G(7, np.asarray(prior)).probe_len == 1
    assert _plain_probe(prior) == (7 if whole else 1)


@pytest.mark.parametrize("c0, c1, whole", [
    (1.0, 1.85, True),     # a probe's 2 tokens in 1.85 plain steps' time: 1.08, not HOPE better than plain
    (1.0, 1.8, False),     # ... in 1.8: 1.11: short blocks could pay, their own probes decide
    (1.1, 2.0, True),      # exactly HOPE better (2 / 2 == 1.1 / 1.1): not more
    (2.0, 3.5, False),     # 2 tokens in 1.75 plain steps' time (a plain step of 2 s): 1.14
])
def test_whole_block_probes_only_where_a_probes_short_block_could_not_pay(c0, c1, whole):
    """Where a probe's own short block could beat plain decoding by HOPE with every token right (rows
    nearly free: a target bound by its weights), the short probes' positions decide and probes stay short;
    only where it could not (a target so small that a block's rows cost what its tokens do) do the deep
    positions matter enough to probe the whole block."""
    prior = [c0, c1] + [c1 + 0.5 * c0 * n for n in range(1, 6)] + [4.5 * c0]
    g = G(7, np.asarray(prior))
    assert g.probe_len == 1 and 8 / prior[7] > 1.1 / c0
    assert _plain_probe(prior) == (7 if whole else 1)


def test_whole_block_probes_read_the_first_positions_draws():
    """Right on fewer than half its first-position draws: short probes, even where the estimate, leaning
    on the pooled rate of deeper positions drawn right, reaches the second position more often than half;
    a first position drawn fewer than FEW_DRAWS times, all right: whole blocks (the second is unknown)."""
    could = [1.0] + [2.4 + 0.4 * n for n in range(1, 8)]
    assert _plain_probe(could, hits=(1.9, 3.0, 3.0, 3.0), tries=(4.0, 3.0, 3.0, 3.0)) == 1
    assert _plain_probe(could, hits=(2.0, 3.0, 3.0, 3.0), tries=(4.0, 3.0, 3.0, 3.0)) == 7
    assert _plain_probe(could, hits=(1.0,), tries=(1.0,)) == 7
    assert _plain_probe(could, hits=(0.5,), tries=(0.5,)) == 7


@pytest.mark.parametrize("plan, probe", [(0, [4, None, None]), (7, [0, 0, None]), (3, [7, 7, None])])
def test_a_cost_probe_takes_two_steps_an_acceptance_probe_one(plan, probe):
    g = past_warmup(G(7))
    g._plan = plan
    g.steps += 1
    g._next_probe = g.steps
    got = [g._scheduled()]
    for _ in range(2):
        g.steps += 1
        got.append(g._scheduled())
    assert got == probe


@pytest.mark.parametrize("plan", [0, 7, 3])
def test_only_acceptance_probes_are_marked_probing(plan):
    """``probing`` (a batch then drafts for one sequence) marks the plain plan's short blocks and a
    prior's warm-up probes; the plan's own steps and probes that re-measure a cost draft for all."""
    g = past_warmup(G(7))
    g._plan = plan
    g._next_probe = g.steps + 1
    marks = []
    for _ in range(3):
        n = g.choose()
        marks.append((n, g.probing))
    assert marks[0] == ((4, True) if plan == 0 else (marks[0][0], False))
    assert not any(p for _, p in marks[1:])
    warm = G(7, np.array([1.0] + [3.0] * 7))
    assert warm.choose() == warm.probe_len and warm.probing              # with a prior: an acceptance probe
    cold = G(7)
    assert cold.choose() == 7 and not cold.probing                        # without: the warm-up measures costs


@pytest.mark.parametrize("plan", [0, 7, 3])
def test_the_schedules_steps_are_marked_scheduled_and_the_plans_are_not(plan):
    """``scheduled`` (prompt lookup then never copies in the gate's place: the step must give the gate its
    answer) marks every step the schedule takes - the warm-up, acceptance and cost probes - and none of
    the plan's own steps."""
    g = past_warmup(G(7))
    g._plan = plan
    g._next_probe = g.steps + 1
    marks = [g.scheduled for _ in range(3) if g.choose() >= 0]
    # an acceptance probe is one step, a cost probe two (the second's is the steady cost): then the plan
    assert marks == ([True, False, False] if plan == 0 else [True, True, False]), marks
    cold = G(7)
    assert cold.choose() == 7 and cold.scheduled                         # the warm-up is the schedule's
    warm = G(7, np.array([1.0] + [3.0] * 7))
    assert warm.choose() == warm.probe_len and warm.scheduled            # so is a prior's first probe


def test_warmup_without_a_prior():
    """Runs of two full blocks and two plain steps (each second step's cost is a settled one), half a
    block, a full block."""
    assert list(G(7)._warmup_plan) == [None, None, 0, 0, "half", None]
    for n_max, half in [(7, 3), (3, 1), (2, 1), (1, 1)]:
        g = G(n_max)
        g.steps = 5
        assert g._scheduled() == half


def test_warmup_gives_up_after_two_blocks_with_nothing_right():
    g = G(7)
    chosen = []
    for _ in range(4):
        n = g.choose()
        chosen.append(n)
        g.record(n, 0, 1.0 + 0.1 * n)
    assert chosen == [7, 7, 0, 0]                # given up at step 3: steps 5 and 6 (half, full) never come
    assert g._next_probe == 3 + g._probe_gap()
    assert g.choose() == 0 and g.choose() == 0


def test_warmup_goes_on_when_one_block_was_right():
    g = G(7)
    chosen = []
    for acc in [1, 0, 0, 0, 0, 0]:
        n = g.choose()
        chosen.append(n)
        g.record(n, acc if n else 0, 1.0 + 0.1 * n)
    assert chosen == [7, 7, 0, 0, 3, 7]


def right_probe_gate(prior):
    g = G(7, np.asarray(prior, float))
    for _ in range(G.WARMUP_GIVE_UP):                  # the warm-up probes: nothing right
        g.record(g.choose(), 0, prior[g.probe_len])
    g.choose()                                         # plain from here
    g.record(0, 0, prior[0])
    assert g._plan == 0
    return g


CHEAP = [1.0, 1.2, 1.2, 1.2, 1.2, 2, 2, 2]                  # probe_len 4
THREE = [1.0, 1.2, 1.2, 1.25, 1.5, 2, 2, 2]                 # probe_len 3


@pytest.mark.parametrize("prior, n, accepted, replans", [
    (CHEAP, 4, 2, True), (CHEAP, 4, 1, False), (THREE, 3, 1, False), (THREE, 3, 2, True),
    ([1.0, 1.5, 2.5, 3, 4, 5, 6, 7], 1, 1, True),
])
def test_a_probe_right_on_half_its_tokens_replans(prior, n, accepted, replans):
    g = right_probe_gate(prior)
    assert g.probe_len == n
    steps = g.steps
    g.record(n, accepted, 0.9 * (1 + accepted) * g.cost[0])   # faster than plain per token
    assert (g._plan is None) == replans
    assert (g._next_probe == steps + 2) == replans


@pytest.mark.parametrize("seconds, replans", [(1.6, False), (3 * 0.5, False), (1.45, True)])
def test_a_right_probe_must_beat_plain_decoding_per_token(seconds, replans):
    """A probe that commits 3 tokens (2 accepted) beats plain (0.5 s a step) only if it took less
    than 3 plain steps (its own length's cost, 1.25, is no yardstick)."""
    g = right_probe_gate([0.5, 1.25, 1.25, 1.25, 1.25, 3, 3, 3])
    g.record(g.probe_len, 2, seconds)
    assert (g._plan is None) == replans


@pytest.mark.parametrize("batch, seconds, replans", [
    (1, 1.45, True), (4, 1.45, False), (4, 0.74, True), (4, 0.76, False), (8, 0.62, True), (8, 0.64, False)])
def test_a_batchs_right_probe_must_beat_plain_decoding_for_the_whole_batch(batch, seconds, replans):
    """A batch's probe drafts for one of its b sequences, each charged a b-th of the step: 2 accepted beat
    plain decoding (0.5 s a sequence's share) only if the step's b + 2 tokens did, i.e. each share took
    less than (1 + 2 / b) plain shares; the drafting sequence's 3 tokens alone are no yardstick."""
    g = right_probe_gate([0.5, 1.25, 1.25, 1.25, 1.25, 3, 3, 3])
    g.record(g.probe_len, 2, seconds, batch=batch)
    assert (g._plan is None) == replans


# step costs over a plain step's, as the calibration measured them on two AMD Zen 4 cores (1.7B Q4_0 shape):
# AVX2 without VNNI (a 16-row verify 8.7x a one-row decode) and AVX-512 VNNI (3.0x)
AVX2_PRIOR = np.interp(np.arange(16), [0, 1, 2, 4, 8, 15], [1.0, 1.58, 2.65, 4.0, 6.2, 10.2])
VNNI_PRIOR = np.interp(np.arange(16), [0, 1, 2, 4, 8, 15], [1.0, 1.3, 1.33, 1.4, 1.9, 3.0])


@pytest.mark.parametrize("prior, plan", [(AVX2_PRIOR, 1), (VNNI_PRIOR, 15)])
def test_one_right_probe_is_not_a_drafter_always_right(prior, plan):
    """After one right probe the plan reads the first position's rate drawn towards NEUTRAL (a drafter
    right once is right about two times in three, not always): where a block's rows are dear the plan is a
    short block that pays on that (not the whole block, which pays only if nearly every token is right,
    as the bare rate of 1.0 said it would), where rows are nearly free the whole block, as before."""
    g = G(15, prior)
    n = g.choose()
    assert g.probing and n == g.probe_len
    g.record(n, n, prior[n])                       # every token of the probe right
    assert g.choose() == plan
    if plan < 15:                                  # a middle plan: whole blocks probed no closer than they cost
        assert g.probe_every == g._middle_probe_gap(plan) > 4 * G.PROBE_EVERY
    e = g.expected_tokens()
    assert e[1] - e[0] == pytest.approx((1 + 2 * min(1.0, (n + 1) / (n + 2))) / 3)


def test_the_whole_blocks_prior_gives_way_to_its_probe_even_when_dearer():
    """A middle plan on the prior's word for the whole block measures it soon; the probe's second step
    replaces the prior even where it costs more (the plan's own steps had scaled the prior down): from
    then on the whole block is probed at the budget's gap, not at every re-planning."""
    prior = AVX2_PRIOR
    g = G(15, prior)
    n = g.choose()
    g.record(n, n, prior[n])
    seen = []
    for _ in range(40):
        n = g.choose()
        seen.append(n)
        g.record(n, 0 if n == 15 else 1, 1.2 * prior[n] if n == 15 else 0.9 * prior[n])
    assert seen[:4] == [1] * 4 and seen[4:6] == [15, 15], seen       # PROBE_SOON steps, then two whole blocks
    assert 15 not in g._prior and g.cost[15] == pytest.approx(1.2 * prior[15])
    assert 15 not in seen[6:], seen                                    # not again within 34 steps


def test_a_plain_step_is_no_probe():
    g = right_probe_gate(CHEAP)
    g.record(0, 0, 0.5)                          # a fast plain step
    assert g._plan == 0


def lucky_start(n_max: int = 15) -> G:
    """A gate with a prior (a plain step 1, a block 3 + 0.1 n) whose first warm-up probe was right on
    both its tokens: the extrapolated estimate says every token is right, so it plans whole blocks."""
    g = G(n_max, np.array([1.0] + [3 + 0.1 * n for n in range(1, n_max + 1)]))
    n = g.choose()
    assert n == g.probe_len == 2
    g.record(n, 2, 3.2)
    assert g.choose() == n_max
    return g


def test_a_block_with_nothing_right_on_few_draws_replans_at_the_next_step():
    g = lucky_start()
    g.record(15, 0, 4.5)
    assert g.steps % G.REPLAN_EVERY != 0
    assert g.choose() == 0          # not REPLAN_EVERY steps of whole blocks of a drafter that was lucky once


def test_a_block_with_nothing_right_past_few_draws_waits_for_the_schedule():
    g = lucky_start()
    g.hits[:], g.tries[:] = 0.8 * G.FEW_DRAWS, G.FEW_DRAWS     # many draws of a drafter right 4 times in 5
    g.record(15, 0, 4.5)
    assert g.choose() == 15 and g.steps % G.REPLAN_EVERY != 0
    g.hits[:] = 0.0                                            # (the estimate now says never right)
    chosen = [g.choose() for _ in range(G.REPLAN_EVERY)]
    assert chosen[-1] == 0 and chosen[0] == 15                 # the schedule's re-planning step changes it


def test_a_held_plan_after_an_early_recheck_keeps_the_probing_schedule():
    g = lucky_start()
    g.hits[:], g.tries[:] = 3.0, 3.0                           # few draws, all right
    every, nxt = g.probe_every, g._next_probe
    g.record(15, 0, 4.5)
    assert g.choose() == 15                                    # re-checked, still whole blocks
    assert (g.probe_every, g._next_probe) == (every, nxt)      # a re-check is no scheduled re-plan


def planned(p: int) -> Fixed:
    """A gate past its warm-up, every token right, whose costs make length ``p`` the plan, with no
    acceptance draws yet; its next step is not a re-planning one."""
    cost = np.full(8, 50.0)
    cost[0], cost[p] = 1.0, (0.5 if p else 1.0)
    g = past_warmup(Fixed(7, 1 + np.arange(8.0), cost))
    g.steps = 2 * G.REPLAN_EVERY
    assert g.choose() == p
    return g


PLAIN_WINS = np.array([1.0] + [50.0] * 7)
ONE_WINS = np.array([1.0, 0.1] + [50.0] * 6)


def test_a_plain_step_is_no_miss_of_the_plan():
    g = planned(0)
    g.record(0, 0, 1.0)
    g.fixed_cost = ONE_WINS
    assert g.choose() == 0              # not re-planned before the schedule's step


def test_a_one_token_plan_rechecks_on_a_miss():
    g = planned(1)
    g.record(1, 0, 0.5)
    g.fixed_cost = PLAIN_WINS
    assert g.choose() == 0


def test_few_draws_count_position_one_only():
    g = planned(7)
    g.tries[0], g.tries[1:] = G.FEW_DRAWS + 1, 0.5     # position 1 drawn often, the later ones seldom
    g.record(7, 0, 0.5)
    g.fixed_cost = PLAIN_WINS
    assert g.choose() == 7


@pytest.mark.parametrize("scheduled", ["due", "put off"])
def test_a_recheck_on_a_scheduled_replan_is_the_scheduled_replan(scheduled):
    """A miss that falls on a re-planning step (or one a probe put off) re-plans as the schedule does: a
    plan that holds backs off its probing."""
    g = planned(7)
    if scheduled == "due":
        g.steps = 3 * G.REPLAN_EVERY - 1
    else:
        g._replan_due = True
    every = g.probe_every
    g.record(7, 0, 0.5)
    assert g.choose() == 7 and g.probe_every == min(2 * every, G.PROBE_MAX)


# ----------------------------------------------------------------------------- choose()
def test_the_whole_block_wins_within_the_tie_band():
    exp = 1 + np.arange(8.0)                     # always right
    best = 4.0                                   # n = 3: 4 tokens in 4.0 s
    cost = np.full(8, 99.0)
    cost[3] = best
    cost[7] = 8 / ((1 - G.PREFER_FULL / 2) * 1.0)
    assert past_warmup(Fixed(7, exp, cost)).choose() == 7
    cost[7] = 8 / ((1 - 2 * G.PREFER_FULL) * 1.0)
    assert past_warmup(Fixed(7, exp, cost)).choose() == 3


def test_an_exact_tie_with_the_band_edge_takes_the_whole_block():
    exp = 1 + np.arange(8.0)
    exp[7] = (1 - G.PREFER_FULL) * 8            # rate 1 - PREFER_FULL, exactly (8 is a power of two)
    cost = np.full(8, 99.0)
    cost[3], cost[7] = 4.0, 8.0                 # rate 1.0 at n = 3
    assert past_warmup(Fixed(7, exp, cost)).choose() == 7


@pytest.mark.parametrize("gain, switch, plan_from, drafts", [
    (1.05, 0.0, 0, True),       # no way back measured (no probe yet, or plain steps after one as fast as ever)
    (1.05, 4.0, 0, False),      # from plain decoding, 4 plain steps' excess eats a 5% gain over 8 steps
    (1.05, 4.0, None, False),   # ... so it does on a re-plan after a right probe (the plan dropped)
    (1.05, 4.0, 7, True),       # ... not while drafting: leaving for plain takes no margin (hysteresis)
    (1.30, 4.0, 0, True),       # a clear gain pays for the way back
])
def test_from_plain_decoding_a_drafting_plan_must_pay_for_its_way_back(gain, switch, plan_from, drafts):
    """The plain steps after a drafting one run slow on a small pair (the drafter's run pushed the target
    out of the caches; probes measure their excess): from plain decoding, a drafting plan must pay that
    too, over the REPLAN_EVERY steps it runs at least. Near a tie the demo pair's gate toggled at
    re-plannings and ran at 0.76-0.81x plain."""
    e = np.array([1.0, 1.9, 2.8, 3.6, 4.3, 4.9, 5.4, 5.9])
    cost = np.concatenate([[1.0], e[1:] / gain])            # every drafting length `gain` x plain's rate
    g = past_warmup(Fixed(7, e, cost, prior=cost))
    g._tail_seen = switch
    g._plan = plan_from
    assert g._way_back() == switch
    assert (g._evaluate()[0] > 0) == drafts
    runs = G.REPLAN_EVERY                                   # the bound itself: a way back the gain just pays
    g._tail_seen, g._evaluated = runs * (gain - 1) * float(cost[7]) * 0.99, None
    assert g._evaluate()[0] == 7


def test_the_way_back_is_weighed_for_every_drafting_length_and_a_tie_keeps_drafting():
    """Any drafting length that pays for the way back keeps the plan (a 1-token block alone here), and
    one whose rate with it is exactly plain's is not beaten by it."""
    e = np.array([1.0, 1.9, 2.8, 3.6, 4.3, 4.9, 5.4, 8.0])
    one = np.concatenate([[1.0], [1.9 / 1.3], e[2:] / 0.5])  # only 1-token blocks beat plain (1.3x)
    g = past_warmup(Fixed(7, e, one, prior=one))
    g._plan, g._tail_seen = 0, 2.0                          # 8 x 1.9 / (8 x 1.46 + 2) = 1.11 x plain's rate
    assert g._evaluate()[0] == 1
    tie = np.concatenate([[1.0], e[1:-1] / 0.5, [4.0]])     # whole blocks: 8 tokens in 4 steps' time
    g = past_warmup(Fixed(7, e, tie, prior=tie))
    g._plan, g._tail_seen = 0, 32.0                         # 8 x 8 / (8 x 4 + 32) = 1, plain's rate exactly
    assert g._evaluate()[0] == 7
    g._tail_seen, g._evaluated = 32.5, None
    assert g._evaluate()[0] == 0


def test_the_way_back_is_what_probes_tails_cost():
    """The switch cost is the excess of the plain steps after probes (an EMA as probes' own cost is), not
    the probe step's (which also injects the rows kept since the last probe, a cost a plan switched to
    right after a probe does not pay); none until a probe has been seen."""
    g = G(7, np.array([1.0] + [2.5] * 7))
    g._prior.clear()                                        # measured costs (a prior's first step replaces it)
    g._plan = 0
    assert g._way_back() == 0.0
    g.record(g.probe_len, 1, 4.0)
    assert g._way_back() == 0.0
    g.record(0, 0, 1.5)
    g.record(0, 0, 1.25)
    assert g._way_back() == pytest.approx(0.75)
    g.record(0, 0, 0.25)                                    # a fast step takes back ...
    assert g._way_back() == pytest.approx(0.0)
    g.record(0, 0, 0.25)                                    # ... never below nothing
    assert g._way_back() == 0.0
    for _ in range(G.PROBE_TAIL):
        g.record(0, 0, float(g.cost[0]) + 0.25)
    tail = g._way_back()
    assert tail > 0
    g.record(g.probe_len, 1, 4.0)                           # a second probe: half of the EMA ...
    assert g._way_back() == pytest.approx(0.5 * tail)
    c = float(g.cost[0])
    g.record(0, 0, c + 1.0)                                 # ... and half of its own tail
    assert g._way_back() == pytest.approx(0.5 * tail + 0.5)


def test_replanning_happens_every_replan_steps():
    g = past_warmup(Fixed(7, 1 + np.arange(8.0), 1 + 0.01 * np.arange(8)))
    assert g.choose() == 7
    g.fixed_cost = np.array([1.0] + [50.0] * 7)      # drafting stops paying
    changed = None
    for _ in range(2 * G.REPLAN_EVERY):
        if g.choose() == 0:
            changed = g.steps
            break
    assert changed is not None and changed % G.REPLAN_EVERY == 0


def test_probes_on_replanning_steps_do_not_stop_the_replanning():
    """Probes every PROBE_SOON (4) steps fall on every REPLAN_EVERY (8) step: the plan's next step re-plans
    instead, so a held plan still backs off its probing."""
    exp = np.linspace(1.0, 3.0, 8)
    cost = np.array([1.0] + [4.0] * 7)               # plain is best, the drafter is right (and could pay): PROBE_SOON
    g = past_warmup(Fixed(7, exp, cost, prior=cost))
    g.steps = G.REPLAN_EVERY - 1
    assert g.choose() == 0 and g.probe_every == G.PROBE_SOON and g._next_probe == G.REPLAN_EVERY + G.PROBE_SOON
    seen = set()
    for _ in range(40):
        g.choose()
        seen.add(g.probe_every)
    assert max(seen) > G.PROBE_SOON, seen


def test_a_two_step_probe_on_a_replanning_step_replans_after_it():
    exp = 1 + np.arange(8.0)
    cost = 1 + 0.01 * np.arange(8)                   # the whole block is best
    g = past_warmup(Fixed(7, exp, cost))
    g.steps = G.REPLAN_EVERY - 2
    assert g.choose() == 7
    g._next_probe = G.REPLAN_EVERY
    assert [g.choose(), g.choose()] == [0, 0]        # the probe of plain: steps 8 and 9
    g.fixed_cost = np.array([1.0] + [50.0] * 7)      # drafting stops paying
    assert g.choose() == 0 and g._plan == 0          # step 10 re-plans (step 8's re-planning, put off)


def replan(g: Fixed) -> None:
    g.steps = (g.steps // G.REPLAN_EVERY + 1) * G.REPLAN_EVERY - 1
    g.choose()


def test_probing_backs_off_while_the_plan_holds_and_restarts_on_a_change():
    g = past_warmup(Fixed(7, 1 + np.arange(8.0), 1 + 0.01 * np.arange(8)))
    g.choose()
    seen = []
    for _ in range(4):
        replan(g)
        seen.append(g.probe_every)
    assert seen == [2 * G.PROBE_EVERY, 4 * G.PROBE_EVERY, G.PROBE_MAX, G.PROBE_MAX]
    g.fixed_cost = np.array([1.0, 1.1, 1.2, 1.3, 3, 3, 3, 3])       # now 3 is best
    replan(g)
    assert g._plan == 3 and g.probe_every == G.PROBE_EVERY


@pytest.mark.parametrize("full, gap", [(3.0, G.PROBE_EVERY), (6.0, 105), (90.0, 4 * G.PROBE_MAX)])
def test_a_middle_plans_probes_cost_at_most_the_budget(full, gap):
    """A middle plan probes whole blocks (and plain steps) in turn: each whole block loses its cost less the
    plan's time for the tokens it commits, (full - 8 x 1.3 / 4) here; probes come no closer than that loss
    allows at PROBE_BUDGET of the plan's time (1.3 a step), at most the longest gap apart, and at
    PROBE_EVERY where the loss is small."""
    g = past_warmup(Fixed(7, 1 + np.arange(8.0), np.array([1.0, 1.1, 1.2, 1.3] + [full] * 4)))
    assert g.choose() == 3
    assert g.probe_every == gap == max(G.PROBE_EVERY, min(int(np.ceil((full - 2.6) / (0.025 * 1.3))), g._longest_gap()))


@pytest.mark.parametrize("best", [1, 3])
def test_a_middle_plan_on_the_priors_word_probes_the_whole_block_soon(best):
    exp = 1 + np.arange(8.0)
    cost = np.array([1.0] + [1.0 + 0.1 * n if n <= best else 90 for n in range(1, 8)])   # best is best
    g = past_warmup(Fixed(7, exp, cost, prior=cost))
    g._next_probe = g.steps + 50
    assert g.choose() == best and g._next_probe == g.steps + G.PROBE_SOON
    for _ in range(G.PROBE_SOON - 1):
        assert g.choose() == best
    assert g.choose() == 7                                          # the probe: the whole block
    g.record(7, 7, 1.4)                                             # ... which is cheap after all
    h = past_warmup(Fixed(7, exp, cost, prior=None))                # measured costs: no hurry
    h.cost[:] = cost
    h._next_probe = h.steps + 50
    assert h.choose() == best and h._next_probe == h.steps - 1 + 50


@pytest.mark.parametrize("full, soon", [(1.5, False), (1.49, False), (1.51, True), (3.0, True)])
def test_plain_over_a_drafter_that_is_right_is_probed_soon(full, soon):
    """Plain chosen (drafting costs too much) while the drafter still makes more than DIP tokens a
    full block: probe again in PROBE_SOON steps; at or under DIP the drafter counts as never right
    and the probes' cost sets the gap."""
    exp = np.linspace(1.0, full, 8)
    cost = np.array([1.0] + [4.0] * 7)              # a block with every token right would pay (8 tokens for 4)
    g = past_warmup(Fixed(7, exp, cost, prior=cost))
    g._next_probe = g.steps + 50
    assert g.choose() == 0
    if soon:
        assert g.probe_every == G.PROBE_SOON and g._next_probe == g.steps + G.PROBE_SOON
    else:
        assert g.probe_every == g._probe_gap() == 120 and g._next_probe == g.steps - 1 + 50   # (4 - 1) / 0.025


def test_the_never_right_gap_reads_the_full_blocks_expectation():
    """Only the whole block's expected tokens decide "never right" (a dip at n = 1 does not)."""
    exp = np.array([1.0, 1.6, 1.6, 1.6, 1.6, 1.6, 1.45, 1.45])
    cost = np.array([1.0] + [4.0] * 7)
    g = past_warmup(Fixed(7, exp, cost, prior=cost))
    assert g.choose() == 0 and g.probe_every == g._probe_gap()
    exp2 = exp.copy()
    exp2[-2], exp2[-1] = 1.45, 1.6
    g = past_warmup(Fixed(7, exp2, cost, prior=cost))
    assert g.choose() == 0 and g.probe_every == G.PROBE_SOON
    g._next_probe = 10**9
    replan(g)                                    # plan 0 holds: the usual back-off, no budget floor
    assert g._plan == 0 and g.probe_every == 2 * G.PROBE_SOON


# ----------------------------------------------------------------------------- record(): costs
def test_costs_move_by_the_ema_after_the_first_steady_step():
    """A run's first step sets an unknown cost for now, its second (settled) replaces it, then the EMA."""
    g = G(7)
    g.record(2, 0, 3.0)
    assert g.cost[2] == 3.0
    g.record(2, 0, 1.0)
    assert g.cost[2] == 1.0
    g.record(2, 0, 2.0)
    assert g.cost[2] == pytest.approx(1.0 + G.COST_EMA * 1.0)


def test_a_prior_is_replaced_by_the_first_steady_step_then_averaged():
    g = G(7, np.full(8, 4.0))
    g.record(2, 0, 9.0)                              # after another length: a switch's cost
    assert g.cost[2] == 4.0
    g.record(2, 0, 1.0)
    assert g.cost[2] == 1.0
    g.record(2, 0, 2.0)
    assert g.cost[2] == pytest.approx(1.0 + G.COST_EMA * 1.0)
    assert g.cost[3] == 4.0


def test_a_step_after_another_length_or_a_prefill_moves_no_known_cost():
    """A drafting length counts from its second step in a row; plain decoding after SETTLE[0] plain
    steps (the first plain steps after drafting ones run up to twice as slow on a small pair)."""
    g = G(7, np.full(8, 4.0))
    g.record(7, 0, 1.0)
    assert g.cost[7] == 4.0
    g.record(7, 0, 1.0)
    assert g.cost[7] == 1.0
    for _ in range(G.SETTLE[0]):
        g.record(0, 0, 9.0)                          # the first plain steps after drafting ones
    assert g.cost[0] == 4.0 and g.cost[7] == 1.0
    g.record(0, 0, 0.5)
    assert g.cost[0] == 0.5
    g.new_run()                                      # a new generation: its first step follows a prefill
    for _ in range(G.SETTLE[0]):
        g.record(0, 0, 9.0)
    assert g.cost[0] == 0.5
    g.record(0, 0, 0.5)
    assert g.cost[0] == 0.5
    g.record(7, 0, 9.0)                              # back to drafting: the switch's step, then a steady one
    assert g.cost[7] == 1.0
    g.record(7, 0, 2.0)
    assert g.cost[7] == pytest.approx(1.0 + G.COST_EMA * 1.0)


def test_plain_runs_right_after_drafting_leave_a_cheaper_prior_standing():
    """The demo pair on a Zen 5: plain steps after drafting blocks cost 0.56-0.7 ms for several steps,
    settled ones 0.3 ms (the calibration's 0.27): a run of a few plain steps between blocks must not
    replace the prior, or drafting (0.43 ms a token) looks cheaper than plain decoding."""
    g = G(7, np.array([0.27, 1.2, 1.7, 1.9, 2.1, 2.4, 2.7, 3.0]))
    for _ in range(3):
        g.record(7, 5, 2.3)
        g.record(7, 5, 2.3)
        for s in (2.2, 0.7, 0.62, 0.57):
            g.record(0, 0, s)
    assert g.cost[0] == 0.27


def test_a_probe_may_lower_a_cost_not_raise_it():
    """A probe's second step is still warmer than settled steps: it can only lower the estimate (a prior
    at once: a lower measured step says it was taken on a busier machine; a measured cost by the EMA)."""
    g = past_warmup(G(7, np.full(8, 1.0)))
    g._plan = 7
    for seconds, want in [(3.0, 1.0), (0.5, 0.5), (3.0, 0.5), (0.25, 0.5 - G.COST_EMA * 0.25)]:
        g.record(7, 7, 1.0)
        g._next_probe = g.steps + 1
        for _ in range(2):
            assert g.choose() == 0
            g.record(0, 0, seconds)
        assert g.cost[0] == pytest.approx(want)
    g.cost[0] = 1.0
    for _ in range(G.SETTLE[0] - 2):                 # a plan's own plain steps (no probe), settled ...
        g.steps += 1
        g.record(0, 0, 1.0)
    g.steps += 1
    g.record(0, 0, 3.0)                              # ... may raise it
    assert g.cost[0] == pytest.approx(1.0 + G.COST_EMA * (G.OUTLIER - 1.0))


def test_an_outlier_step_counts_as_outlier_times_the_estimate():
    g = G(7)
    g.record(2, 0, 1.0)
    g.record(2, 0, 1.0)
    g.record(2, 0, 100.0)
    assert g.cost[2] == pytest.approx(1.0 + G.COST_EMA * (G.OUTLIER - 1.0))
    p = G(7, np.full(8, 1.0))
    p.record(2, 0, 1.0)
    p.record(2, 0, 100.0)                            # a prior is capped the same way
    assert p.cost[2] == G.OUTLIER


def test_the_sequences_of_a_batch_step_count_their_draws_the_steps_cost_once():
    g = G(4)
    g.record(4, 0, 1.0)
    g.record(4, 4, 1.0, same_step=True)
    np.testing.assert_allclose(g.tries, [G.DECAY + 1, 1, 1, 1])
    g.record(4, 0, 1.5)
    g.record(4, 0, 1.9, same_step=True)             # would move the cost if it were a step of its own
    assert g.cost[4] == 1.5


def test_acceptance_counts_decay_and_count_the_positions_reached():
    g = G(4)
    g.record(4, 2, 1.0)
    np.testing.assert_array_equal(g.tries, [1, 1, 1, 0])
    np.testing.assert_array_equal(g.hits, [1, 1, 0, 0])
    g.record(2, 2, 1.0)                              # all drafted accepted: nothing beyond reached
    np.testing.assert_allclose(g.tries, [G.DECAY + 1, G.DECAY + 1, G.DECAY, 0])
    np.testing.assert_allclose(g.hits, [G.DECAY + 1, G.DECAY + 1, 0, 0])
    g.record(0, 0, 1.0)                              # a plain step draws nothing
    np.testing.assert_allclose(g.tries, [G.DECAY + 1, G.DECAY + 1, G.DECAY, 0])


def test_a_gate_can_start_from_anothers_acceptance():
    DraftLength = G
    """A batch-size gate takes the one-sequence gate's acceptance history, not its costs: after a
    never-right history it decodes plainly from its first step; after a right one it warms up."""
    never = DraftLength(7)
    for _ in range(3):
        never.record(7, 0, 0.01)
    b = DraftLength(7)
    b.learn_acceptance(never)
    assert [b.choose() for _ in range(4)] == [0, 0, 0, 0] and np.isnan(b.cost).all()
    right = DraftLength(7)
    right.record(7, 7, 0.01)
    c = DraftLength(7)
    c.learn_acceptance(right)
    assert c.choose() == 7 and c.hits.tolist() == right.hits.tolist()
    # probes of the first gate that found nothing, again and again, space the new gate's probes too
    prior = np.array([1.0] + [2.5] * 7)
    one = DraftLength(7, prior)
    one._plan = 0
    for _ in range(3):
        one.record(one.probe_len, 0, 2.5)
    two = DraftLength(7, prior)
    two._plan = 0
    two.record(two.probe_len, 0, 2.5)            # its own probes' cost, one fruitless probe
    before = two._probe_gap()
    two.learn_acceptance(one)
    assert two._probe_gap() == 4 * before == one._probe_gap()
    with pytest.raises(ValueError, match="gates of 3 and 7 drafted tokens"):
        DraftLength(3).learn_acceptance(never)


def _learned_from(prior: np.ndarray, draws: list[int]) -> G:
    """A gate with ``prior`` that learned the acceptance of another one's whole blocks, ``draws[i]``
    tokens of 7 right in its i-th."""
    seen = G(7)
    for a in draws:
        seen.record(7, a, 0.01)
    g = G(7, prior)
    g.learn_acceptance(seen)
    return g


def _probe_steps(g: G, steps: int, accepted, seconds) -> list[int]:
    """Drive ``g`` for ``steps`` - 1 steps (``accepted(n)`` of n drafted right, in ``seconds(n)``); the
    steps that drafted."""
    at = []
    for step in range(1, steps):
        n = g.choose()
        if n:
            at.append(step)
        g.record(n, accepted(n), seconds(n))
    return at


def test_a_gate_that_learned_a_drafter_and_decodes_plainly_probes_at_the_usual_gap():
    """A batch size's gate starts from the acceptance another gate drew many times (learn_acceptance).
    Where its first plan is plain on the rows' cost (a drafter right often enough to keep, not to pay
    at this batch size), it probes first at the usual gap, not every PROBE_SOON steps: that re-probe is
    for plain chosen on few draws, which still get it."""
    prior = np.array([1.0, 2.0, 2.2, 2.4, 2.6, 2.8, 3.0, 3.2])      # every token right would pay (2.5x)

    def probes(draws: list[int]) -> tuple[bool, list[int]]:
        g = _learned_from(prior, draws)
        return g._learned, _probe_steps(g, 60, lambda n: min(n, 1), lambda n: prior[n])

    learned, at = probes([0, 0, 0, 0, 1, 1, 1, 2, 2, 3] * 3)         # about 2 tokens a step: plain wins
    assert learned and at[0] > G.PROBE_EVERY
    learned, at = probes([1, 2, 0])                                  # the same drafter, three draws
    assert not learned and at[:2] == [G.PROBE_SOON + 1, 2 * G.PROBE_SOON + 1]
    # "many": FEW_DRAWS blocks drawn at least (their first position's draws)
    seen, g = G(7), G(7, prior)
    seen.tries[0] = G.FEW_DRAWS
    g.learn_acceptance(seen)
    assert g._learned
    seen.tries[0] = G.FEW_DRAWS - 0.5
    g.learn_acceptance(seen)
    assert not g._learned


def test_a_gate_that_learned_from_few_draws_drafts_only_once_it_drew_enough_itself():
    """A batch size's gate whose learned acceptance rests on fewer than FEW_DRAWS blocks (a server's
    first request, its first steps) plans plainly, whatever that acceptance says, and probes soon; once
    its own probes have drawn FEW_DRAWS blocks, it plans on them. Learned from many draws, it plans at once."""
    prior = np.array([1.0] + [1.2 + 0.05 * n for n in range(1, 8)])     # rows nearly free: drafting pays

    def run(draws: int) -> tuple[G, list[int]]:
        g = _learned_from(prior, [7] * draws)                        # every token right
        chosen = []
        for _ in range(40):
            n = g.choose()
            chosen.append(n)
            g.record(n, n, prior[n])
        return g, chosen

    g, chosen = run(G.FEW_DRAWS + 1)                                # (decayed: 4.7 draws)
    assert g._learned and chosen[0] == 7
    g, chosen = run(2)
    assert not g._learned
    assert chosen.index(g.probe_len) == G.PROBE_SOON, chosen                # plain chosen over few draws: soon
    first = chosen.index(7)
    probes = [n for n in chosen[:first] if n]
    assert chosen[0] == 0 and len(probes) >= 2 and all(n == g.probe_len for n in probes), chosen
    # the plan drafts from the first re-plan after the probes drew FEW_DRAWS blocks (decayed counts)
    assert first <= chosen.index(g.probe_len) + G.PROBE_SOON * 8, chosen
    # whole blocks from there, but for the plan's two-step cost probes (plain) every PROBE_EVERY steps or so
    assert set(chosen[first:]) == {0, 7} and chosen[first:].count(7) >= len(chosen[first:]) - 4, chosen


def test_few_learned_draws_keep_the_soon_probes_going():
    """Plain on few learned draws is plain chosen over a drafter that does get tokens right: its probes
    come PROBE_SOON steps apart, doubling (here right but slow ones, which do not re-plan at once), not at
    the longest gap of a drafter whose tokens could never pay."""
    prior = np.array([1.0] + [1.2 + 0.05 * n for n in range(1, 8)])
    at = _probe_steps(_learned_from(prior, [7]), 40, lambda n: n, lambda n: 100.0 if n else prior[0])
    assert at[:3] == [G.PROBE_SOON + 1, 2 * G.PROBE_SOON + 1, 4 * G.PROBE_SOON + 1], at


@pytest.mark.parametrize("first, second, plan", [(G.FEW_DRAWS, 0.0, 7), (G.FEW_DRAWS - 0.01, G.FEW_DRAWS, 0)])
def test_few_learned_draws_are_the_first_positions(first, second, plan):
    """What counts as enough of its own: position 1's (decayed) draws, at least FEW_DRAWS."""
    g = G(7, np.array([1.0] + [1.2 + 0.05 * n for n in range(1, 8)]))
    g.learn_acceptance(G(7))
    assert g._few
    g.hits[:], g.tries[:] = first, first
    g.tries[1], g.hits[1] = second, second
    g.hits[2:], g.tries[2:] = G.FEW_DRAWS, G.FEW_DRAWS
    g._evaluated = None
    assert past_warmup(g).choose() == plan


def test_batch_prior_scales_one_sequences_costs_by_the_rows():
    """A step of b sequences drafting n each verifies b (n + 1) rows: costed as one sequence's step of
    that many rows less its drafter call (within the calibrated block), beyond it as the full block's
    verify per row, plus b drafter calls, a b-th each; a plain step of b rows without any drafter call."""
    from dflash_gguf.decoding.batch_costs import batch_prior

    c = np.array([10.0, 12.0, 13.0, 15.0, 16.0, 18.0, 19.0, 21.0])    # n = 0..7: 1..8 rows
    assert np.allclose(batch_prior(c, 1), c)
    two = batch_prior(c, 2)
    call = c[1] - c[0]                                                           # the drafter's, about
    assert np.allclose(two[:4], [c[0] / 2, (c[3] + call) / 2, (c[5] + call) / 2, (c[7] + call) / 2])  # 2..8 rows
    per_row = (c[7] - call) / 8                                                  # past the block: per row
    assert np.allclose(two[4:], (per_row * np.array([10, 12, 14, 16]) + 2 * call) / 2)
    three = batch_prior(c, 3)                                                    # 3, 6, 9, 12 ... rows
    assert np.allclose(three[:3], [(c[2] - call) / 3, (c[5] + 2 * call) / 3, (per_row * 9 + 3 * call) / 3])
    assert np.allclose(batch_prior([10, 12, 13, 15, 16, 18, 19, 21], 3), three)  # integer costs alike
    eight = batch_prior(c, 8)
    assert np.allclose(eight[:2], [(c[7] - call) / 8, (per_row * 16 + 8 * call) / 8]) and (np.diff(eight) > 0).all()
    # never below what one sequence's plain step costs, the batch's whole step
    assert np.allclose(batch_prior([10.0, 30.0, 25.0, 32.0], 3)[0], 10.0 / 3)
    assert np.allclose(batch_prior(c / 1000, 3), three / 1000)                  # seconds, as the gate's are
    assert np.allclose(batch_prior([10.0, 14.0], 2), [10.0 / 2, (10.0 * 4 / 2 + 2 * 4.0) / 2])  # a one-token block
    assert np.allclose(batch_prior([10.0], 2), [10.0])                          # no drafting at all
    # drafting looks dearer, per sequence, the larger the batch (as on a CPU); plain steps cheaper
    assert eight[7] / eight[0] > two[7] / two[0] > c[7] / c[0]
    assert eight[0] < two[0] < c[0]


@pytest.mark.parametrize("block, soon", [(9.0, False), (8.0 / 1.1 + 0.01, False), (8.0 / 1.1 - 0.01, True)])
def test_a_right_drafter_whose_blocks_could_not_pay_is_probed_the_longest_gap_apart(block, soon):
    """A tiny target (the demo pair on a fast CPU): a block costs about what its tokens do even with every
    token right, so plain wins at any acceptance the drafter reaches; probing it every PROBE_SOON steps
    (each probe and the slower plain steps after it cost about ten plain steps there) only loses, and so
    does probing it as often as the budget allows: no acceptance a probe finds changes the choice. Its
    probes come the longest gap apart, the first one too (the one scheduled sooner is put off). Where a
    block of right tokens would beat plain decoding by more than HOPE, the usual soon re-probe stays."""
    exp = np.linspace(1.0, 7.0, 8)                   # nearly every token right
    cost = np.array([1.0] + [block] * 7)
    g = past_warmup(Fixed(7, exp, cost, prior=cost))
    g._next_probe = g.steps + 50
    assert g.choose() == 0
    assert g._could_pay() is soon
    if soon:
        assert g.probe_every == G.PROBE_SOON
    else:
        assert g.probe_every == g._longest_gap() == max(4 * G.PROBE_MAX, int(G.PROBE_LONGEST / 1.0))
        assert g.probe_every > g._probe_gap() and g._next_probe == g.steps + g.probe_every


def test_could_pay_reads_every_length_and_scales_with_the_costs():
    g = G(7, np.array([1.0, 1.5] + [100.0] * 6))
    assert g._could_pay()                            # one token drafted: 2 tokens for 1.5 plain steps
    g = G(7, np.array([1.1, 2.0] + [100.0] * 6))
    assert not g._could_pay()                        # exactly HOPE better with every token right: not more
    for scale in (1.0, 2.0, 0.001):
        assert G(7, scale * np.array([1.0] + [7.0] * 7))._could_pay()
        assert not G(7, scale * np.array([1.0] + [7.5] * 7))._could_pay()


def test_a_plain_step_that_ties_the_prior_leaves_it_standing():
    """An unsettled step at exactly the prior's cost neither moves it nor ends its stand-in: the first
    settled step still replaces it."""
    g = G(7, np.full(8, 4.0))
    g.record(7, 0, 1.0)
    for _ in range(G.SETTLE[0]):
        g.record(0, 0, 4.0)
    g.record(0, 0, 1.0)
    assert g.cost[0] == 1.0


def test_a_full_block_probe_of_a_middle_plan_may_lower_its_cost_not_raise_it():
    """A middle plan re-measures the whole block in two steps; the second is the probe's and, like a
    plain probe's, it may only lower the cost (a settled drafting step of the plan may raise it)."""
    g = past_warmup(G(7, np.full(8, 1.0)))
    g._prior.clear()
    g._plan = 3
    g._probe_full = False
    g._next_probe = g.steps + 1
    g.record(3, 3, 1.0)
    assert g.choose() == 7
    g.record(7, 7, 9.0)                              # the switch's step: no cost
    assert g.choose() == 7
    g.record(7, 7, 3.0)                              # the probe's second step: would raise, does not
    assert g.cost[7] == 1.0
    g.record(3, 3, 1.0)                              # a step of the plan between
    g._next_probe = g.steps + 1
    g._probe_full = False
    assert g.choose() == 7
    g.record(7, 7, 9.0)
    assert g.choose() == 7
    g.record(7, 7, 0.5)                              # ... and lowers it by the EMA
    assert g.cost[7] == pytest.approx(1.0 - G.COST_EMA * 0.5)


def test_the_plans_own_steps_move_every_cost_with_the_machine():
    """A settled step of the plan that moves its cost moves every other length's by the same factor (the
    machine got busier or quieter); a step of another length moves its own cost only."""
    prior = np.array([0.5, 1.4, 1.6, 1.9, 2.3, 2.6, 2.9, 3.0])
    g = past_warmup(G(7, prior.copy()))
    g._plan = 0
    for _ in range(G.SETTLE[0] + 1):                 # a run's first step, then settled ones at the prior
        g.steps += 1
        g.record(0, 0, 0.5)
    np.testing.assert_allclose(g.cost, prior)
    g.steps += 1
    g.record(0, 0, 0.65)                             # a busier minute
    moved = 0.5 + G.COST_EMA * 0.15
    np.testing.assert_allclose(g.cost, prior * moved / 0.5)
    before = g.cost.copy()
    g._plan = 7
    for _ in range(2):                               # steps of another length than the plan's
        g.steps += 1
        g.record(3, 0, 1.0)
    assert g.cost[3] != before[3]
    np.testing.assert_allclose(np.delete(g.cost, 3), np.delete(before, 3))
    # a plan's cost of 0 (a test's prior; no real step costs nothing) scales nothing: no infinities
    z = past_warmup(G(7, np.array([0.0] + [2.5] * 7)))
    z._plan = 0
    for _ in range(G.SETTLE[0] + 2):
        z.steps += 1
        z.record(0, 0, 0.5)
    assert np.array_equal(z.cost, np.array([0.0] + [2.5] * 7))


def test_a_busy_spell_while_decoding_plainly_does_not_switch_to_drafting():
    """The demo pair's case: a drafter that is right (85% a position) whose blocks still cost more than
    their tokens (plain 0.5 ms a token, a full block 3 ms for ~4.9 tokens). When the machine slows by 35%
    while the gate decodes plainly, plain decoding's cost rises - and so must the costs it compares it
    with: the gate keeps decoding plainly."""
    true = np.array([0.5, 1.4, 1.6, 1.9, 2.3, 2.6, 2.9, 3.0])
    g = G(7, true.copy())
    rng = np.random.default_rng(1)
    chosen = []
    for t in range(600):
        n = g.choose()
        acc = 0
        while acc < n and rng.random() < 0.85:
            acc += 1
        g.record(n, acc, (1.0 if t < 150 else 1.35) * true[n])
        chosen.append(n)
    busy = np.array(chosen[150:])                    # without the rule: 50 of its first 100 steps drafted
    assert np.mean(busy == 0) >= 0.95, np.bincount(busy)


def test_a_run_goes_on_across_batch_sizes_but_not_across_a_prefill():
    """Steps of one length in a row are settled whichever batch size's gate took them: a server whose batch
    size changes every few steps must still measure each batch size's costs. (Without it a gate whose
    steps all follow another gate's keeps its prior for good: a noisy one that says one drafted token costs
    less than a plain step had a 4-client server draft for two sequences at every such step; a cost model
    no longer lets a drafting step cost less than a plain one, so here the prior says drafting is nearly
    free, for a drafter whose first token is right.)"""
    wrong = np.array([20.0, 21.0, 22.0, 23.0])          # drafting looks nearly free
    small, big = G(3, wrong.copy()), G(3, np.array([10.0, 30.0, 40.0, 50.0]))
    seen = []
    for _ in range(30):                                  # the two batch sizes alternate, step by step
        big.new_run(small)
        big.record(0, 0, 10.0)
        small.new_run(big)
        n = small.choose()
        small.record(n, min(n, 1), 45.0 if n else 20.0)  # one token right a block: 2 for 45 against 1 for 20
        seen.append(n)
    assert all(small.cost[n] > 1.9 * wrong[n] for n in (1, 2, 3)), "the plans' real costs replaced the prior's"
    assert small._plan == 0 and seen[-4:].count(0) >= 2, "and plans plain decoding, as it should (probes aside)"
    fresh = G(3, wrong.copy())
    for _ in range(30):                                  # a prefill before every step: never a settled one
        fresh.new_run()
        fresh.record(1, 0, 45.0)
    assert fresh.cost[1] == wrong[1]


def test_the_plans_switch_steps_count_from_the_switches_th_in_a_row():
    """SWITCHES - 1 steps of the plan that each begin a run move no cost; the next does. A steady step of
    the plan in between starts the count again."""
    g = G(3, np.array([20.0, 14.0, 16.0, 18.0]))
    g._plan = 1
    for _ in range(G.SWITCHES - 1):
        g.new_run()
        g.record(1, 0, 21.0)
    assert g.cost[1] == 14.0
    g.record(1, 0, 14.0)                                 # a steady step of the plan, at its known cost
    assert g.cost[1] == 14.0
    for _ in range(G.SWITCHES - 1):
        g.new_run()
        g.record(1, 0, 21.0)
    assert g.cost[1] == 14.0, "the steady step started the count again"
    g.new_run()
    g.record(1, 0, 21.0)
    assert g.cost[1] == pytest.approx(14.0 + G.COST_EMA * 7.0) and g.cost[0] == 20.0, \
        "the SWITCHES-th moves the plan's cost (the steady step replaced the prior: an average now), and only its"


def test_a_switch_step_of_another_length_starts_the_count_again():
    """A step of another length (a probe), itself a run's first, sets the count of the plan's switch
    steps back to none: SWITCHES - 1 more of them move no cost, the next does."""
    g = G(3, np.array([10.0, 30.0, 40.0, 50.0]))
    g._plan = 0
    g.new_run()
    g.record(0, 0, 20.0)                                 # the plan's first switch step
    g.new_run()
    g.record(2, 0, 45.0)                                 # a probe's, also a run's first
    for _ in range(G.SWITCHES - 1):
        g.new_run()
        g.record(0, 0, 20.0)
    assert g.cost[0] == 10.0 and g.cost[2] == 40.0, "the probe started the count again"
    g.new_run()
    g.record(0, 0, 20.0)
    assert g.cost[0] == 20.0, "the SWITCHES-th in a row replaces plain's prior"


def test_the_switch_count_runs_on_when_the_plan_changes():
    """The count of switch steps is the gate's, not a plan's: it says that every step of this gate follows
    another gate's, which a new plan does not change. After SWITCHES - 1 of one plan, a new plan's first
    switch step moves its cost; a step of another length (a probe) starts the count again."""
    g = G(3, np.array([20.0, 14.0, 16.0, 18.0]))
    g._plan = 1
    for _ in range(G.SWITCHES - 1):
        g.new_run()
        g.record(1, 0, 21.0)
    g._plan = 2
    g.new_run()
    g.record(2, 0, 30.0)
    assert g.cost[2] == 30.0 and g.cost[1] == 14.0, "the new plan's first switch step counts, for its own length"
    g.new_run()
    g.record(3, 0, 40.0)                                 # a probe's switch step: not the plan
    assert g.cost[3] == 18.0
    g.new_run()
    g.record(2, 0, 20.0)
    assert g.cost[2] == 30.0, "the probe started the count again"


def test_a_plain_step_after_another_gates_plain_steps_is_a_settled_one():
    """new_run(after): the run goes on from the other gate's: past SETTLE[0] plain steps in a row, a
    plain step of this gate may raise its cost; after new_run() (a prefill) it is a switch's."""
    other = G(3, np.full(4, 10.0))
    for _ in range(G.SETTLE[0] + 1):
        other.record(0, 0, 10.0)
    g = G(3, np.array([5.0, 30.0, 40.0, 50.0]))
    g.new_run()
    g.record(0, 0, 10.0)
    assert g.cost[0] == 5.0
    g.new_run(other)
    g.record(0, 0, 10.0)
    assert g.cost[0] == 10.0


# ----------------------------------------------------------------------------- re-planning's cost
class Counting(G):
    """A real gate that counts its evaluations (each reads the acceptance estimate once)."""

    evaluations = 0

    def expected_tokens(self):
        self.evaluations += 1
        return super().expected_tokens()


def plain_after_warmup(prior):
    """A gate with ``prior`` whose drafter got nothing right in its warm-up: decoding plainly."""
    g = Counting(7, np.array(prior, float))
    for _ in range(G.WARMUP_GIVE_UP):
        n = g.choose()
        assert n > 0
        g.record(n, 0, prior[n])
    assert g.choose() == 0
    return g


def test_replans_while_decoding_plainly_evaluate_once_until_something_changes():
    """The plan's own steps scale every cost by one factor, which cannot change the choice: re-planning
    every REPLAN_EVERY steps reuses the evaluation; a drafting step (acceptance) or a cost that moves
    against the others (a length's first measurement, a step of another length) evaluates again."""
    prior = [1.0, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1]
    g = plain_after_warmup(prior)
    g._next_probe = 10**9
    for _ in range(G.SETTLE[0] + 1):                      # plain's first settled step replaces its prior
        g.choose()
        g.record(0, 0, 1.0)
    assert 0 not in g._prior
    first, before = g.evaluations, list(g.cost)
    for i in range(10 * G.REPLAN_EVERY):                  # settled plain steps, the machine drifting
        assert g.choose() == 0
        g.record(0, 0, 1.0 + 0.01 * (i % 5))
    assert g.evaluations == first and g.cost[0] != 1.0     # the costs moved (all together), no evaluation
    np.testing.assert_allclose(np.array(g.cost[1:]) / g.cost[0], np.array(before[1:]) / before[0])
    assert g._evaluated is not None
    g._plan = 7                                           # a plain step while the plan drafts: plain's cost
    g.record(0, 0, 0.5)                                   # moves against the others
    assert g._evaluated is None
    g._plan = 0
    g._evaluate()
    g.record(3, 0, 1.7)                                   # a drafting step: acceptance counts change
    assert g._evaluated is None
    g.steps = (g.steps // G.REPLAN_EVERY + 1) * G.REPLAN_EVERY - 1
    g.choose()
    assert g.evaluations == first + 2


def test_a_first_measurement_of_a_length_drops_the_evaluation():
    g = G(7)
    g.record(7, 3, 2.0)
    g.record(7, 3, 2.0)
    g._evaluate()
    assert g._evaluated is not None
    g.record(0, 0, 1.0)                                   # plain's first cost: it was unknown (nan)
    assert g._evaluated is None and g.cost[0] == 1.0


def test_learning_another_gates_acceptance_replans_on_it():
    """A gate decoding plainly after an unlucky warm-up takes a right drafter's acceptance from another
    gate (a new batch size's gate): its next plan drafts (the evaluation it kept is no longer valid)."""
    prior = [1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]
    g = plain_after_warmup(prior)
    g._next_probe = 10**9
    seen = G(7, np.array(prior))
    for _ in range(40):
        seen.record(7, 7, prior[7])                       # every drafted token right
    g.learn_acceptance(seen)
    g.steps = (g.steps // G.REPLAN_EVERY + 1) * G.REPLAN_EVERY - 1
    assert g.choose() == 7


def test_the_longest_gap_without_a_plain_cost_is_four_probe_max():
    g = G(7)
    assert g._longest_gap() == 4 * G.PROBE_MAX
    g.record(0, 0, 0.5)
    assert g._longest_gap() == max(4 * G.PROBE_MAX, int(G.PROBE_LONGEST / 0.5))
    g.cost[0] = 1e-3
    assert g._longest_gap() == int(G.PROBE_LONGEST / 1e-3) > 4 * G.PROBE_MAX


def test_a_futile_drafter_is_probed_once_per_longest_gap_in_a_long_plain_run():
    """A drafter right on about half its tokens whose every token right would not pay by HOPE (a block
    costs 7.5 plain steps: all 8 tokens right would beat plain by 6.7%): after the warm-up it decodes
    plainly, and its probes come exactly _longest_gap() steps apart, the first one too, re-planning in
    between not putting them off (at the budget's gaps each probe would be followed by another soon)."""
    prior = [1e-3] + [7.5e-3] * 7
    g = G(7, np.array(prior))
    n = g.choose()
    g.record(n, n // 2, prior[n])                         # partly right: the plan starts (and finds plain)
    probes = []
    for _ in range(3 * g._longest_gap() + 50):
        n = g.choose()
        if n:
            probes.append(g.steps)
        g.record(n, n // 2, prior[n])
    gap = g._longest_gap()
    assert gap == int(G.PROBE_LONGEST / 1e-3) and len(probes) == 3
    assert probes[0] > gap and np.diff(probes).tolist() == [gap, gap]


def test_a_gate_without_a_prior_probes_by_its_measured_costs_once_it_has_them():
    """Without a prior the probe drafts PROBE_SHORT tokens; once every length's cost is measured, the
    longest probe whose extra rows are nearly free (here 2 tokens: a third row costs a plain step)."""
    g = G(7)
    assert g._probe_length() == G.PROBE_SHORT
    for n, x in enumerate([1.0, 2.0, 2.05, 3.0, 3.0, 3.1, 3.2, 3.3]):
        g.cost[n] = x                                     # as record() measures each length
    assert g._probe_length() == 2


# ----------------------------------------------------------------------------- plain decoding's prior
# a prior measured while the machine was busy (0.6B Q4_0 shape, reduced head, AVX2 Zen 4): plain 18.9 ms
# a step, where plain steps then took 14 ms and 1-token blocks 18.6 ms
BUSY_PRIOR = np.array([18.9, 27.7, 37.1, 49.2, 61.2, 71.4, 81.7, 92.0, 110.4, 119.4, 128.3, 137.3, 146.2, 155.1,
                       164.1, 173.0]) * 1e-3


def test_plain_on_the_priors_word_costs_at_most_a_measured_drafting_step():
    """A drafting step does a plain step's work and more: plain decoding, while its cost is the prior's
    word, costs no more than the cheapest drafting step measured since; a measured plain cost stands."""
    g = G(15, BUSY_PRIOR)
    g.cost[1] = 18.6e-3
    g._prior.discard(1)                                # the 1-token block measured
    c = g.step_cost()
    assert c[0] == pytest.approx(18.6e-3) and c[1] == pytest.approx(18.6e-3)
    assert c[2] == pytest.approx(BUSY_PRIOR[2])        # the others as they were
    g.tries[0] = 3.0                                   # never right: as many tokens a step either way ...
    assert g._evaluate()[0] == 0                       # ... so plain decoding, not the 1-token block
    g._prior.discard(0)                                # plain measured: its own cost, even above a block's
    g.cost[0] = 20e-3
    assert g.step_cost()[0] == pytest.approx(20e-3)
    h = G(15, BUSY_PRIOR)                              # nothing measured: the prior as it is
    assert h.step_cost()[0] == pytest.approx(BUSY_PRIOR[0])
    k = G(3)                                           # no prior: plain's first step, a switch's, stands in ...
    k.record(0, 0, 20.0)
    k.record(2, 0, 30.0)
    k.record(2, 0, 15.0)                               # ... and a steady 2-token block measured under it
    assert 0 in k._prior and 1 not in k._prior and k.cost[1] != k.cost[1]   # (1: not measured, nan)
    assert k.step_cost()[0] == 15.0


def test_a_busy_plain_prior_does_not_draft_for_a_never_right_drafter():
    """The gate on the busy prior above with a never-right drafter, as a kept gate runs four 64-token
    calls: it decodes plainly apart from its probes (it drafted 1-token blocks at every step before, the
    plain cost never measured), and plain's cost comes down to what plain steps cost."""
    real = lambda n: 14e-3 if n == 0 else 18.6e-3 + 4.8e-3 * (n - 1)   # noqa: E731
    g = G(15, BUSY_PRIOR)
    drafted = 0
    for _call in range(4):
        g.new_run()
        for _ in range(64):
            n = g.choose()
            drafted += n > 0
            g.record(n, 0, real(n))
    assert drafted <= 12, drafted
    assert 0 not in g._prior and g.cost[0] == pytest.approx(14e-3)


def test_a_drafting_plan_close_to_a_plain_prior_probes_plain_soon():
    """A drafting plan that beats plain decoding on the prior's word by less than PLAIN_DOUBT allows
    measures plain soon (two plain steps in PROBE_SOON); one far ahead of it, or plain measured, keeps
    the schedule."""
    exp = np.array([1.0, 1.5, 1.6, 1.7])
    cost = np.array([1.0, 1.2, 2.5, 3.0]) * 14e-3      # the 1-token block: 1.25x plain's tokens a second
    g = past_warmup(Fixed(3, exp, cost, prior=cost))
    g._prior.discard(3)                                # the whole block measured: plain is the probe
    g._next_probe = g.steps + 50
    assert g.choose() == 1 and g._next_probe == g.steps + G.PROBE_SOON
    for _ in range(G.PROBE_SOON - 1):
        assert g.choose() == 1
    assert [g.choose(), g.choose()] == [0, 0]
    far = past_warmup(Fixed(3, np.array([1.0, 1.5, 2.0, 6.0]), cost, prior=cost))   # whole blocks 2x plain
    far._next_probe = far.steps + 50
    assert far.choose() == 3 and far._next_probe == far.steps - 1 + 50
    near = past_warmup(Fixed(3, exp, cost, prior=cost))
    near._prior.discard(0)                             # plain measured: no hurry
    near._prior.discard(3)
    near._next_probe = near.steps + 50
    assert near.choose() == 1 and near._next_probe == near.steps - 1 + 50


def _second_step(n: int, probe: bool) -> G:
    """A gate on a prior whose step of ``n`` follows one of ``n`` (steady, not settled for plain), costing
    more than the prior says: a cost probe's second step if ``probe``."""
    g = G(3, np.array([10.0, 12.0, 14.0, 16.0]))
    g.steps = 5
    g._probe_step = 5 if probe else 4
    g._run, g._streak = n, 1
    g.record(n, 0, 1.1 * g.cost[n])
    return g


def test_only_a_plain_probes_second_step_checks_plains_prior():
    """A plain probe's second step that does not lower plain's prior checks it (no more plain probes on
    its account); a plain step that is no probe's, or a drafting probe's second step, does not."""
    g = _second_step(0, probe=True)
    assert g.cost[0] == 10.0 and not g._plain_on_prior()
    assert _second_step(0, probe=False)._plain_on_prior()
    k = _second_step(2, probe=True)
    assert k.cost[2] == 14.0 and k._plain_on_prior()


def _batch_of_two(g: G, steps: int, right: bool, true_costs: np.ndarray) -> list[tuple[int, bool]]:
    """``steps`` steps of a 2-sequence batch's gate: (drafted, whether the whole batch drafted) for each.
    A probe drafts for one sequence (the step costs a plain share plus half a drafting one, per sequence);
    the whole batch drafting n costs ``true_costs[n]`` per sequence; every token right, or none."""
    out = []
    for _ in range(steps):
        n = g.choose()
        whole = n > 0 and not g.probing
        a = n if right else 0
        if n == 0:
            g.record(0, 0, float(true_costs[0]), batch=2)
        elif g.probing:
            g.record(n, a, float(true_costs[0] + true_costs[n]) / 2, batch=2)
        else:
            g.record(n, a, float(true_costs[n]), batch=2)
            g.record(n, a, float(true_costs[n]), same_step=True, batch=2)
        out.append((n, whole))
    return out


def test_a_batch_gate_measures_its_whole_batch_drafting_before_calling_drafting_futile():
    """A batch size's prior is scaled from one sequence's costs and may rate drafting so dear that not even
    every token right would pay (1.5x too dear at the 1.7B shape on AVX2). Once the drafter's probes are
    right, the whole batch drafts a short block twice: the second step's cost replaces the prior's, the
    other drafting lengths' priors move by the same factor, and where drafting pays the plan drafts."""
    prior = np.array([1.0, 3.0, 4.0, 5.0, 6.0])          # per sequence: 5 tokens for 6 plain steps' time
    true = np.array([1.0, 1.2, 1.6, 2.0, 2.4])
    g = G(4, prior)
    g.batch = 2
    assert not g._could_pay()
    steps = _batch_of_two(g, 60, True, true)
    whole = [i for i, (n, w) in enumerate(steps) if w]
    assert whole and whole[0] < 20
    assert steps[whole[0] - 1][0] == 0                        # once it has planned plain decoding on the prior
    k = steps[whole[0]][0]
    assert g.cost[k] == pytest.approx(true[k], rel=0.1)     # (then tracked by later steps)
    assert all(g.cost[j] < 0.6 * prior[j] for j in range(1, 5))   # every drafting cost measured or moved with k's
    assert sum(n for n, w in steps[-20:] if w) > 0           # and the batch drafts
    assert g._plan > 0


def test_a_batch_gate_never_drafts_its_whole_batch_for_a_drafter_never_right():
    """A never-right drafter's probes find nothing: no step of the whole batch drafting is run to measure the
    prior (and one sequence's gate measures no batch)."""
    prior = np.array([1.0, 3.0, 4.0, 5.0, 6.0])
    true = np.array([1.0, 1.2, 1.6, 2.0, 2.4])
    g = G(4, prior)
    g.batch = 2
    assert not any(w for _n, w in _batch_of_two(g, 400, False, true))
    one = G(4, prior)
    assert not one._batch_prior_unchecked()


def test_a_batch_gates_dearer_whole_batch_is_measured_once():
    """Where the whole batch's drafting step costs more than even its prior said, the prior stands (a
    probe's second step may lower a cost, not raise it) and the batch is not made to draft again to ask."""
    prior = np.array([1.0, 3.0, 4.0, 5.0, 6.0])
    g = G(4, prior)
    g.batch = 2
    steps = _batch_of_two(g, 300, True, prior * np.array([1.0, 1.5, 1.5, 1.5, 1.5]))
    assert sum(w for _n, w in steps) == 2 and g._plan == 0


@pytest.mark.parametrize("first", [1, 2])
def test_a_batch_gates_first_measure_of_a_drafting_length_moves_the_other_drafting_priors(first):
    """A batch size's drafting priors come from one model (batch_costs) and are off together: the first
    steady measure of one drafting length scales the drafting lengths still on the prior by the same factor,
    and leaves measured lengths and plain decoding's cost alone (one sequence's gate: each length its own)."""
    prior = np.array([0.05, 0.15, 0.2, 0.25, 0.3])
    g = G(4, prior)
    g.batch = 2
    for _ in range(G.SETTLE[0] + 2):
        g.record(0, 0, 0.04)                                # plain measured: the drafting priors stay
    np.testing.assert_allclose(g.cost[1:], prior[1:])
    for _ in range(2):
        g.record(first, first, prior[first] / 2)            # the second step is steady: half the prior
    want = prior / 2
    want[0] = g.cost[0]
    np.testing.assert_allclose(g.cost, want)
    for _ in range(2):
        g.record(4, 4, want[4] * 0.8)                       # a later first measure: only the priors move
    moved = want * np.array([1, 0.8, 0.8, 0.8, 0.8])
    moved[first] = want[first]
    np.testing.assert_allclose(g.cost, moved)
    one = G(4, prior)
    for _ in range(2):
        one.record(first, first, prior[first] / 2)
    np.testing.assert_allclose(np.delete(one.cost, first), np.delete(prior, first))

def test_the_plans_first_measure_of_a_prior_keeps_the_evaluation_only_where_every_cost_moved_alike():
    """Re-planning reuses the last evaluation while every cost moves by one factor: one sequence's first
    measure of the plan's length, with every other length still on the prior, moves them all alike; with
    a length measured, or at a batch size (its drafting priors stay), the costs move apart and it is dropped."""
    prior = np.array([0.05, 0.15, 0.2, 0.25, 0.3])
    for batch, measured, kept in ((1, False, True), (1, True, False), (2, False, False)):
        g = G(4, prior)
        g.batch = batch
        if measured:
            g._prior.discard(4)                             # the whole block measured already
        g._plan = 0                                         # plain decoding (no acceptance to change)
        g.record(0, 0, 0.04)                                # a run's first step
        g._evaluate()
        g.record(0, 0, 0.025)                               # steady, cheaper: replaces plain's prior (half of it)
        assert 0 not in g._prior and (g._evaluated is not None) is kept, (batch, measured)


def test_a_cut_block_counts_its_verified_positions_and_moves_no_cost():
    """A block drafted whole and verified to ``verified`` tokens (the confidence cut it): only those were
    tried, and with no seconds given the step moves no cost while continuing the run of its length."""
    g = G(4, np.array([0.05, 0.15, 0.2, 0.25, 0.3]))
    g._plan = 4
    g.record(4, 1, 0.3)
    costs = list(g.cost)
    g.record(4, 2, None, verified=2)
    np.testing.assert_allclose(g.tries, [G.DECAY + 1, G.DECAY + 1, 0, 0])    # the third was not verified
    np.testing.assert_allclose(g.hits, [G.DECAY + 1, 1, 0, 0])
    assert g.cost == costs and g._run == 4 and g._streak == 2


@pytest.mark.parametrize("batch", [1, 2])
def test_the_plans_first_measure_of_its_prior_leaves_measured_costs_alone(batch):
    """The plan's own steps move every cost with the machine, but the first of them replaces its length's
    prior: that factor is the prior's error, not the machine's, and moves only the costs still on the prior
    - plain decoding's measured cost stays (scaled with a busy prior's, a 4-sequence gate's plain steps,
    measured at 13 ms a sequence, read 18, and blocks that ran at 0.8x plain looked 1.1x: 1.7B Q4_0, AVX2)."""
    prior = np.array([0.05, 0.15, 0.2, 0.25, 0.3])
    g = G(4, prior)
    g.batch = batch
    for _ in range(G.SETTLE[0] + 2):
        g.record(0, 0, 0.04)                                # plain measured
    plain = g.cost[0]
    assert 0 not in g._prior
    g._plan = 2
    for _ in range(2):
        g.record(2, 2, 0.1)                                 # the plan's second step is steady: half the prior
    assert g.cost[0] == plain and g.cost[2] == 0.1
    np.testing.assert_allclose([g.cost[k] for k in (1, 3, 4)], prior[[1, 3, 4]] / 2)   # the priors, once
    g.record(2, 2, 0.12)                                    # from now on the plan's steps move every cost
    f = (1 - G.COST_EMA) + G.COST_EMA * 1.2
    assert g.cost[0] == pytest.approx(plain * f) and g.cost[1] == pytest.approx(prior[1] / 2 * f)

