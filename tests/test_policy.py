"""The draft policy through the one interface the decoder calls (plan a step, cut it by confidence, observe
what happened), on simulated steps whose cost grows with the rows verified as a CPU's does: properties
that survive retuning - what a never-right drafter costs over a long run, and that the confidence's cut
does at least as well as any fixed length and as the acceptance history alone."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dflash_gguf.decoding.policy import DraftPolicy
from dflash_gguf.decoding.sampling import SamplingParams

pytestmark = pytest.mark.pure

N = 8                                   # tokens a block drafts at most
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, seed=7)


def step_cost(lengths: list[int]) -> float:
    """A step of ``len(lengths)`` sequences drafting ``lengths`` tokens: one decode's worth, a row per
    verified token (a 16-row verify about 3x a one-row decode), and a drafter call when any drafts."""
    return 1.0 + 0.13 * (sum(lengths) + len(lengths)) + (0.35 if any(lengths) else 0.0)


def prior() -> np.ndarray:
    """One sequence's step costs as the calibration measures them."""
    return np.array([step_cost([n]) for n in range(N + 1)])


def slots(policy: DraftPolicy, b: int, sp: SamplingParams = GREEDY) -> list:
    """``b`` running requests as the policy sees them (the fields it reads of a decoder's slots)."""
    return [SimpleNamespace(slot=i, gate=policy.gate_for(sp), head=np.zeros(0, np.int32), cache=[], max_tokens=10**9,
                            produced=0, n_draft=N, features=SimpleNamespace(n=i), lattice=False, copy=None, copied=[],
                            chooser=SimpleNamespace(sp=sp)) for i in range(b)]


def run(policy: DraftPolicy, seqs: list, steps: int, right, scores=None) -> tuple[int, float]:
    """``steps`` steps of ``seqs``: ``right(step, seq)`` says how many of a block's tokens the target would
    keep, ``scores(step, seq)`` the drafter's confidence in each (None: it gives none). Tokens and seconds."""
    tokens, seconds = 0, 0.0
    conf = np.zeros((len(seqs), N), np.float32)
    for t in range(steps):
        plan = policy.plan(seqs, 10**9, False)
        drafted = list(plan.lengths)
        if scores is not None:
            for s in seqs:
                conf[s.slot] = scores(t, s.slot)
            policy.verify_rows(seqs, plan, conf, False)
        done = []
        for s, n, d in zip(seqs, plan.lengths, drafted):
            a = min(right(t, s.slot), n)
            if scores is not None and d:
                policy.observe_scores(s, conf[s.slot, :d], n, a)
            tokens += a + 1
            done.append((s, SimpleNamespace(head=0, n=n, accepted=a, copied=False, proposed=d)))
        dt = step_cost(plan.lengths)
        seconds += dt
        policy.observe(done, plan, dt)
    return tokens, seconds


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("with_prior", [True, False], ids=["calibrated", "no-prior"])
def test_a_never_right_drafter_costs_at_most_five_percent_over_plain_decoding(b, with_prior):
    """Over a long run (2,000 steps) a drafter that is never right costs at most 5% more than decoding
    plainly: the policy stops drafting and only probes, within their budget, whether it is right again."""
    policy = DraftPolicy(N, gated=True, confident=False)
    if with_prior:
        policy.start_from(prior())
    tokens, seconds = run(policy, slots(policy, b), 2000, lambda t, i: 0)
    plain = 2000 * step_cost([0] * b)
    assert tokens >= 2000 * b
    assert seconds <= 1.05 * plain, seconds / plain


def test_an_always_right_drafter_drafts_whole_blocks():
    """A drafter that is always right: nearly every step drafts the whole block."""
    policy = DraftPolicy(N, gated=True, confident=False)
    policy.start_from(prior())
    tokens, _ = run(policy, slots(policy, 1), 400, lambda t, i: N)
    assert tokens >= 0.95 * 400 * (N + 1)


def _varying_trace(skew: float, steps: int = 3000, seed: int = 1):
    """Per step, the tokens of a block the target keeps and the drafter's confidence in each: easy and hard
    stretches of text, scored as the true rate ** skew (1: calibrated; below, underconfident)."""
    rng = np.random.default_rng(seed)
    right, scores = [], []
    for _ in range(steps):
        p = np.clip(rng.beta(2, 2) + rng.normal(0, 0.05, N), 0.02, 0.98) * np.linspace(1, 0.8, N)
        would = 0
        while would < N and rng.random() < p[would]:
            would += 1
        right.append(would)
        scores.append((p ** skew).astype(np.float32))
    return right, scores


@pytest.mark.parametrize("skew", [0.6, 1.0, 1.6], ids=["underconfident", "calibrated", "overconfident"])
def test_confidence_does_at_least_as_well_as_every_fixed_length_and_the_history_alone(skew):
    """A DSpark-like drafter on a trace with varying acceptance: the policy with the drafter's confidence
    (calibrated online, whatever the head's skew) gives at least the tokens per second of the best fixed
    length (known only after the fact) and of the acceptance history alone."""
    right, scores = _varying_trace(skew)
    steps = len(right)

    def speed(policy, with_scores):
        t, s = run(policy, slots(policy, 1), steps, lambda t, i: right[t],
                   (lambda t, i: scores[t]) if with_scores else None)
        return t / s

    confident = DraftPolicy(N, gated=True, confident=True)
    confident.start_from(prior())
    history_only = DraftPolicy(N, gated=True, confident=False)
    history_only.start_from(prior())
    fixed = max(speed(DraftPolicy(N, gated=False, confident=False), False) if k == N else
                sum(1 + min(r, k) for r in right) / (steps * step_cost([k])) for k in range(N + 1))
    ours, history = speed(confident, True), speed(history_only, False)
    assert ours >= fixed, (ours, fixed)
    assert ours >= history, (ours, history)


