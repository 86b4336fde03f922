"""Prompt lookup's rules (decoding.ngram): what is copied, and when copying pays. No native library."""
from __future__ import annotations

import math
import random

import pytest

from dflash_gguf.decoding.ngram import NgramIndex, NgramOptions, Rates, StepCosts, best_length, find_candidate

pytestmark = pytest.mark.pure


def test_the_longest_suffix_found_wins_and_its_latest_occurrence():
    toks = [1, 2, 3, 9, 2, 3, 7, 8, 5, 3]
    # suffix (5, 3) never occurred; (3,) did, last at index 5: what followed it
    assert NgramIndex(2, 1, toks).propose(4) == [7, 8, 5, 3]
    toks = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    # (2, 3) occurred twice: the later one's continuation (5, 6, ...), not the first's (4, 9)
    assert NgramIndex(2, 1, toks).propose(3) == [5, 6, 1]
    # a 3-gram beats the 2-gram where it occurred: (1, 2, 3) last at 0..2
    assert NgramIndex(3, 1, toks).propose(3) == [4, 9, 2]


def test_no_match_no_self_match_and_short_continuations():
    assert NgramIndex(2, 1, [1, 2, 3]).propose(5) == []          # nothing repeats
    assert NgramIndex(2, 1, [4]).propose(5) == []                # the suffix itself is no occurrence
    assert NgramIndex(2, 1, [4, 4]).propose(5) == [4]            # what followed the first 4: the second
    assert NgramIndex(2, 2, [7, 1, 2, 7]).propose(5) == []       # min_ngram 2: (2, 7) never occurred before
    assert NgramIndex(2, 1, [1, 2, 1, 2]).propose(0) == []
    assert NgramIndex(2, 1, [5, 6, 7, 5, 6]).propose(10) == [7, 5, 6]   # what there is, fewer than asked


@pytest.mark.parametrize("max_ngram,min_ngram", [(1, 1), (2, 1), (3, 2), (4, 1)])
def test_the_index_grown_token_by_token_proposes_what_a_full_scan_finds(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    for _ in range(30):
        toks = [rng.randrange(5) for _ in range(rng.randrange(1, 60))]
        idx = NgramIndex(max_ngram, min_ngram, toks[:1])
        for i in range(1, len(toks)):
            idx.extend(toks[i:i + 1])
            for n in (1, 3, 10):
                assert idx.propose(n) == find_candidate(toks[:i + 1], max_ngram, n, min_ngram), (toks[:i + 1], n)
        fresh = NgramIndex(max_ngram, min_ngram)
        fresh.reset(toks)
        assert fresh.propose(7) == idx.propose(7)


def test_options_refuse_what_cannot_copy():
    assert (NgramOptions().max_ngram, NgramOptions().n_pred) == (2, 10)   # llama-cpp-python's defaults
    with pytest.raises(ValueError):
        NgramOptions(max_ngram=0)
    with pytest.raises(ValueError):
        NgramOptions(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        NgramOptions(n_pred=0)


def test_acceptance_rates_follow_what_was_kept():
    r = Rates(4)
    assert r.expected(4) == [1.0, 1.5, 1.75, 1.875, 1.9375]       # the prior: each position 0.5
    for _ in range(20):
        r.record(4, 4)                                           # whole copies kept
    right = r.expected(4)
    assert right[4] > 4.5 and right == sorted(right)
    w = Rates(4)
    for _ in range(20):
        w.record(4, 0)                                           # nothing kept
    assert w.expected(4)[1] < 1.1 and w.expected(4)[4] < 1.2
    assert r.expected(2) == right[:3]                           # a shorter match reads the same rates


def test_step_costs_read_between_and_past_the_measured_rows():
    c = StepCosts()
    assert math.isnan(c(1))
    c.record(1, 1.0)
    assert c(1) == 1.0 and c(11) == pytest.approx(1 + 10 * StepCosts.ROW)   # one count: the guess per row
    c.record(5, 3.0)
    assert c(3) == pytest.approx(2.0) and c(9) == pytest.approx(5.0)      # a line through the two
    c.record(5, 100.0)                                                     # an outlier moves it at most 2x
    assert c(5) == pytest.approx(0.8 * 3.0 + 0.2 * 6.0)


def test_best_length_copies_what_pays_and_measures_what_is_unknown():
    costs = [1.0 + 0.2 * k for k in range(6)]
    assert best_length([1.0, 1.9, 2.8, 3.6, 4.4, 5.2], costs) == 5           # copies mostly right: all of it
    assert best_length([1.0, 1.05, 1.06, 1.06, 1.06, 1.06], costs) == 0      # mostly wrong: plain decoding
    assert best_length([1.0, 1.5, 1.75], [1.0, math.nan, math.nan]) == 2     # not measured yet: the longest
    # no step measured at all (a decoder's first): the whole match
    assert best_length(Rates(3).expected(3), [StepCosts()(k + 1) for k in range(4)]) == 3
