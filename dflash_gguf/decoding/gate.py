"""A speed gate for the draft length: draft as many tokens per step as currently pays.

On a CPU the target's verify pass costs more with every row, and the drafter's cost grows with the
block too, so drafting the whole block is not always fastest (and drafting nothing, plain decoding,
wins when the drafter is rarely right). :class:`DraftLength` keeps decayed per-position counts of
how often position i was reached (every earlier drafted token accepted) and accepted, and the
measured cost of a step for each draft length it has tried; it fits a line through the drafting
steps' costs for the lengths it has not, and picks the length with the most expected tokens per
second: ``(1 + sum of P(accepted >= i) for i <= n)`` over ``cost(n)``, where P(accepted >= i) is
the product of the per-position conditional rates. A position seldom reached (deep in the block,
while shorter blocks or short probes are drafted) leans on the estimate of the position before it
instead of on a few old draws, so an unlucky warm-up block cannot pin the choice to short blocks or
to plain decoding. Near a tie (within ``PREFER_FULL``) it drafts the whole block, whose cost is
measured rather than read off the fitted line. From plain decoding it drafts only where that pays for
the way back as well (the slow plain steps after a drafting one, over the steps a plan runs at least).
While decoding plainly it probes the drafter now and then, at most a share of plain decoding's time;
probes that find nothing right, or a drafter right and still dearer than plain decoding, again and
again, take ever less of it (down to an eighth).
A step's cost is its whole work as the decoder measures it (drafting, verifying, acceptance and
sampling, keeping the rows), so per-step overheads that do not scale with the model count on small
pairs. Costs are those of a length drafted step after step, as a plan runs it: the first step of a
length after another (or after a prefill) pays for the switch (the other model's weights and buffers
in the caches: on a small pair the first plain step after a drafting one costs about twice what
settled ones do) and only sets a cost not known yet;
probes that re-measure a cost take two steps, and may lower it, not raise it. A settled step of the
plan that moves its cost moves every other length's by the same factor (the machine got busier or
quieter for all of them): only steps of another length change how the lengths compare. It only
changes speed: the decoder's output is the target's whatever length is drafted. Given this machine's
measured step costs as a prior (:mod:`dflash_gguf.decoding.calibration`) it skips the warm-up that
measures them.
"""
from __future__ import annotations

import math

import numpy as np


