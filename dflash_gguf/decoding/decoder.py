"""The DFlash block draft-verify loop for one or several sequences, driven from Python over the patched libllama.

One step, for every sequence ``s`` of the step at once (``s``'s target KV holds ``P_s`` tokens, ``pending_s``
is its last chosen token, not yet decoded):

1. ``draft``   - one drafter decode of every drafting sequence's block ``[pending_s, mask x n]`` at
                 ``P_s..P_s+n`` proposes ``d1..dn`` for each (the noise blocks never stay in the drafter's cache);
2. ``verify``  - one target decode of every sequence's ``[pending_s, d1..dn_s]`` (rows tagged by sequence);
                 greedy reads only the per-row argmax ids, sampling reads the logits rows it needs;
3. ``accept``  - per sequence, the longest agreeing prefix ``d1..da`` plus the target's own next token;
4. ``commit``  - per sequence, hand the tokens over; when its consumer has what it wants (all of them, or it
                 stops early at EOS, max_tokens or a stop string), inject the features of the committed
                 rows into the drafter and roll the target back to ``P_s + k`` - for a generator in
                 ``finally``, so a consumer that stops iterating leaves both caches exactly where plain
                 decoding would.

A decoder serves ``target.n_seq`` sequences (slots; llama.cpp sequence ids). :meth:`DFlashDecoder.generate`
runs one request on slot 0 as a generator (the single-sequence case: ``dflash_gguf.Llama``);
:meth:`DFlashDecoder.run` (or :meth:`~DFlashDecoder.admit` and :meth:`~DFlashDecoder.step`, for a server)
runs many requests on all slots, a request joining as soon as a slot is free. Both go through the same
step (:meth:`DFlashDecoder._advance`, :meth:`DFlashDecoder._settle`); ``generate`` must not run while
requests run on the slots.

A step's block may instead be copied by prompt lookup (:mod:`.ngram`, ``SpecOptions.ngram``): with no drafter
at all (any target: no taps, no features, only the verify of copied blocks), or beside one, per sequence and
step, where the copy is expected to give more tokens per second (:meth:`DFlashDecoder._copy_length`). A
copied step runs no draft: for the drafter it is a plain step, whose committed rows' features are kept on
the host and injected before its next draft (:mod:`.features`).

The phases live in their own modules: :mod:`.proposer` (draft), :mod:`.acceptance` (accept),
:mod:`.rollback` (one object per memory kind), :mod:`.stats` (statistics); this module sequences them.
:mod:`.scheduling` holds the decoder's methods for many requests (admit, step, run), :mod:`.sequence`
the records kept per request and slot.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from dflash_gguf import _bindings as B
from dflash_gguf.constraints import Constraints
from dflash_gguf.engine import Context, DrafterInfo, clamp_n_draft
from dflash_gguf.errors import ContextOverflowError, DecodeError, InvalidArgumentError
from dflash_gguf.gate import DraftLength
from dflash_gguf.decoding.batch_costs import batch_prior
from dflash_gguf.decoding import calibration, history
from dflash_gguf.sampling import SamplingParams, TokenChooser
from dflash_gguf.decoding.acceptance import cut_at_stop, greedy_accept, sampled_accept
from dflash_gguf.decoding.confidence import Calibration, allocate, rows_cost
from dflash_gguf.decoding.features import FeatureFeed
from dflash_gguf.decoding.ngram import NgramIndex, NgramOptions, Rates, StepCosts, best_length
from dflash_gguf.decoding.prompts import TAP_ROWS, Prompts
from dflash_gguf.decoding.proposer import DrafterProposer, LatticeProposer, MarkovProposer, Proposer
from dflash_gguf.decoding.rollback import make_rollback
from dflash_gguf.decoding.scheduling import Scheduling, common_prefix_len
from dflash_gguf.decoding.sequence import NO_HEAD, Slot, Step
from dflash_gguf.decoding.stats import GenerationStats

log = logging.getLogger("dflash_gguf.decoding")


@dataclass
class SpecOptions:
    n_draft: int | None = None   # tokens drafted per block; default and maximum: the drafter's (block_size - 1,
                                 # anchor-first DSpark block_size)
    rollback: str = "auto"       # auto | seq_rm | snapshot | checkpoint
    adaptive: bool = False       # speed gate: draft per step as many tokens as pays (gate.DraftLength)
    calibrate: bool = True       # ... starting from this machine's measured step costs (decoding.calibration)
    # at temperature > 0, draw from the drafter's own distribution (DFlash2: its selector's top-k lattice;
    # DSpark: its Markov chain) rather than propose its argmax tokens
    sample_lattice: bool = True
    # the gate starts from the acceptance history earlier decoders of this pair kept, and keeps its own
    # (decoding.history; the front doors' decoders: a user's first call plans from the first step)
    keep_history: bool = False
    # prompt lookup: also propose tokens copied from the prompt and the text so far (decoding.ngram), with no
    # drafter at all or, per step, instead of the drafter's block where a copy is expected to pay more
    ngram: NgramOptions | None = None


class DFlashDecoder(Prompts, Scheduling):
    """Runs lossless DFlash generation on a target context and a drafter context.

    The drafter context must have been created with ``other=target`` (it borrows the target's
    embeddings and LM head) and as many sequences as the target's (``ContextOptions.n_seq``). With
    ``drafter=None`` the same loop decodes plainly, one token per step: the baseline the benchmarks
    and tests compare against. ``proposer`` (default: the drafter) may replace the proposals, see
    :mod:`dflash_gguf.decoding.proposer`.
    """

    # prompt tokens a joining request prefills per step of the others (admit/step, run): what the running
    # requests' next token waits for at most (about 0.6 s at the 1.7B Qwen3 shape on 2 Zen 4 cores)
    PREFILL_CHUNK = 128

    def __init__(self, target: Context, drafter: Context | None, opts: SpecOptions | None = None,
                 proposer: Proposer | None = None):
        self.target = target
        self.drafter = drafter
        self.opts = opts or SpecOptions()
        self.proposer = proposer or DrafterProposer()
        self.info: DrafterInfo | None = None
        self.n_draft = 0
        self.n_seq = target.n_seq
        self.n_ctx = target.n_ctx          # positions per sequence
        self.tap_rows = target.n_ubatch
        # recurrent state (hybrid and recurrent targets): llama.cpp splits a batch of several sequences into
        # ubatches of equal rows per sequence, so every sequence's block of a batched verify is padded to
        # the longest one (the rows past its own block are rolled back like rejected ones); one ubatch
        # then holds the whole batch in sequence order, which the taps read from (patch 0015)
        self._pad = self.n_seq > 1 and (target.model.is_recurrent or target.model.is_hybrid)
        if drafter is not None:
            if drafter.n_seq < self.n_seq:
                raise InvalidArgumentError(f"the drafter context serves {drafter.n_seq} sequence(s), the target "
                                           f"{self.n_seq}: create both with the same n_seq")
            cinfo = B.ffi.new("struct llama_dflash_drafter_info *")
            B.check(B.lib.llama_dflash_prepare(target.cptr, drafter.cptr, cinfo),
                    f"pairing drafter {drafter.model.path.name} with target {target.model.path.name}")
            self.info = DrafterInfo.from_c(cinfo)
            # taps are read from the target's graph, not copied to its output buffer (patch 0010):
            # every decode of this loop is at most one target ubatch (prefill chunks, verify blocks)
            B.check(B.lib.llama_dflash_set_taps_direct(target.cptr, True), "reading taps from the target's graph")
            # ... and only their last tap_rows rows are kept (patch 0011): rows whose features the
            # drafter needs are decoded in chunks of at most that many, verify blocks included
            self.tap_rows = min(max(TAP_ROWS, self.n_seq * (self.info.draft_max + 1)), target.n_ubatch)
            B.check(B.lib.llama_dflash_set_tap_rows_max(target.cptr, self.tap_rows), "capping the target's taps")
            # the drafter's graph gives argmax ids, not a block of logits (patch 0013; DSpark: of its
            # Markov-biased logits, patch 0026)
            B.check(B.lib.llama_dflash_set_draft_ids(drafter.cptr, True), "drafting by ids")
            # the drafter's block has a row per drafted token and the anchor's (anchor-first DSpark: the
            # anchor's row drafts too), the verify one more than the drafted tokens
            block_rows = drafter.n_ubatch // self.n_seq + (1 if self.info.sample_from_anchor else 0)
            self.n_draft = clamp_n_draft(self.info, self.opts.n_draft, n_batch=self.tap_rows // self.n_seq,
                                         n_ubatch=block_rows)
        # prompt lookup: tokens copied per step at most (beside a drafter: no more than it drafts, so that the
        # taps, the rollback and the buffers sized for its blocks serve a copy too)
        self.n_copy = 0
        if self.opts.ngram is not None:
            cap = self.n_draft if drafter is not None else self.tap_rows // self.n_seq - 1
            self.n_copy = max(0, min(self.opts.ngram.n_pred, cap))
        self.copy_costs = StepCosts()   # seconds of a step by its verify rows (copying with no drafter)
        self.lattice: LatticeProposer | None = None
        if self.info is not None and self.info.kind == "dflash2" and self.opts.sample_lattice and self.info.selector_top_k:
            self.lattice = LatticeProposer(self.info.selector_top_k, self.n_draft)
        self.markov: MarkovProposer | None = None
        if self.info is not None and self.info.kind == "dspark" and self.opts.sample_lattice:
            if MarkovProposer.available():
                self.markov = MarkovProposer(drafter.model.path, target.model.n_vocab)
            else:
                log.info("no gguf package: sampled DSpark blocks are the Markov head's greedy chain")
        self.seqs = [Slot(slot, make_rollback(target, max(self.n_draft, self.n_copy), self.opts.rollback, seq=slot),
                          FeatureFeed(target, drafter, self.info, seq=slot) if drafter is not None else None)
                     for slot in range(self.n_seq)]
        self._gated = self.opts.adaptive and self.n_draft > 0
        self.gate = DraftLength(self.n_draft) if self._gated else None            # greedy requests
        self.gate_sampled = DraftLength(self.n_draft) if self._gated else None    # sampled requests without a seed
        self._batch_gates: dict[int, DraftLength] = {}                            # steps of b >= 2 gated sequences
        self._prev_gate: DraftLength | None = None   # the gate of the last step (None: a prefill or a new call since)
        self._free: deque[Slot] = deque(self.seqs)   # slots without a request (run, admit, step)
        self._active: list[Slot] = []                # ... with a running one
        self._ended: list[Slot] = []                 # ... whose request ended at admission (reported by step)
        self._filling: deque[Slot] = deque()         # ... whose prompt is still being prefilled, a chunk per step
        self.closed = False            # set when the contexts are freed: a late generator cleanup then does nothing
        self._vocab = target.model.n_vocab
        bs = max(self.n_draft, self.n_copy) + 1
        self._draft = np.zeros((self.n_seq, bs), dtype=np.int32)
        # a DSpark drafter's confidence in each drafted token, and what the target made of such scores
        confident = self.info is not None and (self.info.has_confidence or self.proposer.confidence)
        # (one calibration for greedy requests, one for sampled ones: a sampled token is kept less often)
        self.confidence = {True: Calibration(), False: Calibration()} if confident else None
        self._conf = np.zeros((self.n_seq, bs), dtype=np.float32)
        # a step's rows: every sequence's block, and a joining request's prompt tail (_fusable)
        self._rows = np.zeros(max(self.n_seq * bs, self.tap_rows), dtype=np.int32)
        self._argmax = np.zeros(len(self._rows), dtype=np.int32)
        self.eog = frozenset(int(t) for t in target.model.eog_tokens)   # default stop tokens
        self.reset()   # the decoder owns both caches from here on
        self._prior_checked = True   # the calibration's own generation checks nothing ...
        self._keep = False           # ... and keeps no acceptance history (its gate is a fixed schedule)
        costs = calibration.step_costs(self) if self._gated and self.opts.calibrate else None   # cached per pair and machine
        self._costs = costs          # one sequence's step costs: the batch gates' priors come from them
        self._prior_checked = costs is None   # whether the prior was found stale (or there is none to check)
        if costs is not None:
            self.gate = DraftLength(self.n_draft, costs)
            self.gate_sampled = DraftLength(self.n_draft, costs)
        # (the drafter's own proposals only: a replay or an oracle is not the pair's acceptance)
        self._keep = self.opts.keep_history and self._gated and type(self.proposer) is DrafterProposer
        self._kept_draws = 0
        if self._keep:
            history.recall(self, {"greedy": self.gate, "sampled": self.gate_sampled})
            self._kept_draws = self._draws()
        log.debug("decoder ready: drafter=%s n_draft=%d rollback=%s sequences=%d", self.info, self.n_draft,
                  self.rollback, self.n_seq)

    # ------------------------------------------------------------------ the one-sequence view (slot 0)
    @property
    def rollback(self) -> str:
        """The rollback kind in use: seq_rm, snapshot or checkpoint."""
        return self.seqs[0].rollback.name

    @property
    def cache(self) -> list[int]:
        """Tokens in slot 0's caches (the one sequence of ``dflash_gguf.Llama``)."""
        return self.seqs[0].cache

    @property
    def features(self) -> FeatureFeed | None:
        return self.seqs[0].features

    def reset(self) -> None:
        """Empty every slot's caches."""
        self.target.clear()
        if self.drafter is not None:
            self.drafter.clear()
        for s in self.seqs:
            if s.features is not None:
                s.features.clear()
            s.cache = []

    def _reset_seq(self, s: Slot) -> None:
        self.target.clear_seq(s.slot)
        if self.drafter is not None:
            self.drafter.clear_seq(s.slot)
            s.features.clear()
        s.cache = []

    def _lengths(self, seqs: list[Slot]) -> tuple[list[int], DraftLength | None, int]:
        """Tokens each sequence drafts this step, the gate that chose them (if any) and its choice."""
        # a step with a prompt's tail in it (_fusable): alone, a prefill more than a step of any length (not the
        # gate's); beside others, it costs a prefill's share more
        fused = any(len(s.head) for s in seqs)
        gated = [s for s in seqs if s.gate is not None] if not (fused and len(seqs) == 1) else []
        gate = None
        if len(gated) == 1 and len(seqs) == 1:
            gate = gated[0].gate
        elif gated:
            # a step of several sequences: one gate per batch size, measured on such steps (the rows of a
            # step, hence its cost and what drafting buys, grow with the sequences in it)
            b = len(seqs)
            gate = self._batch_gates.get(b)
            if gate is None:
                # its costs are this batch size's to measure, from a prior scaled by the rows of such a step
                # (no warm-up of full blocks at every batch size); the drafter's acceptance is known already:
                # from the gate that has seen the most of it
                gate = self._batch_gates[b] = DraftLength(
                    self.n_draft, batch_prior(self._costs, b) if self._costs is not None else None)
                seen = [g for g in (self.gate, *self._batch_gates.values()) if g is not None and g is not gate]
                if seen:
                    gate.learn_acceptance(max(seen, key=lambda g: g.tries.sum()))
        if gate is not None and gate is not self._prev_gate:
            # the step before was not this gate's: after a prefill, a new call or a step of sequences that
            # no gate drafts for, this step's cost is a switch's, not a settled one; after another batch
            # size's step, the run goes on from that gate's (the same length in a row is as settled)
            gate.new_run(self._prev_gate)
        # the step after a fused one is a run's first (as after a prefill); it is not recorded (_record)
        self._prev_gate = None if fused else gate
        choice = gate.choose() if gate is not None else 0
        # where blocks are padded to the longest (__init__), every sequence decodes that many rows: none may
        # draft past the room the fullest context has left
        room = min(self.n_ctx - len(s.cache) for s in seqs) if self._pad else self.n_ctx
        ns = []
        for s in seqs:
            want = 0 if len(s.head) else choice if s.gate is not None else s.n_draft   # no features for a tail yet
            ns.append(max(0, min(want, s.max_tokens - s.produced - 1, self.n_ctx - len(s.cache) - 1, room - 1)))
        if gate is not None and gate.probing and len(seqs) > 1 and not self._pad:
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
                limit = min(self.n_copy, s.max_tokens - s.produced - 1, self.n_ctx - len(s.cache) - 1, room - 1)
                match = s.copy.propose(limit) if limit > 0 else []
                k = self._copy_length(s, len(match), ns[i], gate, len(seqs)) if match else 0
                if k:
                    s.copied, ns[i] = match[:k], k
        return ns, gate, choice

    COPY_PROBE = 8   # matches declined in a row (the copies did not pay) before two tokens are copied anyway

    def _copy_length(self, s: Slot, m: int, n_drafter: int, gate: DraftLength | None, b: int) -> int:
        """How many of a prompt-lookup match's ``m`` tokens ``s`` verifies this step (0: the drafter's
        ``n_drafter`` tokens, or a plain step, are expected to give more tokens per second). With no
        drafter: by the copies' acceptance and the measured cost of a step by its rows (the step's other
        ``b - 1`` sequences counted as plain ones); beside a gated drafter: against the gate's expectation
        of its own choice at the gate's step costs (a copy at the cost of steps that ran no draft, where
        measured, else of a drafting step of as many rows), never in place of a step the gate's schedule
        takes (warm-up, acceptance and cost probes); beside a fixed-length drafter: the one expected to
        give more tokens. Without the speed gate (``adaptive=False``) and no drafter: the whole match,
        every step; so for a seeded sampled request (its draws follow its steps' blocks, which must not
        follow this machine's timings: the same text every time)."""
        if gate is not None and not isinstance(gate, DraftLength):
            return 0          # calibration's fixed schedule measures the drafter's steps
        sp = s.chooser.sp
        if s.n_draft == 0 and (not self.opts.adaptive or (not sp.greedy and sp.is_repeatable)):
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

    def _propose_all(self, seqs: list[Slot], ns: list[int]) -> list:
        """Draft into ``self._draft[i]`` for every sequence with ns[i] > 0 (``ns`` becomes what each got):
        one drafter decode for those the drafter proposes to, one per sequence drawing from a DFlash2
        lattice. Returns, per sequence, the lattice distributions (or None)."""
        qs: list = [None] * len(seqs)
        for i, s in enumerate(seqs):
            if s.copied:
                self._draft[s.slot, :ns[i]] = s.copied
        batch = [i for i, s in enumerate(seqs) if ns[i] > 0 and not s.lattice and not s.copied]
        for i, s in enumerate(seqs):
            if ns[i] > 0 and not s.copied:
                t0 = time.perf_counter()
                s.features.flush()          # rows kept on the host during plain steps
                s.stats.t_inject += time.perf_counter() - t0
        t0 = time.perf_counter()
        if batch:
            n_block = max(ns[i] for i in batch)
            slots = np.array([seqs[i].slot for i in batch], dtype=np.int32)
            pos = np.array([len(seqs[i].cache) for i in batch], dtype=np.int32)
            pending = np.array([seqs[i].pending for i in batch], dtype=np.int32)
            out = np.zeros((len(batch), n_block), dtype=np.int32)
            conf = np.zeros((len(batch), n_block), dtype=np.float32) if self.confidence is not None else None
            # a DSpark chain drawn at temperature > 0 reads the block's logits rows, which the drafter
            # gives instead of argmax ids for this call
            markov = any(seqs[i].markov for i in batch)
            if markov:
                B.check(B.lib.llama_dflash_set_draft_ids(self.drafter.cptr, False), "drafting by logits")
            try:
                got = self.proposer.propose(self.drafter, slots, pos, pending, n_block, out,
                                            lambda j: seqs[batch[j]].cache, conf=conf)
                if markov:
                    rows = n_block + (0 if self.info.sample_from_anchor else 1)   # each block's rows
                    first = rows - n_block                                      # its first drafted token's
                    for j, i in enumerate(batch):
                        s = seqs[i]
                        if s.markov:
                            got_i, qs[i] = self.markov.propose(
                                self.drafter, j * rows + first, out[j, :got].copy(), s.pending, min(ns[i], got), out[j],
                                s.chooser.rng, s.chooser.sp.temperature, s.chooser.constraints)
                            ns[i] = got_i
            finally:
                if markov:
                    B.check(B.lib.llama_dflash_set_draft_ids(self.drafter.cptr, True), "drafting by ids")
            for j, i in enumerate(batch):
                ns[i] = min(ns[i], got)
                self._draft[seqs[i].slot, :ns[i]] = out[j, :ns[i]]
                if conf is not None:
                    self._conf[seqs[i].slot, :ns[i]] = conf[j, :ns[i]]
        for i, s in enumerate(seqs):
            if ns[i] > 0 and s.lattice and not s.copied:
                ns[i], qs[i] = self.lattice.propose(self.drafter, s.slot, len(s.cache), s.pending, ns[i],
                                                    self._draft[s.slot], s.chooser.rng, s.chooser.sp.temperature,
                                                    s.chooser.constraints)
        dt = (time.perf_counter() - t0) / max(sum(1 for i, n in enumerate(ns) if n > 0 and not seqs[i].copied), 1)
        for i, s in enumerate(seqs):
            if ns[i] > 0 and not s.copied:
                s.stats.t_draft += dt
        return qs

    def _advance(self, seqs: list[Slot]) -> tuple[list[Step], DraftLength | None, int]:
        """One draft-verify step of every sequence in ``seqs``: what each committed (nothing kept yet)."""
        ns, gate, choice = self._lengths(seqs)
        qs = self._propose_all(seqs, ns) if any(ns) else [None] * len(seqs)
        for i, s in enumerate(seqs):
            c = s.chooser.constraints
            if ns[i] and c is not None:
                # a drafted token the grammar forbids is a sure rejection: verify no row after it
                ns[i] = c.allowed_prefix(self._draft[s.slot, :ns[i]])
        drafted = list(ns)
        # (not while calibration's fixed schedule stands in for the gate: it measures whole lengths)
        if self.confidence is not None and isinstance(gate, DraftLength) and not self._pad:
            self._verify_by_confidence(seqs, ns, gate)
        # verify: every sequence's [pending, d1..dn] in one target decode (padded to the longest block where
        # the target's memory splits a batch into equal rows per sequence: __init__), after a joining
        # request's prompt tail (its rows no outputs)
        heads = np.array([len(s.head) for s in seqs], dtype=np.int32)
        lens = np.array([n + 1 for n in ns], dtype=np.int32)
        if self._pad:
            lens[:] = lens.max()
        saved = [s.rollback.save(int(m) - 1) for s, m in zip(seqs, lens)]
        lens += heads
        row0 = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int32)    # each sequence's first row
        out0 = np.concatenate(([0], np.cumsum(lens - heads)[:-1]))             # ... and first output
        total = int(lens.sum())
        rows = self._rows[:total]
        for i, s in enumerate(seqs):
            r = row0[i] + heads[i]
            rows[row0[i]:r] = s.head
            rows[r:row0[i] + lens[i]] = s.pending          # the padding repeats a valid token id
            rows[r + 1:r + 1 + ns[i]] = self._draft[s.slot, :ns[i]]
        greedy = any(s.greedy for s in seqs)
        argmax = self._argmax[:total - int(heads.sum())] if greedy else None
        t0 = time.perf_counter()
        if len(seqs) == 1:
            self.target.decode(rows, len(seqs[0].cache), out_row0=int(heads[0]), argmax=argmax, seq=seqs[0].slot)
        else:
            self.target.decode_seqs(np.array([s.slot for s in seqs], dtype=np.int32),
                                    np.array([len(s.cache) for s in seqs], dtype=np.int32), lens, rows, argmax,
                                    out_row0=heads)
        dt = (time.perf_counter() - t0) / len(seqs)
        steps = []
        for i, s in enumerate(seqs):
            h = int(heads[i])
            if h:
                s.stats.t_prefill += dt   # the prompt's rows and the first token, as a prefill gives it
            else:
                s.stats.t_verify += dt
            n, r, o = ns[i], int(row0[i]) + h, int(out0[i])
            draft = self._draft[s.slot, :n]
            if s.greedy:
                commit = greedy_accept(draft, self._argmax[o:o + n + 1])
            else:
                commit = sampled_accept(draft, lambda j, r=r: self.target.logits_row(r + j), s.chooser, qs[i])
            a = len(commit) - 1
            copied = bool(s.copied)
            if self.confidence is not None and drafted[i] and not s.lattice and not copied:
                self.confidence[s.chooser.sp.greedy].observe(self._conf[s.slot, :drafted[i]], n, a)
                s.stats.unverified += drafted[i] - n
            s.stats.observe_step(n, a)
            if copied:
                s.stats.observe_copy(n, a)
                s.copy_rates.record(n, a)
            elif n and s.copy is not None:
                s.draft_rates.record(n, a)
            commit = cut_at_stop(commit, s.stop)
            self._sink_rows(s, len(s.cache) + h, r, len(commit))
            steps.append(Step(len(s.cache), n, a, commit, rows[row0[i]:row0[i] + lens[i]].copy(), int(row0[i]),
                              saved[i], h, copied))
        return steps, gate, choice

    def _verify_by_confidence(self, seqs: list[Slot], ns: list[int], gate: DraftLength) -> None:
        """Cut the gated sequences' drafted blocks to the rows worth verifying by the drafter's calibrated
        confidence in them (:mod:`.confidence`), weighed with the gate's measured step costs; the
        sequences the gate does not choose for (a seeded sampled request keeps its fixed blocks: its text
        must not follow this machine's timings) and DFlash2 lattices keep theirs."""
        cut = [i for i, s in enumerate(seqs) if ns[i] > 1 and s.gate is not None and not s.lattice and not s.copied]
        if not cut:
            return
        rates = [self.confidence[seqs[i].chooser.sp.greedy].rates(self._conf[seqs[i].slot, :ns[i]]) for i in cut]
        n_gated = sum(1 for s in seqs if s.gate is not None)
        for i, k in zip(cut, allocate(rates, rows_cost(gate.step_cost(), n_gated))):
            ns[i] = k

    def _settle(self, done: list[tuple[Slot, Step, int]]) -> None:
        """Keep the first ``consumed`` tokens of each ``(slot, step, consumed)`` of one step in both caches,
        roll the rest back. Every sequence's features are read from the verify's graph before any
        rollback runs: a checkpoint rollback re-decodes the kept rows, which replaces that graph."""
        if self.closed:
            return
        for s, st, consumed in done:
            if s.features is None:
                continue
            t0 = time.perf_counter()
            if st.n == 0 or st.copied:
                # a plain or a copied step's rows (no draft ran: the drafter's cache is where it was): on the host
                s.features.keep(st.pos, st.head + consumed, st.row0)
            else:
                s.features.inject(st.pos, consumed, "injecting verified features into the drafter", row0=st.row0)
            s.stats.t_inject += time.perf_counter() - t0
        for s, st, consumed in done:
            t1 = time.perf_counter()
            if st.head + consumed < len(st.rows):
                s.rollback.keep(st.pos, st.head + consumed, st.rows, st.saved)
            s.stats.t_rollback += time.perf_counter() - t1
            if st.head:            # the prompt's tail is in the caches whatever the step keeps
                s.cache.extend(int(t) for t in s.head)
                s.head = NO_HEAD
            if consumed:
                if s.copy is not None:
                    s.copy.extend(st.commit[:consumed])
                s.chooser.accept(st.commit[:consumed])
                s.cache.append(s.pending)
                s.cache.extend(st.commit[:consumed - 1])
                s.pending = st.commit[consumed - 1]

    def _record(self, steps: list[tuple[Slot, Step]], gate: DraftLength | None, choice: int, seconds: float) -> None:
        """Charge the gate a step's whole work (draft with any deferred feature injection, verify,
        acceptance, sampling, keeping the rows and rolling back): what a step of that length costs.
        A step with a copied block is no step of the drafter's (prompt lookup: its own costs, by rows)."""
        if any(st.head for _, st in steps):
            return   # a prompt's tail made the step a prefill's share dearer (_lengths)
        if self.n_copy and all(st.n == 0 or st.copied for _, st in steps):    # no draft ran
            self.copy_costs.record(sum(st.n + 1 for _, st in steps), seconds)
        if gate is None or any(st.copied for _, st in steps):
            return   # no gate chose, or a copy replaced a block the gate chose
        gated = [st for s, st in steps if s.gate is not None]
        # an acceptance probe of a batch drafted for one sequence (_lengths): the others drew nothing
        draws = [st for st in gated if st.n > 0] if gate.probing and len(steps) > 1 else gated
        for i, st in enumerate(draws or gated[:1]):
            gate.record(choice if len(steps) > 1 else st.n, st.accepted, seconds / len(gated), same_step=i > 0,
                        batch=len(gated))

    # ------------------------------------------------------------------ requests
    def _check(self, prompt: Sequence[int]) -> list[int]:
        if len(prompt) == 0:
            raise InvalidArgumentError("the prompt is empty: pass at least one token (e.g. BOS)")
        if len(prompt) > self.n_ctx:
            raise ContextOverflowError(f"prompt of {len(prompt)} tokens exceeds the context ({self.n_ctx})")
        bad = [t for t in prompt if not 0 <= int(t) < self._vocab]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} outside the vocabulary (0..{self._vocab - 1})")
        return list(map(int, prompt))

    def _begin(self, s: Slot, prompt: list[int], max_tokens: int, sp: SamplingParams, stats: GenerationStats,
               stop: set[int] | frozenset[int], use_draft: bool, index: int = -1, defer: bool = False,
               constraints: Constraints | None = None, logits_sink=None, sink_from: int = 0) -> None:
        """Start a request on slot ``s``: both caches to ``prompt[:-1]`` (reusing what they share); with
        ``defer``, only the reuse: the rest of the prompt waits in ``s.todo`` (see :meth:`_prefill_chunk`).
        ``constraints``: the request's logits processors and grammar (closed when it ends); ``logits_sink``:
        see :class:`~dflash_gguf.decoding.sequence.Request`."""
        s.t_start = time.perf_counter()
        s.logits_sink, s.sink_from = logits_sink, sink_from
        s.index, s.produced, s.max_tokens, s.stop, s.stats = index, 0, max_tokens, stop, stats
        s.chooser = TokenChooser(sp, constraints)
        # greedy rows read the target's argmax ids; penalties, processors and grammars judge the logits
        s.greedy = sp.greedy and not sp.has_penalties and s.chooser.constraints is None
        s.n_draft = self.n_draft if (use_draft and self.drafter is not None) else 0
        # the gate's choices follow measured timings, which changes how a sampled request consumes its
        # random numbers: a repeatable (seeded) request keeps fixed drafting (the same text every time),
        # any other is gated like a greedy one, with its own acceptance history (sampled acceptance is lower)
        s.gate = None
        if s.n_draft:
            s.gate = self.gate if sp.greedy else (None if sp.is_repeatable else self.gate_sampled)
        # DFlash2, sampled: propose from the selector's distribution (the drafter's own proposer only)
        s.lattice = self.lattice is not None and not sp.greedy and type(self.proposer) is DrafterProposer
        # DSpark, sampled: proposals drawn through its Markov chain (the drafter's own proposer only)
        s.markov = self.markov is not None and not sp.greedy and type(self.proposer) is DrafterProposer
        # prompt lookup: the prompt's n-grams, the request's own acceptance of copies (and of drafted blocks)
        s.copy = None
        if use_draft and self.n_copy:
            o = self.opts.ngram
            s.copy = NgramIndex(o.max_ngram, o.min_ngram, prompt)
            s.copy_rates, s.draft_rates, s.copy_declined = Rates(self.n_copy), Rates(max(self.n_draft, 1)), 0
        s.copied = []
        s.done = False
        stats.n_prompt = len(prompt)
        n_keep = self.keep_prefix(common_prefix_len(s.cache, prompt[:len(prompt) - 1]), s.slot)
        stats.n_reused = n_keep
        todo = np.asarray(prompt[n_keep:-1], dtype=np.int32)
        s.prompt, s.todo, s.head = prompt, None, NO_HEAD
        if len(todo) and defer:
            s.todo = todo
            s.cache = prompt[:n_keep]
            return
        # the prompt's tail goes with its last token into the first step (alone here: the step is this one's)
        h = min(len(todo), self._fusable(s, []))
        if len(todo) > h:
            try:
                self._prefill(s, todo[:len(todo) - h], n_keep, stats, end=len(prompt) - 1)
            except BaseException:
                self._reset_seq(s)   # a half-filled cache is worse than an empty one
                s.done = True
                raise
        s.cache = prompt[:len(prompt) - 1 - h]
        s.head = todo[len(todo) - h:]
        s.pending = prompt[-1]

    def _finished(self, s: Slot, st: Step | None) -> bool:
        """Whether the request on ``s`` ends after step ``st`` (sets ``stats.finish``)."""
        if st is not None and st.commit and st.commit[-1] in s.stop:
            s.stats.finish = "stop"
        elif s.produced >= s.max_tokens:
            s.stats.finish = "length"
        elif len(s.cache) >= self.n_ctx:
            s.stats.finish = "context"
        else:
            return False
        return True

    def _end(self, s: Slot) -> None:
        """A request leaves slot ``s``. Rows its plain steps kept on the host stay there: the next draft
        on this slot injects them if the next request shares them, keep_prefix drops them if not."""
        if s.done:
            return
        s.done = True
        s.head = NO_HEAD   # a prompt tail never decoded (the request ended first): the caches hold s.cache
        if s.chooser is not None and s.chooser.constraints is not None:
            s.chooser.constraints.close()
        # nothing of the request stays on its slot while the slot waits for the next one (a logprobs
        # request's row collector, the consumer and its request, the sampler with its history)
        s.chooser = s.logits_sink = s.consumer = s.request = None
        s.stats.t_total += time.perf_counter() - s.t_start
        if not self._prior_checked and not self.closed:
            self._prior_checked = any(calibration.check_prior(self, self._costs, g)
                                      for g in (self.gate, self.gate_sampled) if g is not None)
        if self._keep and not self.closed and type(self.proposer) is DrafterProposer and self._draws() > self._kept_draws:
            self._kept_draws = self._draws()
            greedy = max((g for g in (self.gate, *self._batch_gates.values()) if g is not None),
                         key=lambda g: g.tries[0])
            history.keep(self, {"greedy": greedy, "sampled": self.gate_sampled})

    def _draws(self) -> int:
        """Steps the gates have chosen so far (what they know grows with them)."""
        return sum(g.steps for g in (self.gate, self.gate_sampled, *self._batch_gates.values()) if g is not None)

    def _check_servers(self) -> None:
        """Raise RpcLostError if a model of this decoder lost an rpc-server (dflash_gguf.rpc)."""
        for ctx in (self.target, self.drafter):
            check = getattr(ctx.model, "rpc_check", None) if ctx is not None else None
            if check is not None:
                check()

    def generate(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stats: GenerationStats | None = None, stop_tokens: Sequence[int] | None = None,
                 use_draft: bool = True, constraints: Constraints | None = None,
                 logits_sink=None) -> Iterator[int]:
        """Yield the target's tokens for ``prompt`` (exactly those plain decoding would give), on slot 0.

        Stops after an end-of-generation / stop token (which is yielded), after ``max_tokens``, or
        when the context is full. ``stats`` (optional) is filled in as it goes. ``constraints``: logits
        processors and a grammar, as llama_cpp applies them (the decoder closes it at the end);
        ``logits_sink(position, row)``: every prompt row's and committed token's logits (logits_all).
        """
        sp = sampling or SamplingParams()
        stats = stats if stats is not None else GenerationStats()
        prompt = self._check(prompt)
        return self._run_one(prompt, max_tokens, sp, stats,
                             self.eog if stop_tokens is None else set(map(int, stop_tokens)), use_draft, constraints,
                             logits_sink)

    def _run_one(self, prompt: list[int], max_tokens: int, sp: SamplingParams, stats: GenerationStats,
                 stop: set[int] | frozenset[int], use_draft: bool, constraints: Constraints | None,
                 logits_sink) -> Iterator[int]:
        s = self.seqs[0]
        self._begin(s, prompt, max_tokens, sp, stats, stop, use_draft, constraints=constraints,
                    logits_sink=logits_sink)
        self._prev_gate = None   # the caller's own work came between: the first step's cost is no settled one
        try:
            st = None
            while not self._finished(s, st):
                t_step = time.perf_counter()   # the gate is charged the step's work, not the consumer's time
                try:
                    (st,), gate, choice = self._advance([s])
                except DecodeError:
                    self._check_servers()   # a lost rpc-server explains a failed draft or verify: RpcLostError
                    raise
                t_work = time.perf_counter() - t_step
                consumed = 0
                try:
                    for tok in st.commit:
                        consumed += 1
                        s.produced += 1
                        stats.n_generated += 1
                        yield tok
                finally:
                    t_fin = time.perf_counter()
                    self._settle([(s, st, consumed)])
                    t_work += time.perf_counter() - t_fin
                self._record([(s, st)], gate, choice, t_work)
        finally:
            self._end(s)
