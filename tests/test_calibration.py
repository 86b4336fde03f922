"""The speed gate's cost prior (decoding.calibration): measured through the decoder's own loop, cached by
what it depends on, and never a change to what the decoder outputs."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_gguf.native.engine import ContextOptions
from dflash_gguf.paths import DEMO_DIR as DEMO
from dflash_gguf.pair import OpenPair
from dflash_gguf.decoding import SpecOptions, calibration

PROMPT = b"def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Calibration files in a folder of this test's own; every measurement taken as steady (whether a
    busy machine's is kept: test_unsteady_costs_are_measured_again_and_never_kept)."""
    monkeypatch.setattr(calibration, "cache_file", lambda key: tmp_path / f"{key}.json")
    monkeypatch.setattr(calibration, "steady", lambda seen: True)
    return tmp_path


@pytest.fixture(scope="module")
def pair():
    with OpenPair(DEMO / "target.gguf", DEMO / "drafter.gguf", ContextOptions(n_ctx=1024, n_threads=2)) as p:
        yield p


def test_the_gate_starts_from_measured_costs_and_stays_lossless(pair, cache):
    dec = pair.decoder(SpecOptions(adaptive=True))
    files = list(cache.glob("*.json"))
    assert len(files) == 1, "the first gated decoder of a pair measures its costs and keeps them"
    costs = np.asarray(json.loads(files[0].read_text())["costs"])
    assert len(costs) == dec.n_draft + 1 and np.isfinite(costs).all() and (costs > 0).all()
    np.testing.assert_allclose(dec.gate.cost, costs)
    # a full block (drafter call + verify) costs more than a plain step. One measurement on a busy machine
    # can say otherwise (four timed plain steps of a tiny pair, two of them slowed, and the tidy pools every
    # drafting cost down to the plain one; steadiness is forced here): measured again, at most twice
    seen = [costs]
    while not seen[-1][-1] > seen[-1][0] and len(seen) < 3:
        seen.append(calibration.measure(dec, calibration.ROUNDS)[0])
    assert seen[-1][-1] > seen[-1][0], seen
    # only the drafter's acceptance is left to see: short probes, until one is right
    assert dec.gate._warmup_plan == (dec.gate.probe_len,) * dec.gate.WARMUP_GIVE_UP
    prompt = pair.target.tokenize(PROMPT)
    assert list(dec.generate(prompt, 96, stop_tokens=[])) == list(pair.plain().generate(prompt, 96, stop_tokens=[]))


def test_a_second_decoder_reads_the_costs_instead_of_measuring(pair, cache, monkeypatch):
    first = pair.decoder(SpecOptions(adaptive=True))

    def no_measure(decoder, rounds):
        raise AssertionError("measured again although the costs are cached")

    monkeypatch.setattr(calibration, "measure", no_measure)
    second = pair.decoder(SpecOptions(adaptive=True))
    np.testing.assert_array_equal(first.gate.cost, second.gate.cost)


def test_the_key_follows_the_kernel_switches_threads_and_block(pair, monkeypatch):
    dec = pair.decoder(SpecOptions(adaptive=False))
    key = calibration.cache_key(dec)
    monkeypatch.setenv("GGML_CPU_X86MM", "0")
    assert calibration.cache_key(dec) != key, "ggml's kernel switches change the costs"
    monkeypatch.delenv("GGML_CPU_X86MM")
    assert calibration.cache_key(dec) == key
    shorter = pair.decoder(SpecOptions(adaptive=False, n_draft=dec.n_draft - 2))
    assert calibration.cache_key(shorter) != key


def test_an_unreadable_cache_file_is_measured_again(pair, cache, caplog):
    dec = pair.decoder(SpecOptions(adaptive=False))
    f = calibration.cache_file(calibration.cache_key(dec))
    f.write_text("{not json")
    costs = calibration.step_costs(dec)
    assert len(costs) == dec.n_draft + 1 and "unreadable calibration file" in caplog.text
    assert json.loads(f.read_text())["costs"] == costs.tolist()   # replaced whole


def test_without_calibration_the_gate_warms_up_as_before(pair, cache):
    dec = pair.decoder(SpecOptions(adaptive=True, calibrate=False))
    assert not list(cache.glob("*.json")) and np.isnan(dec.gate.cost).all()


def test_a_context_too_small_for_the_schedule_gives_no_prior(cache, monkeypatch):
    """The gate then warms up as without calibration; nothing is cached, nothing raises. (llama.cpp
    rounds a context up to 256 cells: 40 rounds of the schedule do not fit in it.)"""
    monkeypatch.setattr(calibration, "ROUNDS", 40)
    with OpenPair(DEMO / "target.gguf", DEMO / "drafter.gguf", ContextOptions(n_ctx=256, n_threads=2)) as small:
        dec = small.decoder(SpecOptions(adaptive=True))
        assert np.isnan(dec.gate.cost).all() and not list(cache.glob("*.json"))
        prompt = small.target.tokenize(PROMPT)
        assert list(dec.generate(prompt, 20, stop_tokens=[])) == list(small.plain().generate(prompt, 20, stop_tokens=[]))


