"""A speed gate for the draft length: draft as many tokens per step as currently pays.

On a CPU the target's verify pass costs more with every row, and the drafter's cost grows with the
block too, so drafting the whole block is not always fastest (and drafting nothing, plain decoding,
wins when the drafter is rarely right). :class:`DraftLength` keeps decayed per-position acceptance
counts and the measured cost of a step for each draft length it has tried, fits a line through
those costs for the lengths it has not, and picks the length with the most expected tokens per
second: ``(1 + sum of P(accepted >= i) for i <= n)`` over ``cost(n)``. It only changes speed:
the decoder's output is the target's whatever length is drafted.
"""
from __future__ import annotations

import numpy as np


class DraftLength:
    WARMUP = (None, 0, None, 0, "half", None, 1, None)      # None = n_max
    WARMUP_GIVE_UP = 2                                       # drafted blocks with not one token right: warm-up ends
    PROBE_SHORT = 4                                          # tokens drafted by a probe while decoding plainly
    PROBE_EVERY = 24                                         # re-measure n_max and plain now and then ...
    PROBE_MAX = 96                                           # ... less often while the choice stays put
    REPLAN_EVERY = 8                                         # steps between re-evaluations of the choice
    DECAY = 0.97                                             # acceptance memory, per drafting step
    COST_EMA = 0.2

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.hits = np.zeros(n_max)                 # position i accepted (decayed count)
        self.tries = np.zeros(n_max)                # position i drafted (decayed count)
        self.cost = np.full(n_max + 1, np.nan)      # seconds of one step drafting n tokens
        self.steps = 0
        self.last = n_max
        self._plan: int | None = None
        self.probe_every = self.PROBE_EVERY
        self._next_probe = len(self.WARMUP) + self.PROBE_EVERY
        self._probes = 0
        self._warmup = len(self.WARMUP)
        self._blocks = 0                            # drafting steps so far
        self._right = 0                             # ... in which at least one token was accepted

    def _scheduled(self) -> int | None:
        if self.steps <= self._warmup and self._blocks >= self.WARMUP_GIVE_UP and not self._right:
            # a drafter that has not got one token right in its first blocks: the rest of the warm-up
            # (costs of other lengths) cannot change the choice, plain decoding; probes will look again
            self._warmup = self.steps - 1
            self._next_probe = self.steps + self.PROBE_EVERY
        if self.steps <= self._warmup:
            w = self.WARMUP[self.steps - 1]
        elif self.steps >= self._next_probe:
            # probe what the plan does not use: a short block while decoding plainly (is the drafter
            # right again?); while drafting, full blocks and plain decoding in turn
            self._probes += 1
            self._next_probe = self.steps + self.probe_every
            if not self._plan:
                return min(self.PROBE_SHORT, self.n_max)
            w = None if self._probes % 2 else 0
        else:
            return None
        if w is None:
            return self.n_max
        return max(1, self.n_max // 2) if w == "half" else min(int(w), self.n_max)

    def expected_tokens(self) -> np.ndarray:
        """Expected tokens per step for n = 0..n_max drafted tokens."""
        rate = np.divide(self.hits, self.tries, out=np.zeros_like(self.hits), where=self.tries > 0)
        return 1.0 + np.concatenate([[0.0], np.cumsum(rate)])

    def step_cost(self) -> np.ndarray:
        known = ~np.isnan(self.cost)
        ns = np.arange(self.n_max + 1)
        if known.sum() >= 2:   # least-squares line through the measured costs
            x, y = ns[known], self.cost[known]
            slope = float(np.cov(x, y, bias=True)[0, 1] / np.var(x))
            model = np.maximum(y.mean() + slope * (ns - x.mean()), 1e-9)
        else:
            model = np.full(self.n_max + 1, np.nanmax(self.cost) if known.any() else 1.0)
        return np.where(known, self.cost, model)

    def choose(self) -> int:
        self.steps += 1
        n = self._scheduled()
        if n is None:
            if self._plan is None or self.steps % self.REPLAN_EVERY == 0:
                plan = int(np.argmax(self.expected_tokens() / self.step_cost()))
                # a choice that survives re-measuring is probed less often (a never-right drafter then
                # costs one full block every PROBE_MAX steps); a change restarts frequent probing
                steady = plan == self._plan
                self.probe_every = min(self.probe_every * 2, self.PROBE_MAX) if steady else self.PROBE_EVERY
                self._plan = plan
            n = self._plan
        self.last = n
        return n

    def record(self, n: int, accepted: int, seconds: float) -> None:
        if n > 0 and self._plan == 0 and self.steps > self._warmup and 2 * accepted >= n:
            # a probe while decoding plainly found the drafter right: look again soon, re-plan now
            self._plan = None
            self._next_probe = self.steps + 2
        if n > 0:
            self._blocks += 1
            self._right += accepted > 0
            self.hits *= self.DECAY
            self.tries *= self.DECAY
            self.tries[:n] += 1
            self.hits[:accepted] += 1
        c = self.cost[n]
        self.cost[n] = seconds if np.isnan(c) else (1 - self.COST_EMA) * c + self.COST_EMA * seconds
