"""GenerationStats (dflash_gguf.decoding.stats): its record round trip, merge and derived figures, exactly.
(tests/test_acceptance.py covers observe_step and merge's per-position counts.)"""
from __future__ import annotations

import pytest

from dflash_gguf.decoding.stats import PHASES, GenerationStats, acceptance_length

pytestmark = pytest.mark.pure


def filled() -> GenerationStats:
    s = GenerationStats(n_prompt=11, n_reused=3, n_generated=40, finish="length")
    s.observe_step(4, 3)
    s.observe_step(0, 0)
    s.observe_step(4, 1)
    s.t_prefill, s.t_draft, s.t_verify, s.t_inject, s.t_rollback, s.t_total = 0.25, 0.125, 0.5, 0.0625, 0.03125, 1.25
    return s


def test_a_record_round_trips_its_counts_and_times():
    s = filled()
    d = s.as_dict()
    assert d["passes"] == 3 and d["steps"] == 2 and d["drafted"] == 8 and d["accepted"] == 4
    assert d["n_prompt"] == 11 and d["n_reused"] == 3 and d["n_generated"] == 40 and d["finish"] == "length"
    assert d["time"] == {"prefill": 0.25, "draft": 0.125, "verify": 0.5, "inject": 0.0625, "rollback": 0.03125,
                         "python": 0.28125, "total": 1.25}
    assert d["per_position_acceptance"] == [1.0, 0.5, 0.5, 0.0]
    assert d["acceptance_length"] == 3.0 and d["tokens_per_second"] == 40.0
    back = GenerationStats.from_dict(d)
    for name in ("n_prompt", "n_reused", "n_generated", "steps", "passes", "drafted", "accepted",
                 *(f"t_{p}" for p in PHASES), "t_total"):
        assert getattr(back, name) == getattr(s, name), name
    assert GenerationStats.from_dict({}) == GenerationStats()


def test_derived_figures():
    s = filled()
    assert s.tau == acceptance_length(4, 2) == 3.0
    assert s.accept_rate == 0.5 and GenerationStats().accept_rate is None
    assert s.acceptance_rate_per_pos == [1.0, 0.5, 0.5, 0.0]
    assert s.t_python == pytest.approx(0.28125) and s.t_decode == 1.0 and s.tokens_per_second == 40.0
    over = GenerationStats(t_total=1.0, t_verify=2.0)
    assert over.t_python == 0.0                       # timer overlap never gives negative Python time
    assert GenerationStats(n_generated=5).tokens_per_second == 0.0
    assert GenerationStats(n_generated=5, t_total=1.0, t_prefill=1.0).tokens_per_second == 0.0
    assert set(s.phase_times()) == {*PHASES, "python"} and s.phase_times()["verify"] == 0.5


def test_merge_adds_counts_times_and_keeps_the_last_finish():
    a, b = filled(), filled()
    b.finish = None
    a.merge(b)
    assert (a.passes, a.steps, a.n_generated, a.t_total) == (6, 4, 80, 2.5)
    assert a.finish == "length"
    c = GenerationStats(finish="stop")
    a.merge(c)
    assert a.finish == "stop"


def test_a_record_rounds_as_documented():
    s = GenerationStats(n_generated=40, t_total=1.5, t_verify=0.12345678)
    s.observe_step(3, 1)
    s.observe_step(1, 1)                               # a one-token block is a drafting step too
    assert s.steps == 2 and s.passes == 2 and s.drafted_per_pos == [2, 1, 1]
    d = s.as_dict()
    assert d["tokens_per_second"] == 26.67             # 2 decimals
    assert d["per_position_acceptance"] == [1.0, 0.0, 0.0]
    s.observe_step(3, 0)
    assert s.as_dict()["per_position_acceptance"] == [0.6667, 0.0, 0.0]   # 4 decimals
    assert d["time"]["verify"] == 0.123457              # 6 decimals