def test_the_schedule_covers_both_ends_and_the_powers_of_two():
    assert calibration.schedule_lengths(15) == [0, 1, 2, 4, 7, 8, 15]
    assert calibration.schedule_lengths(3) == [0, 1, 2, 3]
    assert calibration.schedule_lengths(1) == [0, 1]


def test_the_schedule_counts_settled_steps_only():
    """Each length is measured in runs whose first steps pay for the switch from the length before
    (plain steps settle slowest): only a run's last COUNTED steps count. A machine whose first step of a
    run costs 2x and plain's next three 1.3x gives the settled costs exactly."""
    lengths = calibration.schedule_lengths(7)
    sched = calibration._Schedule(lengths, rounds=2)
    base = {n: 1.0 + 0.5 * n for n in lengths}
    prev, k = None, 0
    while not sched.done:
        n = sched.choose()
        k = k + 1 if n == prev else 0
        prev = n
        slow = 2.0 if k == 0 else (1.3 if n == 0 and k < calibration.WARM[0] else 1.0)
        sched.record(n, 0, base[n] * slow)
    assert set(sched.seen) == set(lengths)
    for n, v in sched.seen.items():
        assert v == [base[n]] * (2 * calibration.COUNTED), (n, v)


def test_steady_rounds_are_those_that_agree():
    assert calibration.steady({0: [1.0, 1.1, 1.2], 1: [2.0, 2.1, 2.0], 4: [3.0, 3.2, 3.1]})
    # one length of three disturbed (a page fault, a collector pause): still steady
    assert calibration.steady({0: [1.0, 1.1, 1.2], 1: [2.0, 4.0, 2.0], 4: [3.0, 3.2, 3.1]})
    # two of three far apart: a busy machine
    assert not calibration.steady({0: [1.0, 1.1, 1.2], 1: [2.0, 4.0, 2.0], 4: [3.0, 9.0, 3.1]})


@pytest.mark.parametrize("second_steady", [True, False])
def test_unsteady_costs_are_measured_again_and_never_kept(pair, cache, monkeypatch, second_steady):
    """A calibration on a busy machine (rounds far apart) is measured again; if it is still unsteady
    the costs start this decoder's gate but are not cached, so a later decoder measures anew."""
    real = calibration.measure
    calls = []

    def measure(decoder, rounds):
        costs, _ = real(decoder, rounds)
        calls.append(costs)
        return costs, (second_steady and len(calls) == 2)

    monkeypatch.setattr(calibration, "measure", measure)
    dec = pair.decoder(SpecOptions(adaptive=True))
    assert len(calls) == 2
    np.testing.assert_allclose(dec.gate.cost, calls[-1])
    assert len(list(cache.glob("*.json"))) == (1 if second_steady else 0)


def _set_prior(cache, plain: float, drafting: float) -> np.ndarray:
    """Rewrite the one cached prior (its other fields kept): a plain step costs ``plain`` seconds, a
    drafting step of any length ``drafting`` (so much dearer that the gate decodes plainly)."""
    (f,) = cache.glob("*.json")
    data = json.loads(f.read_text())
    costs = np.full(len(data["costs"]), drafting)
    costs[0] = plain
    data["costs"] = costs.tolist()
    f.write_text(json.dumps(data))
    return costs


