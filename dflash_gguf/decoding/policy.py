"""The draft policy: how many tokens each sequence of a step drafts, and how many of them the target verifies.

The decoder calls it through one interface, every step:

* :meth:`DraftPolicy.plan` - before drafting: each sequence's draft length;
* :meth:`DraftPolicy.verify_rows` - after drafting, for drafters that score their tokens: each gated
  sequence's block cut to the rows worth verifying;
* :meth:`DraftPolicy.observe` - after the verify: what each sequence drafted, verified and had accepted,
  and what the step's work cost;
* :meth:`DraftPolicy.interrupt` - something else ran (a prefill, the caller's own work): the next step's
  cost is a switch's, not a settled one;
* :meth:`DraftPolicy.request_ended` - a request left its slot: what the policy learnt is kept.

It weighs two proposers, per sequence and step: the drafter's block and, with prompt lookup
(:mod:`.ngram`), a block copied from the prompt and the text so far, where a copy is expected to give more
tokens per second (:meth:`DraftPolicy.copy_length`; with no drafter at all, copies against plain steps).

For the drafter's blocks it has two inputs. The acceptance history (:class:`.gate.DraftLength`, one per kind of request
and batch size): the draft length with the most expected tokens per second from this machine's measured
step costs (its prior measured by :mod:`.calibration`) and how often the drafter was right, kept per pair
(:mod:`.history`). And, for drafters with a confidence head (DSpark), the per-token confidence calibrated
online against what the target accepts (:mod:`.confidence`), which cuts each block to the rows whose
expected tokens pay for their verify cost. Every request takes part, seeded sampled ones too: their
text does not depend on what is drafted (:class:`dflash_gguf.decoding.sampling.TokenChooser`), so neither on this
machine's timings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from dflash_gguf.decoding import history
from dflash_gguf.decoding.batch_costs import batch_prior
from dflash_gguf.decoding.confidence import Calibration, allocate, rows_cost
from dflash_gguf.decoding.ngram import StepCosts, best_length
from dflash_gguf.decoding.gate import DraftLength
from dflash_gguf.decoding.sampling import SamplingParams

if TYPE_CHECKING:
    from dflash_gguf.decoding.sequence import Slot, Step


@dataclass
class Plan:
    """A step's draft lengths (one per sequence, in step order), the gate that chose them (None: no
    sequence of the step is gated) and its choice."""
    lengths: list[int]
    gate: DraftLength | None
    choice: int


class DraftPolicy:
    """The draft lengths of a decoder of ``n_draft``-token blocks. ``gated``: the speed gate chooses them
    (else every request drafts whole blocks); ``confident``: the drafter scores its tokens; ``n_copy``:
    tokens prompt lookup copies per step at most (0: none), chosen by their measured worth where
    ``adaptive`` (else whole matches with no drafter)."""

    # matches declined in a row (the copies did not pay) before two tokens are copied anyway
    COPY_PROBE = 8

    def __init__(self, n_draft: int, gated: bool, confident: bool, n_copy: int = 0, adaptive: bool = False):
        self.n_draft = n_draft
        self.n_copy = n_copy
        self.adaptive = adaptive
        self.copy_costs = StepCosts()   # seconds of a step that ran no draft, by its verify rows
        self.gate = DraftLength(n_draft) if gated else None            # greedy requests
        self.gate_sampled = DraftLength(n_draft) if gated else None    # sampled requests without a seed
        self.batch_gates: dict[int, DraftLength] = {}                  # steps of b >= 2 gated sequences
        self.costs: np.ndarray | None = None   # one sequence's step costs: the batch gates' priors come from them
        # what the target made of the drafter's scores (one calibration for greedy requests, one for sampled
        # ones: a sampled token is kept less often)
        self.confidence: dict[bool, Calibration] | None = None
        if confident:
            self.score_tokens()
        self._prev: DraftLength | None = None   # the gate of the last step (None: something else ran since)
        self._prior_checked = True
        self._stale: Callable[[DraftLength], bool] | None = None
        self._keep = False
        self._kept_draws = 0

    # ------------------------------------------------------------------ what it starts from
    def start_from(self, costs: np.ndarray | None, stale: Callable[[DraftLength], bool] | None = None) -> None:
        """Gates that plan with this machine's measured step costs (:func:`.calibration.step_costs`);
        ``stale(gate)``: whether what ``gate`` has seen shows the prior was measured on a busy machine (and
        marks it so: :func:`.calibration.check_prior`), asked after each request until one says so."""
        self.costs = costs
        self._stale = stale
        self._prior_checked = costs is None or stale is None   # found stale (or nothing to check)
        if costs is not None:
            self.gate = DraftLength(self.n_draft, costs)
            self.gate_sampled = DraftLength(self.n_draft, costs)

    def score_tokens(self) -> None:
        """Blocks come with a confidence per drafted token from now on (a proposer that scores its tokens)."""
        if self.confidence is None:
            self.confidence = {True: Calibration(), False: Calibration()}

    def keep_history(self, pair: history.Pair) -> None:
        """Start from the acceptance ``pair``'s earlier decoders kept, and keep this one's as it grows."""
        self._keep = True
        history.recall(pair, {"greedy": self.gate, "sampled": self.gate_sampled})
        self._kept_draws = self.draws()

    def forget_history(self) -> None:
        """Gates as a new pair's, no longer kept: the proposals are not the drafter's own from now on (a
        replay, an oracle), so neither what was recalled of its acceptance nor what they show is the pair's."""
        if not self._keep:
            return
        self._keep = False
        if self.gate is not None:
            self.gate = DraftLength(self.n_draft, self.costs)
            self.gate_sampled = DraftLength(self.n_draft, self.costs)
        self.batch_gates.clear()
        self._prev = None

    def gate_for(self, sp: SamplingParams) -> DraftLength | None:
        """The gate that chooses for a request sampled with ``sp`` (None: fixed blocks)."""
        return self.gate if sp.greedy else self.gate_sampled

    # ------------------------------------------------------------------ every step
    def interrupt(self) -> None:
        self._prev = None

    def plan(self, seqs: list[Slot], n_ctx: int, padded: bool) -> Plan:
        """Tokens each sequence of the step drafts (``padded``: every block is verified padded to the
        longest, so none may draft past the room the fullest context has left)."""
        # a step with a prompt's tail in it (the decoder fuses it into a request's first step): alone, a
        # prefill more than a step of any length (not the gate's); beside others, a prefill's share more
        fused = any(len(s.head) for s in seqs)
        gated = [s for s in seqs if s.gate is not None] if not (fused and len(seqs) == 1) else []
        gate = None
        if len(gated) == 1 and len(seqs) == 1:
            gate = gated[0].gate
        elif gated:
            gate = self._batch_gate(len(seqs))
        if gate is not None and gate is not self._prev:
            # the step before was not this gate's: after a prefill, a new call or a step of sequences that
            # no gate drafts for, this step's cost is a switch's, not a settled one; after another batch
            # size's step, the run goes on from that gate's (the same length in a row is as settled)
            gate.new_run(self._prev)
        # the step after a fused one is a run's first (as after a prefill); it is not recorded (observe)
        self._prev = None if fused else gate
        choice = gate.choose() if gate is not None else 0
        room = min(n_ctx - len(s.cache) for s in seqs) if padded else n_ctx
        ns = []
        for s in seqs:
            want = 0 if len(s.head) else choice if s.gate is not None else s.n_draft   # no features for a tail yet
            ns.append(max(0, min(want, s.max_tokens - s.produced - 1, n_ctx - len(s.cache) - 1, room - 1)))
        if gate is not None and gate.probing and len(seqs) > 1 and not padded:
            # an acceptance probe asks whether the drafter is right again: one sequence's draft answers
            # that at a fraction of the whole batch's cost (b + n verify rows instead of b (n + 1), one
            # drafter row set, one sequence's kept rows injected: the one with the fewest); the other
            # gated sequences decode plainly this step (not where blocks are padded to the longest: there
            # the others' rows are verified anyway)
            can = [i for i, s in enumerate(seqs) if s.gate is not None and ns[i] > 0]
            if can:
                probe = min(can, key=lambda i: seqs[i].features.n)
                ns = [n if i == probe or seqs[i].gate is None else 0 for i, n in enumerate(ns)]
        for i, s in enumerate(seqs):
            s.copied = []
            if s.copy is not None and not len(s.head):
                limit = min(self.n_copy, s.max_tokens - s.produced - 1, n_ctx - len(s.cache) - 1, room - 1)
                match = s.copy.propose(limit) if limit > 0 else []
                k = self.copy_length(s, len(match), ns[i], gate, len(seqs)) if match else 0
                if k:
                    s.copied, ns[i] = match[:k], k
        return Plan(ns, gate, choice)

    def copy_length(self, s: Slot, m: int, n_drafter: int, gate: DraftLength | None, b: int) -> int:
        """How many of a prompt-lookup match's ``m`` tokens ``s`` verifies this step (0: the drafter's
        ``n_drafter`` tokens, or a plain step, are expected to give more tokens per second). With no
        drafter: by the copies' acceptance and the measured cost of a step by its rows (the step's other
        ``b - 1`` sequences counted as plain ones); beside a gated drafter: against the gate's expectation
        of its own choice at the gate's step costs (a copy at the cost of steps that ran no draft, where
        measured, else of a drafting step of as many rows), never in place of a step the gate's schedule
        takes (warm-up, acceptance and cost probes); beside a fixed-length drafter: the one expected to
        give more tokens. Without the speed gate (``adaptive`` False) and no drafter: the whole match."""
        if gate is not None and not isinstance(gate, DraftLength):
            return 0          # calibration's fixed schedule measures the drafter's steps
        if s.n_draft == 0 and not self.adaptive:
            return m
        if s.n_draft == 0:
            e = s.copy_rates.expected(m)
            k = best_length([b - 1 + x for x in e], [self.copy_costs(b + j) for j in range(len(e))])
        elif s.gate is not None and gate is not None:
            if gate.scheduled:
                return 0      # a warm-up step or a probe: a copy in its place would leave the gate without its answer
            e, c = gate.expected_tokens(), gate.step_cost()
            mine = s.copy_rates.expected(min(m, gate.n_max))
            # a copy's step as steps without a draft measured it (else as a drafting one of as many rows)
            own = [self.copy_costs(b + j) for j in range(len(mine))]
            rates = [x / (o if o == o else c[j]) for j, (x, o) in enumerate(zip(mine, own))]
            k = max(range(len(rates)), key=rates.__getitem__)
            if rates[k] <= e[n_drafter] / c[n_drafter]:
                k = 0
        else:
            mine = s.copy_rates.expected(min(m, max(n_drafter, 1)))
            # (a tie goes to the copy: its step runs no draft)
            k = len(mine) - 1 if mine[-1] >= s.draft_rates.expected(n_drafter)[-1] else 0
        if k == 0:
            s.copy_declined += 1
            if s.copy_declined % self.COPY_PROBE == 0:
                k = min(m, 2)     # is the text copying again? a short copy asks at little cost
        return k

    def _batch_gate(self, b: int) -> DraftLength:
        """The gate of steps of ``b`` sequences, measured on such steps (the rows of a step, hence its cost
        and what drafting buys, grow with the sequences in it)."""
        gate = self.batch_gates.get(b)
        if gate is None:
            # its costs are this batch size's to measure, from a prior scaled by the rows of such a step (no
            # warm-up of full blocks at every batch size); the drafter's acceptance is known already: from
            # the gate that has seen the most of it
            gate = self.batch_gates[b] = DraftLength(
                self.n_draft, batch_prior(self.costs, b) if self.costs is not None else None)
            gate.batch = b
            seen = [g for g in (self.gate, *self.batch_gates.values()) if g is not None and g is not gate]
            if seen:
                gate.learn_acceptance(max(seen, key=lambda g: g.tries.sum()))
        return gate

    def verify_rows(self, seqs: list[Slot], plan: Plan, scores: np.ndarray, padded: bool) -> None:
        """Cut the gated sequences' drafted blocks (``plan.lengths``, what each got) to the rows worth verifying
        by the drafter's calibrated confidence in them (``scores[slot, :n]``), weighed with the gate's
        measured step costs. Sequences no gate chooses for and DFlash2 lattices keep theirs; so does a
        step whose blocks are padded to the longest (every row is verified anyway), calibration's fixed
        schedule and the gate's own (they measure whole lengths)."""
        if self.confidence is None or padded or not isinstance(plan.gate, DraftLength) or plan.gate.scheduled:
            return     # (the schedule's steps - warm-up, probes - measure whole lengths' costs and acceptance)
        ns = plan.lengths
        cut = [i for i, s in enumerate(seqs) if ns[i] > 1 and s.gate is not None and not s.lattice and not s.copied]
        if not cut:
            return
        rates = [self.confidence[seqs[i].chooser.sp.greedy].rates(scores[seqs[i].slot, :ns[i]]) for i in cut]
        n_gated = sum(1 for s in seqs if s.gate is not None)
        for i, k in zip(cut, allocate(rates, rows_cost(plan.gate.step_cost(), n_gated))):
            ns[i] = k

    def observe_scores(self, s: Slot, scores: np.ndarray, verified: int, accepted: int) -> None:
        """What the target made of the ``len(scores)`` tokens ``s`` drafted, of which ``verified`` were
        verified and ``accepted`` kept (the confidence's calibration)."""
        if self.confidence is not None and len(scores) and not s.lattice:
            self.confidence[s.chooser.sp.greedy].observe(scores, verified, accepted)

    def observe(self, steps: list[tuple[Slot, Step]], plan: Plan, seconds: float) -> None:
        """Charge the gate a step's whole work (draft with any deferred feature injection, verify,
        acceptance, sampling, keeping the rows and rolling back): what a step of that length costs. A step
        with a copied block is no step of the drafter's (prompt lookup: its own costs, by rows)."""
        gate, choice = plan.gate, plan.choice
        if any(st.head for _, st in steps):
            return   # a prompt's tail made the step a prefill's share dearer (plan)
        if self.n_copy and all(st.n == 0 or st.copied for _, st in steps):    # no draft ran
            self.copy_costs.record(sum(st.n + 1 for _, st in steps), seconds)
        if gate is None or any(st.copied for _, st in steps):
            return   # no gate chose, or a copy replaced a block the gate chose
        gated = [st for s, st in steps if s.gate is not None]
        # an acceptance probe of a batch drafted for one sequence (plan): the others drew nothing
        draws = [st for st in gated if st.n > 0] if gate.probing and len(steps) > 1 else gated
        # a block cut before the verify (verify_rows, a grammar) drafted more than it verified: the step cost
        # neither length's step, and only its verified tokens were tried (recorded as the drafted length's
        # step otherwise, such steps made short lengths look dear: a one-token verify after an 8-token draft)
        cut = any(st.proposed > st.n for st in gated)
        share = None if cut else seconds / len(gated)
        for i, st in enumerate(draws or gated[:1]):
            length = choice if len(steps) > 1 else max(st.proposed, st.n)
            gate.record(length, st.accepted, share, same_step=i > 0, batch=len(gated), verified=st.n)

    # ------------------------------------------------------------------ between requests
    def request_ended(self, pair: history.Pair, own_proposals: bool = True) -> None:
        """A request of ``pair``'s decoder ended: a step-cost prior its gates show was measured on a busy
        machine is marked stale (once), and the acceptance history is kept when it grew (``own_proposals``:
        the drafter's own, not a replay's or an oracle's, which are not the pair's acceptance)."""
        if not self._prior_checked:
            # a batch size's gates too: a server's slots may never decode one sequence alone
            self._prior_checked = any(self._stale(g) for g in (self.gate, self.gate_sampled, *self.batch_gates.values())
                                      if g is not None)
        if self._keep and own_proposals and self.draws() > self._kept_draws:
            self._kept_draws = self.draws()
            greedy = max((g for g in (self.gate, *self.batch_gates.values()) if g is not None),
                         key=lambda g: g.tries[0])
            history.keep(pair, {"greedy": greedy, "sampled": self.gate_sampled})

    def draws(self) -> int:
        """Steps the gates have chosen so far (what they know grows with them)."""
        return sum(g.steps for g in (self.gate, self.gate_sampled, *self.batch_gates.values()) if g is not None)
