"""Verify lengths from a DSpark drafter's confidence head.

A DSpark drafter scores every token it drafts: ``c_i``, its estimate that the target accepts token
``i`` given that it accepted the ones before. A step that verifies ``k`` of a sequence's drafted tokens
decodes ``k + 1`` target rows and commits ``1 + (tokens accepted among the k)``, in expectation
``1 + sum_{j <= k} prod_{i <= j} p_i``. Rows the target will likely throw away cost as much as the
others: on a CPU a verify row costs a good fraction of a one-row decode. So each step, once the block
is drafted, the decoder verifies only the rows that pay: across the step's sequences, the allocation
of rows with the most expected tokens per second of the step's cost (:func:`allocate`).

A head's confidence may be miscalibrated for a given target and quantization, so the ``p_i`` are not
the raw scores but what the target actually accepted at such scores, learnt online
(:class:`Calibration`). Which rows are verified never changes the output, only the speed.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np


class Calibration:
    """Raw confidence -> the acceptance rate the target showed at that confidence.

    Decayed counts per confidence bin of drafted tokens the target judged (reached: every earlier
    drafted token accepted) and of those it accepted; a bin's rate leans on the raw score while it
    has few judged tokens, so a fresh head is taken at its word.
    """

    BINS = 20
    PRIOR = 4.0       # pseudo-judgements of the raw score in each bin
    DECAY = 0.998     # per judged token: the calibration follows a change of prompt or domain

    def __init__(self) -> None:
        self.tries = np.zeros(self.BINS)
        self.hits = np.zeros(self.BINS)

    def _bin(self, raw: np.ndarray) -> np.ndarray:
        return np.clip((np.asarray(raw, dtype=np.float64) * self.BINS).astype(np.int64), 0, self.BINS - 1)

    def rates(self, raw: np.ndarray) -> np.ndarray:
        """Calibrated acceptance rates of drafted tokens with these raw confidences."""
        raw = np.clip(np.asarray(raw, dtype=np.float64), 0.0, 1.0)
        b = self._bin(raw)
        return (self.hits[b] + self.PRIOR * raw) / (self.tries[b] + self.PRIOR)

    def observe(self, raw: np.ndarray, verified: int, accepted: int) -> None:
        """A step verified the first ``verified`` of tokens scored ``raw`` and the target accepted
        ``accepted`` of them: tokens 0..accepted-1 were kept, token ``accepted`` (if verified) was not,
        and those after it were never judged."""
        judged = min(accepted + 1, verified)
        if judged <= 0:
            return
        b = self._bin(np.asarray(raw)[:judged])
        f = self.DECAY ** judged
        self.tries *= f
        self.hits *= f
        np.add.at(self.tries, b, 1.0)
        np.add.at(self.hits, b[:accepted], 1.0)


def allocate(rates: Sequence[np.ndarray], cost: Callable[[int], float], floor: int = 1) -> list[int]:
    """Drafted tokens to verify for each sequence of a step: the counts whose expected committed tokens
    per second of the step's cost are the most.

    ``rates[s]``: sequence ``s``'s calibrated per-token acceptance rates (as many as it drafted);
    ``cost(rows)``: the step's cost for that many verified drafted tokens in all (the drafting done).
    Every sequence verifies at least ``floor`` of its tokens (where it drafted as many). A deeper token
    is worth the product of the rates up to it, which only falls along a sequence, so adding the
    best-valued next token of any sequence, while the rate of the whole step improves, finds the best
    allocation for a cost that grows with the rows (the marginal tokens' value falls as the cost rises).
    """
    counts = [min(floor, len(r)) for r in rates]
    reach = [np.cumprod(np.asarray(r, dtype=np.float64)) for r in rates]
    gain = 1.0 * len(rates) + sum(float(reach[s][:counts[s]].sum()) for s in range(len(rates)))
    rows = sum(counts)
    best = gain / cost(rows)
    while True:
        nxt = [(reach[s][counts[s]], s) for s in range(len(rates)) if counts[s] < len(reach[s])]
        if not nxt:
            return counts
        value, s = max(nxt)
        rate = (gain + value) / cost(rows + 1)
        if rate <= best:
            return counts
        counts[s] += 1
        gain += value
        rows += 1
        best = rate


def rows_cost(step_cost: np.ndarray, n_seqs: int) -> Callable[[int], float]:
    """A step's cost by the drafted tokens verified in all, from a gate's cost per drafting length of a
    step in which each of ``n_seqs`` sequences drafts that length (linear between lengths)."""
    c = np.asarray(step_cost, dtype=np.float64)
    lengths = np.arange(len(c)) * n_seqs

    def cost(rows: int) -> float:    # only steps that draft ask: lengths 1.. exist
        return float(np.interp(rows, lengths[1:], c[1:]))
    return cost