def test_a_prior_measured_busy_is_dropped_once_plain_steps_show_it(pair, cache, monkeypatch):
    """A cached prior whose plain step costs far more than this machine's plain steps (as one measured
    during a build) is marked stale after a generation whose gate decoded plainly, and the next decoder
    measures again; the output stays plain decoding's. A prior measured the second time that still reads
    too dear is rescaled to the plain steps the gate saw (the prior's shape kept), not measured again."""
    pair.decoder(SpecOptions(adaptive=True))
    prior = _set_prior(cache, 1.0, 100.0)        # a plain step of a second: no real one is that slow
    dec = pair.decoder(SpecOptions(adaptive=True))
    np.testing.assert_allclose(dec.gate.cost, prior)
    prompt = pair.target.tokenize(PROMPT)
    assert list(dec.generate(prompt, 96, stop_tokens=[])) == list(pair.plain().generate(prompt, 96, stop_tokens=[]))
    assert 0 not in dec.gate._prior and dec.gate.cost[0] < calibration.STALE * prior[0], dec.gate.cost
    (f,) = cache.glob("*.json")
    assert json.loads(f.read_text()).get("stale"), "the stale prior is still in use"
    measured = []
    real = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda d, r: measured.append(1) or real(d, r))
    again = pair.decoder(SpecOptions(adaptive=True))
    data = json.loads(f.read_text())
    assert measured and data["measured"] == 2 and not data.get("stale")
    np.testing.assert_allclose(again.gate.cost, data["costs"])
    # a prior measured a second time that reads dear again is rescaled, not measured by every decoder
    prior = _set_prior(cache, 1.0, 100.0)
    dec = pair.decoder(SpecOptions(adaptive=True))
    list(dec.generate(prompt, 96, stop_tokens=[]))
    assert calibration.prior_is_stale(prior, dec.gate)
    kept = np.asarray(json.loads(f.read_text())["costs"])
    np.testing.assert_allclose(kept, prior * dec.gate.cost[0] / prior[0])
    assert len(measured) == 1
    later = pair.decoder(SpecOptions(adaptive=True))
    np.testing.assert_allclose(later.gate.cost, kept)
    assert len(measured) == 1


def test_a_batch_sizes_gate_is_checked_against_its_share_of_the_prior():
    """A server's slots may decode several sequences together every step and never one alone: after each
    request the gates of every batch size are asked too, each against what the prior says its plain step
    costs a sequence (batch_costs: the batch's step shared out), not one sequence's plain step."""
    from dflash_gguf.decoding.batch_costs import batch_prior
    from dflash_gguf.decoding.gate import DraftLength
    from dflash_gguf.decoding.policy import DraftPolicy

    prior = np.array([1.0, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0, 2.1])
    share = batch_prior(prior, 2)[0]
    assert share < calibration.STALE * prior[0]          # a share of a step: one sequence's is no measure
    for f, stale in ((0.9, False), (0.6, True)):
        g = DraftLength(7, batch_prior(prior, 2))
        g.batch = 2
        for _ in range(DraftLength.SETTLE[0] + 2):
            g.record(0, 0, f * share)                    # settled plain steps of the batch, a sequence's share
        assert 0 not in g._prior and calibration.prior_is_stale(prior, g) is stale
    asked = []
    policy = DraftPolicy(7, gated=True, confident=False)
    policy.start_from(prior, lambda g: asked.append(g) or False)
    two = policy._batch_gate(2)
    policy.request_ended(None)
    assert two in asked and policy.gate in asked


def test_a_prior_cheaper_than_the_steps_is_kept(pair, cache):
    """Real steps costing more than the prior (longer contexts, a busier moment) leave it cached: only
    a prior too dear for this machine is a busy one."""
    pair.decoder(SpecOptions(adaptive=True))
    before = _set_prior(cache, 1e-7, 100.0)
    dec = pair.decoder(SpecOptions(adaptive=True))
    prompt = pair.target.tokenize(PROMPT)
    list(dec.generate(prompt, 96, stop_tokens=[]))
    assert 0 not in dec.gate._prior               # plain steps were measured ...
    (f,) = cache.glob("*.json")                   # ... and the prior stays
    np.testing.assert_allclose(json.loads(f.read_text())["costs"], before)
    assert not calibration.prior_is_stale(before, dec.gate)


def test_monotone_is_the_least_squares_non_decreasing_fit():
    from scipy.optimize import isotonic_regression

    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 16):
        for _ in range(50):
            v = rng.normal(size=n).cumsum() if rng.random() < 0.5 else rng.normal(size=n)
            np.testing.assert_allclose(calibration.monotone(v.tolist()), isotonic_regression(v).x, atol=1e-12)
    assert calibration.monotone([]).size == 0


def test_a_cached_prior_with_a_cheap_draft_is_tidied(pair, cache):
    """A prior whose one-token step costs more than longer ones (a noisy median), or a drafting step less
    than a plain one, is read as the closest prior without either: never a reason to draft."""
    dec = pair.decoder(SpecOptions(adaptive=False))
    n = dec.n_draft
    noisy = np.linspace(0.9, 2.0, n + 1)
    noisy[0], noisy[1], noisy[2] = 1.0, 2.2, 0.8          # one token dearer than n_max; two below plain
    calibration.cache_file(calibration.cache_key(dec)).write_text(json.dumps({"costs": noisy.tolist()}))
    costs = calibration.step_costs(dec)
    assert costs[0] == 1.0 and (np.diff(costs[1:]) >= 0).all() and (costs[1:] >= costs[0]).all()
    np.testing.assert_allclose(costs, calibration.tidy(noisy))
    assert costs[1] < noisy[1] and costs[2] > noisy[2]     # the outlier pooled with its neighbours