def test_sampled_requests_have_a_gate_of_their_own_seeded_or_not():
    """Sampled requests (seeded ones too: their text does not depend on what is drafted) are gated with an
    acceptance history of their own (a sampled token is kept less often than a greedy one); without the
    gate every request drafts fixed blocks."""
    policy = DraftPolicy(N, gated=True, confident=False)
    assert policy.gate_for(GREEDY) is policy.gate
    assert policy.gate_for(SEEDED) is policy.gate_for(SamplingParams(temperature=0.8)) is policy.gate_sampled
    assert policy.gate_sampled is not policy.gate
    fixed = DraftPolicy(N, gated=False, confident=False)
    assert fixed.gate_for(GREEDY) is None and fixed.gate_for(SEEDED) is None


def test_a_batch_probe_drafts_for_one_sequence_and_within_each_context():
    """While a batch decodes plainly, an acceptance probe drafts for one sequence only (the one with the
    fewest rows kept to inject), and no plan drafts past a sequence's max_tokens or its context."""
    policy = DraftPolicy(N, gated=True, confident=False)
    policy.start_from(prior())
    seqs = slots(policy, 4)
    seqs[2].max_tokens, seqs[2].produced = 10, 7      # two tokens to go: drafts one at most
    probes = 0
    for _ in range(400):
        plan = policy.plan(seqs, 10**9, False)
        assert plan.lengths[2] <= 2
        if plan.gate is not None and plan.gate.probing and any(plan.lengths):
            probes += 1
            assert sum(1 for n in plan.lengths if n) == 1, plan.lengths
            assert plan.lengths[0] > 0, "the sequence with the fewest kept rows is probed"
        policy.observe([(s, SimpleNamespace(head=0, n=n, accepted=0, copied=False, proposed=n))
                        for s, n in zip(seqs, plan.lengths)], plan, step_cost(plan.lengths))
    assert probes > 0
    short = slots(policy, 1)
    short[0].cache = [0] * 95
    assert max(policy.plan(short, 100, False).lengths) <= 4


def test_a_cut_block_counts_its_verified_tokens_and_not_its_cost():
    """A block cut before the verify drafted more than it verified: only the verified tokens count as tried,
    and the step, a longer draft with a shorter verify, is no step of either length, so no length's cost
    moves (recorded as a short block's, an 8-token draft verified to one row made short lengths look dear).
    A block verified whole is an ordinary step of its length."""
    policy = DraftPolicy(N, gated=True, confident=True)
    policy.start_from(prior())
    (s,) = slots(policy, 1)
    g = policy.gate
    g.start_from(np.full(N, 9.0), np.full(N, 10.0))      # a drafter right nine times in ten: no warm-up
    g._plan = N                                           # whole blocks
    costs, tries = list(g.cost), g.tries.copy()
    plan = policy.plan([s], 10**9, False)
    assert plan.lengths == [N] and not g.scheduled
    streak = g._streak
    policy.observe([(s, SimpleNamespace(head=0, n=2, accepted=2, copied=False, proposed=N))], plan, 0.01)
    assert g.cost == costs, "a cut step moved a cost"
    np.testing.assert_allclose(g.tries, g.DECAY * tries + np.r_[1, 1, np.zeros(N - 2)])   # 2 verified, both kept
    assert g._run == N and g._streak == streak + 1        # a step of the run of whole blocks
    plan = policy.plan([s], 10**9, False)
    policy.observe([(s, SimpleNamespace(head=0, n=N, accepted=3, copied=False, proposed=N))], plan, 2 * costs[N])
    assert g.cost[N] > costs[N]                           # an uncut block is a step of its length


def test_the_gates_scheduled_steps_are_not_cut():
    """Warm-up steps and probes measure whole lengths (their cost, how deep the drafter is right): the
    confidence leaves them whole; the plan's steps it cuts."""
    policy = DraftPolicy(N, gated=True, confident=True)
    policy.start_from(prior())
    (s,) = slots(policy, 1)
    low = np.full((1, N), 0.01, np.float32)               # confident in nothing
    g = policy.gate
    g.start_from(np.full(N, 9.0), np.full(N, 10.0))      # no warm-up
    g._plan, g._again = 2, N                              # a middle plan's whole-block probe, its second step
    plan = policy.plan([s], 10**9, False)
    assert g.scheduled and plan.lengths == [N]
    policy.verify_rows([s], plan, low, False)
    assert plan.lengths == [N]
    g._plan = N                                           # whole blocks planned
    plan = policy.plan([s], 10**9, False)
    assert not policy.gate.scheduled and plan.lengths == [N]
    policy.verify_rows([s], plan, low, False)
    assert plan.lengths[0] < N
