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

A decoder serves ``target.n_seq`` sequences (slots; llama.cpp sequence ids). Requests run through one
path: :meth:`~DFlashDecoder.admit` starts one on a free slot, :meth:`~DFlashDecoder.step` takes one step of
every running request and hands each its committed tokens (:meth:`DFlashDecoder.run`: many requests, a
request joining as soon as a slot is free). :meth:`DFlashDecoder.generate` is that path's one-request case
on slot 0, as a generator whose caller is the consumer, a token at a time (``dflash_gguf.Llama``); it must
not run while other requests run on the slots.

A step's block may instead be copied by prompt lookup (:mod:`.ngram`, ``SpecOptions.ngram``): with no drafter
at all (any target: no taps, no features, only the verify of copied blocks), or beside one, per sequence and
step, where the draft policy expects the copy to give more tokens per second. A copied step runs no draft:
for the drafter it is a plain step, whose committed rows' features are kept on the host and injected before
its next draft (:mod:`.features`).

The phases live in their own modules: :mod:`.policy` (how many tokens to draft and verify), :mod:`.proposer`
(draft), :mod:`.acceptance` (accept), :mod:`.rollback` (one object per memory kind), :mod:`.stats`
(statistics); this module sequences them.
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

from dflash_gguf.native import _bindings as B
from dflash_gguf.decoding.constraints import Constraints
from dflash_gguf.native.engine import Context, DrafterInfo, clamp_n_draft
from dflash_gguf.errors import BusyError, ContextOverflowError, InvalidArgumentError
from dflash_gguf.decoding.gate import DraftLength
from dflash_gguf.decoding import calibration
from dflash_gguf.decoding.sampling import SamplingParams, TokenChooser
from dflash_gguf.decoding.acceptance import cut_at_stop, greedy_accept, sampled_accept
from dflash_gguf.decoding.features import FeatureFeed
from dflash_gguf.decoding.policy import DraftPolicy
from dflash_gguf.decoding.ngram import NgramIndex, NgramOptions, Rates
from dflash_gguf.decoding.prompts import TAP_ROWS, Prompts
from dflash_gguf.decoding.proposer import DrafterProposer, LatticeProposer, MarkovProposer, Proposer
from dflash_gguf.decoding.rollback import make_rollback
from dflash_gguf.decoding.scheduling import Scheduling, common_prefix_len
from dflash_gguf.decoding.sequence import NO_HEAD, Request, Slot, Step
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
    # where prompt lookup's matches come from: made per request as ``copy_index(max_ngram, min_ngram, prompt)``
    # (a benchmark puts a replay in its place)
    copy_index = NgramIndex

    def __init__(self, target: Context, drafter: Context | None, opts: SpecOptions | None = None,
                 proposer: Proposer | None = None):
        self.target = target
        self.drafter = drafter
        self.opts = opts or SpecOptions()
        self._proposer = proposer or DrafterProposer()
        self.info: DrafterInfo | None = None
        self.n_draft = 0
        self.n_seq = target.n_seq
        self.n_ctx = target.n_ctx          # positions per sequence
        # KV cells every sequence shares (ContextOptions.shared: one cache of n_ctx cells; requests are admitted
        # and, when it runs out, give way by cells: scheduling), None where each sequence has n_ctx of its own
        self.n_cells = target.n_cells if getattr(target.opts, "shared", False) and self.n_seq > 1 else None
        self._admitted = 0                 # requests admitted so far (Slot.order)
        self.preempted = 0                 # ... and how often one gave its cells back to resume later
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
        gated = self.opts.adaptive and self.n_draft > 0
        # a DSpark drafter's confidence in each drafted token, and what the target made of such scores
        confident = self.info is not None and (self.info.has_confidence or self.proposer.confidence)
        self.policy = DraftPolicy(self.n_draft, gated, confident, self.n_copy, self.opts.adaptive)
        self._free: deque[Slot] = deque(self.seqs)   # slots without a request (run, admit, step)
        self._active: list[Slot] = []                # ... with a running one
        self._ended: list[Slot] = []                 # ... whose request ended at admission (reported by step)
        self._filling: deque[Slot] = deque()         # ... whose prompt is still being prefilled, a chunk per step
        self.closed = False            # set when the contexts are freed: a late generator cleanup then does nothing
        self._vocab = target.model.n_vocab
        bs = max(self.n_draft, self.n_copy) + 1
        self._draft = np.zeros((self.n_seq, bs), dtype=np.int32)
        self._conf = np.zeros((self.n_seq, bs), dtype=np.float32)
        # a step's rows: every sequence's block, and a joining request's prompt tail (_fusable)
        self._rows = np.zeros(max(self.n_seq * bs, self.tap_rows), dtype=np.int32)
        self._argmax = np.zeros(len(self._rows), dtype=np.int32)
        self.eog = frozenset(int(t) for t in target.model.eog_tokens)   # default stop tokens
        self.reset()   # the decoder owns both caches from here on
        if gated and self.opts.calibrate:   # this machine's step costs, cached per pair and machine
            costs = calibration.step_costs(self)
            self.policy.start_from(costs, lambda g: calibration.check_prior(self, costs, g))
        # (the drafter's own proposals only: a replay or an oracle is not the pair's acceptance)
        if self.opts.keep_history and gated and type(self.proposer) is DrafterProposer:
            self.policy.keep_history(self)
        log.debug("decoder ready: drafter=%s n_draft=%d rollback=%s sequences=%d", self.info, self.n_draft,
                  self.rollback, self.n_seq)

    # ------------------------------------------------------------------ the draft policy's gates
    @property
    def gate(self) -> DraftLength | None:
        """The speed gate of greedy requests drafting alone (None: not gated)."""
        return self.policy.gate

    @gate.setter
    def gate(self, gate) -> None:   # calibration's fixed schedule stands in for it while it measures
        self.policy.gate = gate

    @property
    def gate_sampled(self) -> DraftLength | None:
        """The speed gate of sampled requests without a seed."""
        return self.policy.gate_sampled

    @property
    def confidence(self):
        """What the target made of the drafter's confidence scores (None: the drafter gives none)."""
        return self.policy.confidence

    @property
    def proposer(self) -> Proposer:
        """Where each step's drafted tokens come from (:mod:`.proposer`)."""
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        # proposals not the drafter's own (a replay, an oracle) start the gates afresh and are not kept as the
        # pair's acceptance; one that scores its tokens (a replayed trace) is read through the confidence from
        # then on, whatever the drafter (the calibration of the scores starts empty)
        self._proposer = proposer
        if type(proposer) is not DrafterProposer:
            self.policy.forget_history()
        if proposer.confidence and self.n_draft > 0:
            self.policy.score_tokens()

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

    def rebind(self) -> None:
        """Set the target context's taps as this decoder reads them again, after another decoder with other
        settings (a Llama's own, of one sequence) used the same context (the server's shared slots)."""
        if self.drafter is None:
            return
        cinfo = B.ffi.new("struct llama_dflash_drafter_info *")
        B.check(B.lib.llama_dflash_prepare(self.target.cptr, self.drafter.cptr, cinfo), "pairing the drafter again")
        B.check(B.lib.llama_dflash_set_taps_direct(self.target.cptr, True), "reading taps from the target's graph")
        B.check(B.lib.llama_dflash_set_tap_rows_max(self.target.cptr, self.tap_rows), "capping the target's taps")

    def _reset_seq(self, s: Slot) -> None:
        self.target.clear_seq(s.slot)
        if self.drafter is not None:
            self.drafter.clear_seq(s.slot)
            s.features.clear()
        s.cache = []

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
        plan = self.policy.plan(seqs, self.n_ctx, self._pad)
        ns = plan.lengths
        qs = self._propose_all(seqs, ns) if any(ns) else [None] * len(seqs)
        proposed = list(ns)
        for i, s in enumerate(seqs):
            c = s.chooser.constraints
            if ns[i] and c is not None:
                # a drafted token the grammar forbids is a sure rejection: verify no row after it
                ns[i] = c.allowed_prefix(self._draft[s.slot, :ns[i]])
        drafted = list(ns)
        self.policy.verify_rows(seqs, plan, self._conf, self._pad)
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
            if self.policy.confidence is not None and drafted[i] and not s.lattice and not copied:
                self.policy.observe_scores(s, self._conf[s.slot, :drafted[i]], n, a)
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
                              saved[i], h, copied, proposed[i]))
        return steps, plan

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
               stop: set[int] | frozenset[int], use_draft: bool, index: int = -1,
               constraints: Constraints | None = None, logits_sink=None, sink_from: int = 0) -> None:
        """Start a request on slot ``s``: both caches keep what they share with ``prompt[:-1]``, the rest of
        the prompt waits in ``s.todo`` for the steps to prefill (see :meth:`_prefill_chunk`).
        ``constraints``: the request's logits processors and grammar (closed when it ends); ``logits_sink``:
        see :class:`~dflash_gguf.decoding.sequence.Request`."""
        s.t_start = time.perf_counter()
        s.logits_sink, s.sink_from = logits_sink, sink_from
        s.index, s.produced, s.max_tokens, s.stop, s.stats = index, 0, max_tokens, stop, stats
        s.chooser = TokenChooser(sp, constraints)
        # greedy rows read the target's argmax ids; penalties, processors and grammars judge the logits
        s.greedy = sp.greedy and not sp.has_penalties and s.chooser.constraints is None
        s.n_draft = self.n_draft if (use_draft and self.drafter is not None) else 0
        # gated, sampled requests with an acceptance history of their own (sampled acceptance is lower)
        s.gate = self.policy.gate_for(sp) if s.n_draft else None
        # sampled requests whose text may follow what is drafted (not seeded ones: their text is the same
        # whatever the drafts, which point-mass proposals keep: sampling.TokenChooser) propose from the
        # drafter's own distribution, with the drafter's own proposer: DFlash2 from its selector's lattice,
        # DSpark through its Markov chain
        own = not sp.greedy and not sp.is_repeatable and type(self.proposer) is DrafterProposer
        s.lattice = self.lattice is not None and own
        s.markov = self.markov is not None and own
        # prompt lookup: the prompt's n-grams, the request's own acceptance of copies (and of drafted blocks)
        s.copy = None
        if use_draft and self.n_copy:
            o = self.opts.ngram
            s.copy = self.copy_index(o.max_ngram, o.min_ngram, prompt)
            s.copy_rates, s.draft_rates, s.copy_declined = Rates(self.n_copy), Rates(max(self.n_draft, 1)), 0
        s.copied = []
        s.done = False
        stats.n_prompt = len(prompt)
        n_keep = self.keep_prefix(common_prefix_len(s.cache, prompt[:len(prompt) - 1]), s.slot)
        stats.n_reused = n_keep
        s.prompt, s.todo, s.head = prompt, np.asarray(prompt[n_keep:-1], dtype=np.int32), NO_HEAD
        s.cache = prompt[:n_keep]

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
        if not self.closed:
            self.policy.request_ended(self, own_proposals=type(self.proposer) is DrafterProposer)

    def _check_servers(self) -> None:
        """Raise RpcLostError if a model of this decoder lost an rpc-server (dflash_gguf.native.rpc)."""
        for ctx in (self.target, self.drafter):
            check = getattr(ctx.model, "rpc_check", None) if ctx is not None else None
            if check is not None:
                check()

    def generate(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stats: GenerationStats | None = None, stop_tokens: Sequence[int] | None = None,
                 use_draft: bool = True, constraints: Constraints | None = None,
                 logits_sink=None) -> Iterator[int]:
        """Yield the target's tokens for ``prompt`` (exactly those plain decoding would give): the one-request
        case of :meth:`admit` and :meth:`step`, with the caller as the consumer, a token at a time.

        Stops after an end-of-generation / stop token (which is yielded), after ``max_tokens``, or
        when the context is full. ``stats`` (optional) is filled in as it goes. ``constraints``: logits
        processors and a grammar, as llama_cpp applies them (the decoder closes it at the end);
        ``logits_sink(position, row)``: every prompt row's and committed token's logits (logits_all).
        A bad prompt raises here; nothing runs until the first token is asked for; a caller that stops
        iterating leaves both caches holding exactly what it took. No other request may run meanwhile.
        """
        r = Request(self._check(prompt), max_tokens, sampling, stop_tokens, use_draft,
                    stats if stats is not None else GenerationStats(), constraints=constraints,
                    logits_sink=logits_sink)
        return self._one(r)

    def _one(self, r: Request) -> Iterator[int]:
        if self.running:
            raise BusyError("generate() needs the decoder to itself: requests are running on its slots")
        self.admit(r, slot=0)    # the one-sequence view (cache, features) is slot 0's
        self.policy.interrupt()   # the caller's own work came between: the first step's cost is no settled one
        try:
            while self.running:
                _, taken = self._take_step()
                if taken is None:
                    continue          # the prompt went in and the request ended there (or failed)
                consumed = 0
                commit = taken.steps[0].commit
                try:
                    for tok in commit:
                        consumed += 1
                        yield tok
                finally:
                    if consumed < len(commit):   # the caller stopped taking tokens (it says not why)
                        taken.ended.add(taken.active[0].slot)
                        taken.stop = False
                    self._keep_step(taken, [consumed])
            if r.error is not None:
                raise r.error
        finally:
            self.abandon()