class DraftLength:
    WARMUP = (None, None, 0, 0, "half", None)               # None = n_max; costs of n_max and 0 (each a run of
                                                             # two: the second step's is steady), half
    WARMUP_GIVE_UP = 2                                       # drafted blocks with not one token right: warm-up ends
    PROBE_SHORT = 4                                          # tokens drafted by a probe while decoding plainly (at most)
    PROBE_FREE = 0.1                                         # ... with a cost prior: the longest probe costing at most
                                                             #     this x a plain step more than drafting one token
    PROBE_BUDGET = 0.025                                     # probes of a never-right drafter (or of one plain decoding
                                                             #     keeps beating, past PROBE_MAX): at most this share of
                                                             #     plain decoding's time (sets the gap between them)
    PROBE_LONGEST = 1.0                                      # ... and at most this many seconds of it apart (where
                                                             #     that is more than 4 PROBE_MAX steps, see _probe_gap)
    FRUITLESS = 3                                            # probes in a row with nothing right halve that share,
                                                             #     each, past the first, this many times at most
    UNPAID = 2                                               # ... as do right ones after which plain decoding won,
                                                             #     each past this many (the demo pair on 2 Zen 4 cores:
                                                             #     probes took 3-6% of its time)
    PROBE_TAIL = 32                                          # plain steps after a probe that run slow (the drafter
                                                             # pushed the target out of the caches): their excess is
                                                             # the probe's cost too (the demo pair on Zen 4: 1.6 /
                                                             # 3.2 ms over 10 / 60 steps of 0.4 ms, probe step 3 ms)
    PROBE_EVERY = 24                                         # re-measure n_max and plain now and then ...
    PROBE_SOON = 4                                           # ... sooner after leaving a drafter that
    DIP = 1.5                                                #     still gets this many tokens per step
    PROBE_MAX = 96                                           # ... less often while the choice stays put
    HOPE = 0.1                                               # drafting that could not beat plain decoding by this
                                                             # much with every token right: probed as a never-right
                                                             # drafter is (its dips are no reason to look soon)
    REPLAN_EVERY = 8                                         # steps between re-evaluations of the choice
    FEW_DRAWS = 4                                            # ... or the next step, after a block with nothing right
                                                             #     while fewer blocks than this reached position 1
    DECAY = 0.97                                             # acceptance memory, per drafting step
    PRIOR = 2.0                                              # pseudo-draws of the previous position's rate
    NEUTRAL = 0.5                                            # ... and, for position 1, of this rate (from above
                                                             # only): one right draw is not a drafter always right
    COST_EMA = 0.2
    OUTLIER = 2.0                                            # a step costing more than this x its estimate counts as this
    SETTLE = {0: 12}                                         # steps of one length before its cost may rise (default 1):
                                                             # plain steps settle over about ten after a drafting
                                                             # step or a prefill (the drafter's runs push a small
                                                             # target out of the caches); a drafting block after one
    SWITCHES = 3                                             # steps of the plan in a row, each a run's first (batch
                                                             # sizes that come and go): from the SWITCHES-th on,
                                                             # their costs count (they are what this plan costs)
    PLAIN_DOUBT = 0.7                                        # a plain step's prior may be this much too dear (taken
                                                             # on a busy machine; calibration.STALE is this): a drafting
                                                             # plan that beats it by less measures plain soon
    PREFER_FULL = 0.03                                       # the whole block unless another length is this much faster

    def __init__(self, n_max: int, costs: np.ndarray | None = None):
        """``costs``: a prior for the seconds of a step drafting n = 0..n_max tokens on this machine
        (:mod:`dflash_gguf.decoding.calibration`). With it the warm-up is short probes until one
        is right, at most WARMUP_GIVE_UP (the drafter's acceptance is all there is left to see, and a
        drafter that is never right then costs two short blocks, as long as rows stay nearly free,
        instead of full ones), and probes while decoding plainly are spaced to cost at most
        PROBE_BUDGET; without it the warm-up measures costs too."""
        self.n_max = n_max
        self.hits = np.zeros(n_max)                 # position i accepted (decayed count)
        self.tries = np.zeros(n_max)                # position i reached: drafted, all before it accepted
        # seconds of one step drafting n tokens (a list of Python floats: record() updates it every step,
        # also while decoding plainly, where a small pair's step is a few hundred microseconds and numpy's
        # per-call cost, with the caches cold after the target's decode, came to 3 us of the gate's 7)
        self.cost: list[float] = [math.nan] * (n_max + 1)
        self._prior: set[int] = set()               # lengths whose cost is no steady step's yet (the prior's,
                                                    # or a step after another length)
        if costs is not None:
            if len(costs) != n_max + 1:
                raise ValueError(f"a cost prior needs {n_max + 1} entries (n = 0..{n_max}), got {len(costs)}")
            self.cost = [float(c) for c in costs]
            self._prior = set(range(n_max + 1))
        self.steps = 0
        self._plan: int | None = None
        self._probe_seen = math.nan                 # what probes while decoding plainly cost (seconds, EMA) ...
        self._probe_after = 0                       # ... with the PROBE_TAIL plain steps after one (how many
        self._probe_after_w = 1.0                   #     are left, the probe's weight in that EMA and the
        self._probe_tail = 0.0                      #     excess over a plain step they have added so far)
        self._tail_seen = math.nan                  # ... that excess alone (EMA): what going back to plain
                                                    #     decoding after drafting costs
        self._learned = False                       # acceptance taken from a gate that drew it many times
        self._few = False                           # ... taken from one that drew it fewer times: no drafting
                                                    #     plan while this gate has fewer than FEW_DRAWS draws
        self._fruitless = 0                         # acceptance probes in a row while decoding plainly with
                                                    #     nothing right (each one past the first halves their share)
        self._unpaid = 0                            # ... and right ones in a row after which plain decoding won
        self._probe_right = False                   #     (the last probe's, counted at the next re-planning)
        self.probe_len = self._probe_length()
        self.probe_every = self._probe_gap()
        # with a prior: probes until one is right, at most WARMUP_GIVE_UP (a good drafter's first probe can
        # miss: the demo profile's first token is right 78% of the time, so one probe alone sent 22% of
        # fresh gates to plain decoding for their first ~25 steps)
        self._warmup_plan = self.WARMUP if costs is None else (self.probe_len,) * self.WARMUP_GIVE_UP
        self._prior_warmup = costs is not None
        self._warmup = len(self._warmup_plan)
        self._next_probe = self._warmup + self.probe_every
        self._probe_full = False                    # a middle plan's next probe: the whole block (else plain)
        self._blocks = 0                            # drafting steps so far
        self._right = False                         # ... whether one of them got a token accepted
        self._again: int | None = None              # a cost-measuring probe's second step
        self._replan_due = False                    # a re-planning step was taken by a probe
        self._recheck = False                       # a block of the plan got nothing accepted: re-plan next step
        self.probing = False                        # the last choice was an acceptance probe (is the drafter
                                                    # right?), not a length the plan or a cost probe drafts
        self.scheduled = False                      # the last choice was the schedule's (a warm-up step, an
                                                    # acceptance or a cost probe), not the plan's
        self._plain_checked = False                 # a plain probe's second step did not lower plain's prior
        self.batch = 1                              # the sequences of the steps this gate chooses for (a batch
                                                    # size's gate: DraftPolicy sets it)
        self._cost_probed = False                   # ... whose whole batch drafted to measure its prior (once)
        self._probe_step = -1                       # the last step that was a cost probe's second
        self._run: int | None = None                # the length of the last step recorded (None: a new run)
        self._streak = 0                            # ... and how many steps of it in a row
        self._switches = 0                          # steps of the plan in a row that were each a run's first
        # the last evaluation (_evaluate()'s answer), dropped by whatever may change the plan: acceptance,
        # and a cost that moves against the others (the plan's own steps scale them all, which leaves
        # the choice as it is)
        self._evaluated: tuple[int, bool, bool] | None = None

    def _scheduled(self) -> int | None:
        if self._again is not None:
            n, self._again = self._again, None
            self._probe_step = self.steps
            return n
        if self.steps <= self._warmup and self._blocks >= self.WARMUP_GIVE_UP and not self._right:
            # a drafter that has not got one token right in its first blocks: the rest of the warm-up
            # (costs of other lengths) cannot change the choice, plain decoding; probes will look again
            self._warmup = self.steps - 1
            self._next_probe = self.steps + self._probe_gap()
        if self.steps <= self._warmup and self._right and self._prior_warmup:
            self._warmup = self.steps - 1       # a probe was right: the costs are known, the plan can start
        if self.steps <= self._warmup:
            w = self._warmup_plan[self.steps - 1]
            self.probing = self._prior_warmup      # with a prior the warm-up only asks for acceptance
        elif self._plan == 0 and self._batch_prior_unchecked():
            # plain decoding planned on a batch size's drafting costs as its prior says them, scaled from one
            # sequence's (at the 1.7B Q4_0 shape on AVX2 about 1.5x what two sequences' drafting steps cost:
            # drafting looked futile and 2-token blocks, 1.26x plain, never ran): the whole batch drafts a
            # short block twice, the second step's cost replacing the prior's and moving the other lengths'
            self._cost_probed = True
            self._again = self.probe_len
            return self.probe_len
        elif self.steps >= self._next_probe:
            # probe what the plan does not use: a short block while decoding plainly (is the drafter
            # right again?), a full block while drafting shorter ones, plain decoding while drafting
            # full blocks
            self._next_probe = self.steps + self.probe_every
            if not self._plan:
                self.probing = True
                # acceptance: one step (its cost is the prior's or a warm-up's); the whole block while its deep
                # positions are unknown and the first one looks right (_explore_deep)
                return self.n_max if self._explore_deep() else self.probe_len
            if self._plan == self.n_max:
                self._again = 0            # costs: two steps, the second one's is the steady cost
                return 0
            # a middle length re-measures both ends in turn (its own cost is measured every step)
            self._probe_full = not self._probe_full
            self._again = self.n_max if self._probe_full else 0
            return self._again
        else:
            return None
        if w is None:
            return self.n_max
        return max(1, self.n_max // 2) if w == "half" else min(int(w), self.n_max)

    def _batch_prior_unchecked(self) -> bool:
        """Whether this batch size's gate plans on its drafting costs' prior alone while the drafter has got
        tokens right: no step of its whole batch drafting has been measured (nor a cost probe run)."""
        return self.batch > 1 and self._right and not self._cost_probed and self.probe_len in self._prior

    def _explore_deep(self) -> bool:
        """Whether a probe while decoding plainly drafts the whole block, not a short one: where whole
        blocks could beat plain decoding by HOPE with every token right and a probe's short block could not
        (then only the deep positions can make drafting pay), the drafter's first token is right at least
        half the time (decayed counts), and a position the estimate says is reached at least half the time
        has fewer than FEW_DRAWS draws. Short probes draw only the first positions, and the estimate carries
        their rate to the deep ones as a product of like rates (a geometric fall), where a good drafter's
        deep tokens, once the first ones are right, are right more often still: on a target so small that
        only long blocks pay (the demo pair quantized to Q8_0 on a Zen 4: its 7-token blocks accept 4.3 a
        step, the estimate from a generation's first blocks and 1-token probes said 2.7), plain decoding
        then won for good on an underestimate. A drafter right on its first token only is not probed so
        for long: its second position's draws soon say the rest is seldom reached."""
        t1 = float(self.tries[0])
        if self.n_max <= self.probe_len or t1 <= 0 or 2 * float(self.hits[0]) < t1:
            return False
        c = self.step_cost()
        if (self.probe_len + 1) / c[self.probe_len] > (1 + self.HOPE) / c[0]:
            return False      # short blocks could pay: the short probes' own positions decide (where rows are cheap)
        e = self.expected_tokens()
        for i in range(1, self.n_max):
            if self.tries[i] < self.FEW_DRAWS:
                if e[i] - e[i - 1] < 0.5:      # position i + 1 is reached this seldom: what lies past it hardly counts
                    return False
                return bool((self.n_max + 1) / c[self.n_max] > (1 + self.HOPE) / c[0])
        return False

    def _probe_length(self) -> int:
        """Tokens a probe drafts: PROBE_SHORT, or with known costs the longest probe up to it whose
        extra rows are nearly free (a probe of a drafter that is never right costs its whole step
        beyond a plain one; the rows past the first only add draws of deeper positions)."""
        short = min(self.PROBE_SHORT, self.n_max)
        c = self.cost
        if any(x != x for x in c):     # nan, no prior: the warm-up measures the costs
            return short
        return max(n for n in range(1, short + 1) if c[n] <= c[1] + self.PROBE_FREE * c[0])

    def _probe_gap(self) -> int:
        """Steps between probes while decoding plainly: PROBE_EVERY, or more where a probe costs so
        much more than a plain step (a drafter call that costs more than the target's decode) that
        probing every PROBE_EVERY steps would cost a never-right drafter over PROBE_BUDGET. A probe
        costs what its steps took, where that is more than the cost of a settled step of its length:
        it also injects the features kept while decoding plainly and follows a plain step (on the
        demo pair about 3 ms where a settled 1-token step costs 1.9 ms and a plain one 0.55)."""
        c0, step, seen = self.cost[0], self.cost[self.probe_len], self._probe_seen
        cp = seen if step != step else max(step, seen)    # max(step, nan) is step; nan where both are
        if not (c0 > 0 and math.isfinite(cp)):   # unknown yet (nan)
            return self.PROBE_EVERY
        # a drafter that probe after probe gets nothing right is less and less likely to come right: each
        # fruitless probe past the first halves the share (a never-right drafter's 0.6B-shaped pair cost its
        # one-slot server 3-4% at the whole budget, against a plain server), down to an eighth. So does each
        # right probe past UNPAID after which plain decoding still won: what a next one can find is a drafter
        # much better than the draws so far say, less and less likely too (not from the first: a gate that
        # underrates a good drafter's deep positions learns better from the probes' draws)
        halvings = max(self._fruitless - 1, self._unpaid - self.UNPAID, 0)
        budget = self.PROBE_BUDGET / 2 ** min(halvings, self.FRUITLESS)
        need = math.ceil(max(cp - c0, 0.0) / (budget * c0))
        # at most 4 PROBE_MAX steps or PROBE_LONGEST seconds of plain decoding, whichever is longer: a
        # tiny pair's probe costs about 25 plain steps all told (the demo pair on AMD Zen 4: a 96-token
        # call with one 10 ms longer than one without), so 4 PROBE_MAX steps (0.15 s of its decoding)
        # would spend 6.5% of the time on probes
        return int(min(max(need, self.PROBE_EVERY), self._longest_gap()))

    def _middle_probe_gap(self, plan: int) -> int:
        """Steps between a middle plan's probes: each is a pair of whole blocks or of plain steps, in turn.
        A whole block loses what it costs over the plan's time for the tokens it is expected to commit
        (cost(n_max) - tokens(n_max) x cost(plan) / tokens(plan)); a pair of them every other probe is that
        loss a probe, spaced so that it takes at most PROBE_BUDGET of the plan's time, at most
        ``_longest_gap()`` apart. Where whole blocks nearly keep up with the plan, PROBE_EVERY and its
        doubling decide, as before; where they are dear (AVX2 without VNNI, the 1.7B Q4_0 shape: a whole
        block 0.37 s for about 4 tokens, a 1-token block 0.055 s for 1.8) pairs every 24-96 steps of the
        plan took 12-50% of its time. (A loss of 0 or less, as the whole block's own plan has, leaves the
        caller's gap as it is.)"""
        c, e = self.step_cost(), self.expected_tokens()        # costs are never 0 (see step_cost)
        loss = float(c[self.n_max] - e[self.n_max] * c[plan] / e[plan])
        return int(min(math.ceil(loss / (self.PROBE_BUDGET * c[plan])), self._longest_gap()))

    def _longest_gap(self) -> int:
        """The most steps between probes while decoding plainly: 4 PROBE_MAX, or PROBE_LONGEST seconds of
        plain decoding where that is more."""
        c0 = self.cost[0]
        return max(4 * self.PROBE_MAX, int(self.PROBE_LONGEST / c0)) if c0 > 0 else 4 * self.PROBE_MAX

    def _could_pay(self, c: np.ndarray | None = None) -> bool:
        """Whether drafting could beat plain decoding by HOPE if every drafted token were right (``c``:
        the step costs, when known already)."""
        c = self.step_cost() if c is None else c
        c = np.asarray(c, dtype=float)   # a measured cost is never 0 (numpy: x / 0 would be inf, not an error)
        best = max((n + 1) / c[n] for n in range(1, self.n_max + 1))
        return bool(best > (1 + self.HOPE) / c[0])

    def expected_tokens(self) -> np.ndarray:
        """Expected tokens per step for n = 0..n_max drafted tokens."""
        # Python floats: re-planning runs every REPLAN_EVERY steps, also while decoding plainly, where a
        # step of a small pair is a few hundred microseconds and numpy's per-call cost would show
        hits, tries = self.hits.tolist(), self.tries.tolist()
        reached = sum(tries)
        # position 1 leans on the pooled rate of every position, drawn down towards NEUTRAL by PRIOR
        # pseudo-draws (never up: a drafter with nothing right yet is not made a half-right one): from one
        # right probe the bare pooled rate was 1.0, every position after leaned on it, and the plan drafted
        # whole blocks on one draw - where a block's rows are dear (AVX2 without VNNI: a 16-row verify of
        # the 1.7B Q4_0 shape 8.7x a one-row decode) each four to six times as long as a plain step, for
        # tokens a 1-token block got as cheaply. Many draws hardly move.
        if reached > 0:
            pooled = sum(hits) / reached
            prior = min(pooled, (sum(hits) + self.PRIOR * self.NEUTRAL) / (reached + self.PRIOR))
        else:
            prior = 0.0
        out, p, total = [1.0], 1.0, 1.0
        for h, t in zip(hits, tries):        # position i + 1 leans on position i's estimate
            prior = (h + self.PRIOR * prior) / (t + self.PRIOR)
            p *= prior
            total += p
            out.append(total)
        return np.array(out)

    def _plain_could_win(self, plan: int) -> bool:
        """Whether plain decoding would beat ``plan`` if a plain step cost PLAIN_DOUBT x its estimate."""
        e, c = self.expected_tokens(), self.step_cost()
        return bool(e[plan] / c[plan] < e[0] / (self.PLAIN_DOUBT * c[0]))

    def _plain_on_prior(self) -> bool:
        """Whether plain decoding's cost is still a prior's (or a switch's) word: no steady plain step
        replaced it and no plain probe checked it."""
        return 0 in self._prior and not self._plain_checked

    def step_cost(self) -> np.ndarray:
        """Seconds per step for n = 0..n_max: measured where known, else a line through the measured
        drafting steps (n >= 1). A plain step (n = 0) has no drafter call, so it stays out of the fit:
        the drafter's cost is a step at n = 1, not a slope."""
        cost = [float(c) for c in self.cost]
        known = [i for i, c in enumerate(cost) if c == c]      # not nan
        fit = [i for i in known if i >= 1]
        if len(fit) < 2:
            fit = known
        if len(fit) >= 2:   # least-squares line
            xm = sum(fit) / len(fit)
            ym = sum(cost[i] for i in fit) / len(fit)
            sxy = sum((i - xm) * (cost[i] - ym) for i in fit)
            sxx = sum((i - xm) ** 2 for i in fit)
            slope = max(sxy / sxx, 0.0)
            model = [max(ym + slope * (i - xm), 1e-9) for i in range(self.n_max + 1)]
        else:
            model = [max(cost[i] for i in known) if known else 1.0] * (self.n_max + 1)
        out = [c if c == c else m for c, m in zip(cost, model)]
        if self._plain_on_prior():
            # plain decoding on the prior's word costs at most what a measured drafting step does (that step
            # does a plain step's work and more): a prior taken while the machine was busy rated plain steps
            # 18.9 ms and 1-token blocks 27.7, the blocks then measured 18.6, and a plan that drafts never
            # runs a plain step to find out (a never-right drafter's 1-token blocks, 0.62x plain, 0.6B Q4_0
            # shape on an AVX2 Zen 4; plain steps cost 14 ms)
            seen = [cost[i] for i in range(1, len(cost)) if cost[i] == cost[i] and i not in self._prior]
            if seen:
                out[0] = min(out[0], min(seen))
        # and no drafting step costs less than a plain one: the plan's own steps scale every cost by one
        # factor, so a block measured against that busy prior (18.6 ms against 18.9) stayed under plain's
        # cost when plain steps then measured 14 ms and scaled it to 13.8
        return np.array([out[0]] + [max(c, out[0]) for c in out[1:]])

    def choose(self) -> int:
        self.steps += 1
        self.probing = False
        n = self._scheduled()
        self.scheduled = n is not None
        due = self.steps % self.REPLAN_EVERY == 0
        if n is not None:
            # a probe or warm-up step on a re-planning step: re-plan on the next step of the plan (probes
            # every PROBE_SOON steps fall on every re-planning step: the plan would never back off)
            self._replan_due |= due
        else:
            if self._plan is None or due or self._replan_due or self._recheck:
                # a re-check only (a block of the plan got nothing accepted, before the schedule's turn):
                # a changed plan takes effect now, a held one leaves the probing schedule as it was
                early = self._recheck and not (due or self._replan_due or self._plan is None)
                self._replan_due = self._recheck = False
                plan, hopeless, futile = self._evaluate()
                if plan and self._few and self.tries[0] < self.FEW_DRAWS:
                    # acceptance from another gate's first blocks or two (a server's first request, its first
                    # steps): at this batch size's rows a plan on it drafted whole blocks for every sequence
                    # (4 steps of 0.4-0.7 s at 3-5 sequences, 1.7B on 2 cores, where plain steps took 45-60 ms)
                    # on a draw or two; decode plainly and probe soon (one sequence a probe) until FEW_DRAWS
                    plan, hopeless, futile = 0, False, False
                # right probes in a row that left plain decoding the winner (any drafting plan ends the run)
                self._unpaid = 0 if plan else self._unpaid + self._probe_right
                self._probe_right = False
                if early and plan == self._plan:
                    return plan
                # a choice that survives re-measuring is probed less often (a never-right drafter then
                # costs one short block every PROBE_MAX steps); a change restarts frequent probing, and
                # plain decoding chosen over a drafter that does get tokens right (a dip, or few draws)
                # is re-probed soon
                steady = plan == self._plan
                self.probe_every = min(self.probe_every * 2, self.PROBE_MAX) if steady else self.PROBE_EVERY
                if hopeless or (plan == 0 and steady and self.probe_every >= self.PROBE_MAX):
                    # a drafter that looks never right, or one whose every token right would not pay (a
                    # target so small that a block's rows cost as much as its tokens): probed no faster
                    # than its probes' cost allows; so is one that probes have found not paying, again
                    # and again, once the gap has grown to PROBE_MAX (probes costing over PROBE_BUDGET
                    # there: a tiny pair, where a probe costs several plain steps)
                    self.probe_every = max(self.probe_every, self._probe_gap())
                if plan == 0 and futile:
                    # not even every token right would pay (a target so small that a block's rows cost what
                    # its tokens do: the demo pair): no acceptance a probe could find changes the choice,
                    # only costs that move apart (the context, the machine), so probes come the longest gap
                    # apart, from the first one on (at the budget's gaps, with the injection of the rows
                    # kept meanwhile and the slow plain steps after each, three probes of about 3.5 ms fell
                    # in the demo pair's 480 timed tokens, 175 ms of plain decoding)
                    self.probe_every = max(self.probe_every, self._longest_gap())
                    if not steady:
                        self._next_probe = max(self._next_probe, self.steps + self.probe_every)
                if plan == 0 and not steady and not hopeless and not (self._plan is None and self._learned):
                    # (not a gate's first plan on acceptance another gate drew many times: a batch size's,
                    # where plain wins on the rows' cost; re-probing it soon asks again what is known, at
                    # every batch size a server passes through)
                    self.probe_every = self.PROBE_SOON
                    self._next_probe = min(self._next_probe, self.steps + self.PROBE_SOON)
                if 0 < plan < self.n_max:
                    # a middle plan's probes (two steps of the whole block or of plain decoding, in turn) no
                    # closer than their cost allows; chosen on the prior's word for the whole block, it measures
                    # that soon (a prior taken while the machine was busy must not keep full blocks away for long)
                    self.probe_every = max(self.probe_every, self._middle_probe_gap(plan))
                    if self.n_max in self._prior:
                        self._probe_full = False
                        self._next_probe = min(self._next_probe, self.steps + self.PROBE_SOON)
                if plan and self._plain_on_prior() and self._plain_could_win(plan):
                    # drafting chosen against plain decoding on the prior's word, by less than a busy prior
                    # can be off: measure plain soon too (the whole block's probe first where that is the
                    # prior's too: the toggle then brings plain)
                    if plan < self.n_max and self.n_max not in self._prior:
                        self._probe_full = True
                    self._next_probe = min(self._next_probe, self.steps + self.PROBE_SOON)
                self._plan = plan
            n = self._plan
        return n

    def _evaluate(self) -> tuple[int, bool, bool]:
        """The length with the most expected tokens per second, and for plain decoding (0) whether the
        drafter looks hopeless (never right, or never paying even with every token right) and whether it is
        futile (the latter: no acceptance could make drafting pay at these costs). Kept until the
        acceptance counts or a cost against the others change (``_evaluated`` is dropped): while decoding plainly the
        plan's steps only scale every cost by one factor, which changes neither answer, so re-planning
        every REPLAN_EVERY steps costs next to nothing there (the evaluation, 40 us with the caches cold
        after a small target's decode, was 10 of the gate's 21 us a plain step on the demo pair)."""
        if self._evaluated is not None:
            return self._evaluated
        expected = self.expected_tokens()
        costs = self.step_cost()
        rate = expected / costs
        plan = int(np.argmax(rate))
        if plan and rate[self.n_max] >= (1 - self.PREFER_FULL) * rate[plan]:
            # near a tie, the whole block: its cost is measured, not read off a line, and it keeps
            # drawing every position's acceptance (shorter blocks leave the deep ones to extrapolation);
            # the most this gives up is PREFER_FULL
            plan = self.n_max
        if plan and not self._plan:
            # from plain decoding, a drafting plan must pay for its way back too: the plain steps after a
            # drafting one run slow (the drafter's run pushed the target out of the caches; probes measure
            # it), spread over the REPLAN_EVERY steps a plan runs at least. On a small pair that is several
            # plain steps, and near a tie the plan toggled at re-plannings: the demo pair on an AVX2 Zen 4,
            # its 3-token blocks 1.72 tokens a ms against plain's 1.68, ran at 0.76-0.81x plain. At real sizes
            # those steps are within noise of settled ones, and this changes nothing.
            runs, back = self.REPLAN_EVERY, self._way_back()
            if max(expected[n] * runs / (costs[n] * runs + back) for n in range(1, self.n_max + 1)) < rate[0]:
                plan = 0
        futile = plan == 0 and not self._could_pay(costs)
        hopeless = futile or (plan == 0 and bool(expected[-1] <= self.DIP))
        self._evaluated = (plan, hopeless, futile)
        return plan, hopeless, futile

    def _way_back(self) -> float:
        """Seconds the way back from drafting to plain decoding costs beyond settled plain steps: the excess
        of the PROBE_TAIL plain steps after probes (EMA); 0 until a probe's tail has been measured."""
        return self._tail_seen if self._tail_seen == self._tail_seen else 0.0

    def learn_acceptance(self, other: "DraftLength") -> None:
        """Start from ``other``'s acceptance history (the same drafter, another step shape: a batch of
        sequences), keeping this gate's costs: a drafter ``other`` found never right is not warmed up
        with full blocks again, nor probed at the whole budget's gaps after probes of ``other`` found
        nothing again and again (its fruitless run goes on here)."""
        if other.n_max != self.n_max:
            raise ValueError(f"gates of {self.n_max} and {other.n_max} drafted tokens")
        self.hits[:], self.tries[:] = other.hits, other.tries
        self._evaluated = None
        self._blocks, self._right = other._blocks, other._right
        self._fruitless = other._fruitless
        self._learned = bool(other.tries[0] >= self.FEW_DRAWS)
        self._few = not self._learned

    def start_from(self, hits: np.ndarray, tries: np.ndarray) -> None:
        """Start from an acceptance history kept from earlier decoders of the same pair
        (:mod:`dflash_gguf.decoding.history`), at least FEW_DRAWS draws deep: no warm-up blocks to find out
        whether the drafter is ever right, a plan from the first step."""
        if (hits.shape != (self.n_max,) or tries.shape != (self.n_max,) or (hits < 0).any() or (hits > tries).any()
                or tries[0] < self.FEW_DRAWS):
            raise ValueError(f"an acceptance history of {self.n_max} positions with 0 <= hits <= tries and at "
                             f"least {self.FEW_DRAWS} draws of the first")
        self.hits[:], self.tries[:] = hits, tries
        self._evaluated = None
        self._warmup = 0
        # a first plan of plain decoding is what the history says, not a dip to re-probe soon
        self._learned = True

    def new_run(self, after: "DraftLength | None" = None) -> None:
        """The next step starts a run (a generation's first, after its prefill): its cost is no steady one
        (nor a probe's aftermath). ``after``: the step before was that gate's (another batch size's), and
        this gate's run goes on from where it stands: a plain step of three sequences after plain steps of
        two is as settled as after its own. (Without it, a server whose batch size changes every few steps
        never records a steady cost in a small batch's gate, which then plans on its prior for good: a
        4-client server's two-sequence gate drafted on a noisy prior's word, every step of its life.)"""
        self._run, self._streak = (after._run, after._streak) if isinstance(after, DraftLength) else (None, 0)
        self._probe_after = 0

    def record(self, n: int, accepted: int, seconds: float | None, same_step: bool = False, batch: int = 1,
               verified: int | None = None) -> None:
        """A step that drafted ``n`` tokens, ``accepted`` of them, in ``seconds``. ``same_step``: another
        sequence of the step recorded last (a batch: its acceptance counts, the step's cost once).
        ``batch``: the sequences ``seconds`` is a share of (a batch's probe drafts for one). ``verified``:
        the drafted tokens the target verified, where fewer than ``n`` (a block cut by the drafter's
        confidence or a grammar): only they count as reached. ``seconds`` None: the step's cost is no
        ``n``-token step's (a cut block's: a longer draft, a shorter verify) and is left out; the step
        still continues a run of ``n``."""
        v = n if verified is None else verified
        if self._probe_after and not same_step:
            # the plain steps after a probe pay for the switch back (on the demo pair a plain step more at
            # first, the excess fading over ten to twenty steps), which is the probe's cost too: their summed
            # excess over a settled plain step (a noisy step's deficit counts against it, a step slower than
            # OUTLIER plain ones as that; never below zero)
            c0 = self.cost[0]
            if n == 0 and c0 > 0:
                self._probe_after -= 1
                was = max(self._probe_tail, 0.0)
                self._probe_tail += min(seconds, self.OUTLIER * c0) - c0   # a slow step (the OS) counts as OUTLIER
                grew = self._probe_after_w * (max(self._probe_tail, 0.0) - was)
                self._probe_seen += grew
                self._tail_seen += grew
            else:
                self._probe_after = 0
        if n > 0 and self._plan == 0 and not same_step:
            # a probe while decoding plainly: what it cost, all told (the gap between probes spends the budget),
            # and whether it found nothing again (or something: whether that pays is the next plan's to say)
            self._fruitless = 0 if accepted else self._fruitless + 1
            self._probe_right = accepted > 0
            if seconds is not None:
                first = self._probe_seen != self._probe_seen    # nan
                self._probe_seen = seconds if first else 0.5 * (self._probe_seen + seconds)
                self._tail_seen = 0.0 if first else 0.5 * self._tail_seen
                self._probe_after, self._probe_after_w, self._probe_tail = self.PROBE_TAIL, (1.0 if first else 0.5), 0.0
        if n > 0 and self._plan == 0 and 2 * accepted >= v and \
                not (seconds is not None and (1 + accepted / batch) * self.cost[0] <= seconds):
            # a probe while decoding plainly found the drafter right, and its step beat a plain one (or
            # plain's cost is unknown): look again soon, re-plan now. A probe that was right but still
            # slower than plain decoding (a drafter that pays on a larger target, not on this one) only
            # adds its draws: probing soon after it, again and again, would cost more than it finds. A batch's
            # probe (one sequence drafts) beat a plain step where all its sequences' tokens did (8 sequences
            # at 1.7B on AVX2, taken for the drafting one's: right probes every 2-3 steps, 0.70-0.83x)
            self._plan = None
            self._next_probe = self.steps + 2
        if n > 0 and n == self._plan and accepted == 0 and self.tries[0] < self.FEW_DRAWS:
            # a block of a plan taken on few draws with nothing right: re-plan at the next step, not up to
            # REPLAN_EVERY steps on. A probe right on both its tokens sends the acceptance estimate,
            # extrapolated to the deep positions, to whole blocks, which otherwise run on for up to eight
            # steps of a drafter that is not right (a 0.6B-shaped pair's server spent 0.1-0.3 s a block on
            # them at one slot); past FEW_DRAWS a miss is what the estimate expects (a good drafter's
            # first token is wrong about one block in five) and the schedule re-plans
            self._recheck = True
        if n > 0:
            self._evaluated = None
            self._blocks += 1
            self._right |= accepted > 0
            self.hits *= self.DECAY
            self.tries *= self.DECAY
            self.tries[:min(accepted + 1, v)] += 1
            self.hits[:accepted] += 1
        if same_step:
            return
        self._streak = self._streak + 1 if n == self._run else 1
        self._run = n
        if seconds is None:
            return
        steady = self._streak > 1                                  # not a switch's (or a prefill's) first step
        settled = self._streak > self.SETTLE.get(n, 1)
        c = self.cost[n]
        if c != c:                 # nan: not measured yet
            self.cost[n] = seconds
            self._evaluated = None
            if not steady:
                self._prior.add(n)     # the first steady step of this length replaces it
            return
        switched = False
        if not steady:
            # a switch's cost, not this length's; unless the plan's steps are all switches (a batch size's gate
            # whose every step follows another size's or a prefill), where it is what the plan costs, and a
            # prior that underrates it would otherwise stand for good. Counted across plans: the count measures
            # the traffic, which a new plan does not change (counted per plan, a 4-client server's gate whose
            # plans change as the prior gives way took about twice as many steps to decode plainly)
            self._switches = self._switches + 1 if n == self._plan else 0
            if self._switches < self.SWITCHES:
                return
            switched = True
        elif n == self._plan:
            self._switches = 0
        if not switched and (self._probe_step == self.steps or not settled) and seconds >= c \
                and not (n == self.n_max and n in self._prior):
            # a probe's second step, or a plain step before SETTLE of them, still runs warmer than
            # settled steps (on a small pair plain steps settle over about ten after a drafting one):
            # it may lower a cost, not raise it (a prior measured on a busier machine still comes down
            # at once; a lasting rise shows in the settled steps, and a plan that looks worse is left
            # for the one it underrates). Except the whole block's prior, which the plan's own steps
            # have scaled: its probe's second step (settled: a drafting block settles after one) is the
            # first measure of it and replaces it (the only drafting length a probe's second step has).
            # Left standing, a middle plan "on the prior's word for the whole block" probed whole blocks
            # at every re-planning (1.7B Q4_0 on AVX2: two steps of 0.37 s every 6-8 steps of 0.05 s,
            # where the scaled prior said 0.34 s)
            if n == 0 and self._probe_step == self.steps:
                self._plain_checked = True         # plain's prior stands, checked by a probe
            return
        # one slow step (the OS, a page fault, a collector pause) moves the estimate a little; a
        # lasting change still shows within a few steps
        seconds = min(seconds, self.OUTLIER * c)
        # the prior (measured once, perhaps on a busier machine or a shorter context) stands in until
        # the first steady step of that length, as a first step after a switch does without a prior
        was_prior = n in self._prior
        w = 1.0 if was_prior else self.COST_EMA
        if self.batch > 1 and n > 0 and n in self._prior and c > 0:
            # the first measure of a drafting length's prior at a batch size: the other drafting lengths'
            # priors were scaled from one sequence's costs by the same model (batch_costs), so they are off by
            # about as much (1.4-1.6x at every length of two sequences' steps, 1.7B on AVX2); one sequence's
            # prior measured each length itself
            f = seconds / c
            for k in range(1, self.n_max + 1):
                if k != n and k in self._prior:
                    self.cost[k] *= f
        self._prior.discard(n)
        new = (1 - w) * c + w * seconds
        if n == self._plan and self._probe_step != self.steps and c > 0 and not switched:
            # the plan's own steps track the machine: one that gets busier (or quieter) makes every length
            # cost more (or less), so the others' costs move with it; only steps of another length (probes)
            # change how they compare. Left alone, a stale cost taken in a quieter minute beats the plan's
            # fresh one: the demo pair's gate drafted at 0.83x plain after a busy minute raised plain's cost
            # by 30% while the whole block's stood. (Not a switch's step: it costs what it does for being
            # one, which says nothing of the machine.)
            f = new / c
            if not was_prior:
                self.cost = [x * f for x in self.cost]
            else:
                # the first measure of the plan's length replaces its prior: the prior's error, a factor for
                # the costs still on the prior (one sequence's lengths, measured together by calibration, are
                # off together; a batch's drafting lengths moved above), not for those steps measured. Scaled
                # with it, a batch gate's measured plain cost took on a busy prior's error and blocks slower
                # than plain decoding looked faster (BENCHMARKS-LOG section 51)
                if self.batch == 1:
                    self.cost = [x * f if k in self._prior else x for k, x in enumerate(self.cost)]
                if f != 1.0 and (self.batch > 1 or any(k not in self._prior for k in range(len(self.cost)) if k != n)):
                    self._evaluated = None     # not every cost moved by the one factor
        else:
            self._evaluated = None
        self.cost[n] = new
