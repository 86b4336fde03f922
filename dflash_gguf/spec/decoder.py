"""The DFlash block draft-verify loop, driven from Python over the patched libllama.

One step (target KV holds ``P`` tokens, ``pending`` is the last chosen token, not yet decoded):

1. ``draft``   - the drafter decodes ``[pending, mask x n]`` at ``P..P+n`` and proposes ``d1..dn``
                 (one C call; the noise block never stays in the drafter's cache);
2. ``verify``  - the target decodes ``[pending, d1..dn]`` in one pass; greedy reads only the
                 per-row argmax ids, sampling reads the logits rows it needs;
3. ``accept``  - the longest agreeing prefix ``d1..da`` plus the target's own next token;
4. ``commit``  - yield the tokens; when the consumer has what it wants (all of them, or it stops
                 early at EOS, max_tokens or a stop string), inject the features of the committed
                 rows into the drafter and roll the target back to ``P + k`` - in ``finally``, so a
                 consumer that stops iterating leaves both caches exactly where plain decoding would.

The phases live in their own modules: :mod:`.proposer` (draft), :mod:`.acceptance` (accept),
:mod:`.rollback` (one object per memory kind), :mod:`.stats` (statistics); this module sequences them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from dflash_gguf import _bindings as B
from dflash_gguf.engine import Context, DrafterInfo, clamp_n_draft
from dflash_gguf.errors import ContextOverflowError, DFlashError, InvalidArgumentError
from dflash_gguf.gate import DraftLength
from dflash_gguf.spec import calibration
from dflash_gguf.sampling import SamplingParams, TokenChooser
from dflash_gguf.spec.acceptance import cut_at_stop, greedy_accept, sampled_accept
from dflash_gguf.spec.features import FeatureFeed
from dflash_gguf.spec.proposer import DrafterProposer, LatticeProposer, Proposer
from dflash_gguf.spec.rollback import make_rollback
from dflash_gguf.spec.stats import GenerationStats

# target rows whose taps a decode keeps (llama_dflash_set_tap_rows_max): a verify block and the
# prompt's last rows in chunks of this many; five taps of a 2048-wide target cost 2.6 MiB of its
# compute buffer at 64 rows instead of 21 MiB for a 512-row ubatch (BENCHMARKS.md section 7)
TAP_ROWS = 64

log = logging.getLogger("dflash_gguf.spec")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = np.asarray(a[:n], dtype=np.int64) == np.asarray(b[:n], dtype=np.int64)
    return n if eq.all() else int(np.argmin(eq))


@dataclass
class SpecOptions:
    n_draft: int | None = None   # tokens drafted per block; default and maximum: block_size - 1
    rollback: str = "auto"       # auto | seq_rm | snapshot | checkpoint
    adaptive: bool = False       # speed gate: draft per step as many tokens as pays (gate.DraftLength)
    calibrate: bool = True       # ... starting from this machine's measured step costs (spec.calibration)
    sample_lattice: bool = True  # DFlash2 at temperature > 0: draft from the selector's top-k distribution


class DFlashDecoder:
    """Runs lossless DFlash generation on a target context and a drafter context.

    The drafter context must have been created with ``other=target`` (it borrows the target's
    embeddings and LM head). With ``drafter=None`` the same loop decodes plainly, one token per
    step: the baseline the benchmarks and tests compare against. ``proposer`` (default: the
    drafter) may replace the proposals, see :mod:`dflash_gguf.spec.proposer`.
    """

    def __init__(self, target: Context, drafter: Context | None, opts: SpecOptions | None = None,
                 proposer: Proposer | None = None):
        self.target = target
        self.drafter = drafter
        self.opts = opts or SpecOptions()
        self.proposer = proposer or DrafterProposer()
        self.info: DrafterInfo | None = None
        self.features: FeatureFeed | None = None
        self.n_draft = 0
        self.tap_rows = target.n_ubatch
        if drafter is not None:
            cinfo = B.ffi.new("struct llama_dflash_drafter_info *")
            B.check(B.lib.llama_dflash_prepare(target.cptr, drafter.cptr, cinfo),
                    f"pairing drafter {drafter.model.path.name} with target {target.model.path.name}")
            # taps are read from the target's graph, not copied to its output buffer (patch 0010):
            # every decode of this loop is at most one target ubatch (prefill chunks, verify blocks)
            B.check(B.lib.llama_dflash_set_taps_direct(target.cptr, True), "reading taps from the target's graph")
            # ... and only their last TAP_ROWS rows are kept (patch 0011): rows whose features the
            # drafter needs are decoded in chunks of at most that many, verify blocks included
            self.tap_rows = min(TAP_ROWS, target.n_ubatch)
            B.check(B.lib.llama_dflash_set_tap_rows_max(target.cptr, self.tap_rows), "capping the target's taps")
            self.info = DrafterInfo.from_c(cinfo)
            if self.info.kind in ("dflash", "dflash2"):
                # the drafter's graph gives argmax ids, not a block of logits (patch 0013)
                B.check(B.lib.llama_dflash_set_draft_ids(drafter.cptr, True), "drafting by ids")
            self.features = FeatureFeed(target, drafter, self.info)
            self.n_draft = clamp_n_draft(self.info, self.opts.n_draft, n_batch=self.tap_rows,
                                         n_ubatch=drafter.n_ubatch)
        self.lattice: LatticeProposer | None = None
        if self.info is not None and self.info.kind == "dflash2" and self.opts.sample_lattice and self.info.selector_top_k:
            self.lattice = LatticeProposer(self.info.selector_top_k, self.n_draft)
        self._rollback = make_rollback(target, self.n_draft, self.opts.rollback)
        gated = self.opts.adaptive and self.n_draft > 0
        self.gate = DraftLength(self.n_draft) if gated else None            # greedy requests
        self.gate_sampled = DraftLength(self.n_draft) if gated else None    # sampled requests without a seed
        self.cache: list[int] = []     # tokens whose KV is in the target (and features in the drafter)
        self.closed = False            # set when the contexts are freed: a late generator cleanup then does nothing
        self._vocab = target.model.n_vocab
        bs = max(self.n_draft + 1, 1)
        self._draft = np.zeros(bs, dtype=np.int32)
        self._verify = np.zeros(bs, dtype=np.int32)
        self._argmax = np.zeros(bs, dtype=np.int32)
        self.eog = frozenset(int(t) for t in target.model.eog_tokens)   # default stop tokens
        self.reset()   # the decoder owns both caches from here on
        costs = calibration.step_costs(self) if gated and self.opts.calibrate else None   # cached per pair and machine
        if costs is not None:
            self.gate = DraftLength(self.n_draft, costs)
            self.gate_sampled = DraftLength(self.n_draft, costs)
        log.debug("decoder ready: drafter=%s n_draft=%d rollback=%s", self.info, self.n_draft, self.rollback)

    @property
    def rollback(self) -> str:
        """The rollback kind in use: seq_rm, snapshot or checkpoint."""
        return self._rollback.name

    def reset(self) -> None:
        self.target.clear()
        if self.drafter is not None:
            self.drafter.clear()
            self.features.clear()
        self.cache = []

    # ------------------------------------------------------------------ caches
    def keep_prefix(self, n: int) -> int:
        """Cut both caches back to the first ``n`` cached tokens; returns how many are kept.

        Recurrent state: llama.cpp accepts any rollback within n_rs_seq, but its snapshots only cover
        the rows of the last decode (a 1-token step leaves the older slots stale), so a partial
        removal could silently restore the wrong state: both caches are cleared instead (0 kept)
        and the caller re-evaluates.
        """
        n = min(n, len(self.cache))
        if n == len(self.cache) and self.target.pos_max() < n:
            return n                      # nothing beyond the prefix to remove
        ok = self._rollback.partial_prefix and self.target.truncate(n)
        if ok and self.drafter is not None:
            ok = self.drafter.truncate(n)
            self.features.truncate(n)
        if not ok:
            log.debug("partial cache removal refused at %d; re-evaluating", n)
            self.reset()
            return 0
        self.cache = self.cache[:n]
        return n

    def feed(self, tokens: Sequence[int]) -> None:
        """Decode ``tokens`` after the cached ones into both caches (no sampling)."""
        if len(self.cache) + len(tokens) > self.target.n_ctx:
            raise ContextOverflowError(f"{len(tokens)} more tokens do not fit the context ({self.target.n_ctx})")
        self._prefill(np.asarray(tokens, dtype=np.int32), len(self.cache), GenerationStats())
        self.cache.extend(int(t) for t in tokens)

    def _sync_prefix(self, prompt: Sequence[int]) -> int:
        """Keep the longest cached prefix usable for ``prompt`` (at least one token stays to decode)."""
        return self.keep_prefix(common_prefix_len(self.cache, prompt[:len(prompt) - 1]))

    def _inject(self, pos: int, n: int, what: str, end: int | None = None) -> None:
        """Features of the target's last-decoded rows ``0..n`` (at ``pos``) into the drafter's cache."""
        if self.features is not None:
            self.features.inject(pos, n, what, end)

    # ------------------------------------------------------------------ phases
    def _prefill(self, tokens: np.ndarray, pos0: int, stats: GenerationStats) -> None:
        t0 = time.perf_counter()
        end = pos0 + len(tokens)
        # rows the drafter will attend to (its window's worth at the end) are decoded TAP_ROWS at a
        # time and injected; the rest in whole ubatches (one per decode: direct taps), nothing kept
        split = 0
        if self.features is not None and self.features.window:
            split = min(max(end - self.features.window - pos0, 0), len(tokens))
        elif self.features is None:
            split = len(tokens)
        step = self.target.n_ubatch   # llama.cpp keeps n_ubatch <= n_batch
        for off in range(0, split, step):
            chunk = tokens[off:min(off + step, split)]
            self.target.decode(chunk, pos0 + off, out_row0=len(chunk))
        step = self.tap_rows
        for off in range(split, len(tokens), step):
            chunk = tokens[off:off + step]
            self.target.decode(chunk, pos0 + off, out_row0=len(chunk))
            self._inject(pos0 + off, len(chunk), "injecting prompt features into the drafter", end)
        stats.t_prefill += time.perf_counter() - t0

    def _draft_block(self, pos: int, pending: int, n: int, stats: GenerationStats,
                     sample: TokenChooser | None = None) -> tuple[int, list | None]:
        """Draft up to ``n`` tokens into ``self._draft``; with ``sample`` (a sampled request on a DFlash2
        drafter) they are drawn from the selector's lattice and their distributions come back too."""
        if n <= 0:
            return 0, None
        t0 = time.perf_counter()
        self.features.flush()          # rows kept on the host during plain steps
        t1 = time.perf_counter()
        stats.t_inject += t1 - t0
        q = None
        if sample is not None:
            n, q = self.lattice.propose(self.drafter, pos, pending, n, self._draft, sample.rng, sample.sp.temperature)
        else:
            n = self.proposer.propose(self.drafter, pos, pending, n, self._draft, lambda: self.cache)
        stats.t_draft += time.perf_counter() - t1
        return n, q

    def _verify_block(self, pos: int, pending: int, n: int, greedy: bool, stats: GenerationStats) -> np.ndarray:
        """Decode ``[pending, d1..dn]`` at ``pos``; greedy reads the per-row argmax ids only."""
        rows = self._verify[:n + 1]
        rows[0] = pending
        rows[1:] = self._draft[:n]
        t0 = time.perf_counter()
        self.target.decode(rows, pos, out_row0=0, argmax=self._argmax[:n + 1] if greedy else None)
        stats.t_verify += time.perf_counter() - t0
        return rows

    def _finish_block(self, pos: int, k: int, rows: np.ndarray, saved: bytes | None, stats: GenerationStats) -> None:
        """Keep the first ``k`` rows of the verify batch in both caches (a plain step's row: on the host)."""
        if self.closed:
            return
        t0 = time.perf_counter()
        if self.features is not None and len(rows) == 1:
            self.features.keep(pos, k)
        else:
            self._inject(pos, k, "injecting verified features into the drafter")
        t1 = time.perf_counter()
        stats.t_inject += t1 - t0
        if k < len(rows):
            self._rollback.keep(pos, k, rows, saved)
        stats.t_rollback += time.perf_counter() - t1

    # ------------------------------------------------------------------ loop
    def generate(self, prompt: Sequence[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stats: GenerationStats | None = None, stop_tokens: Sequence[int] | None = None,
                 use_draft: bool = True) -> Iterator[int]:
        """Yield the target's tokens for ``prompt`` (exactly those plain decoding would give).

        Stops after an end-of-generation / stop token (which is yielded), after ``max_tokens``, or
        when the context is full. ``stats`` (optional) is filled in as it goes.
        """
        sp = sampling or SamplingParams()
        stats = stats if stats is not None else GenerationStats()
        if len(prompt) == 0:
            raise InvalidArgumentError("the prompt is empty: pass at least one token (e.g. BOS)")
        if len(prompt) > self.target.n_ctx:
            raise ContextOverflowError(f"prompt of {len(prompt)} tokens exceeds the context ({self.target.n_ctx})")
        bad = [t for t in prompt if not 0 <= int(t) < self._vocab]
        if bad:
            raise InvalidArgumentError(f"token id {bad[0]} outside the vocabulary (0..{self._vocab - 1})")
        return self._run(list(map(int, prompt)), max_tokens, sp, stats,
                         self.eog if stop_tokens is None else set(map(int, stop_tokens)), use_draft)

    def _start(self, prompt: list[int], stats: GenerationStats) -> int:
        """Bring both caches to ``prompt[:-1]`` (reusing what they share); returns the pending token."""
        stats.n_prompt = len(prompt)
        n_keep = self._sync_prefix(prompt)
        stats.n_reused = n_keep
        todo = np.asarray(prompt[n_keep:-1], dtype=np.int32)
        if len(todo):
            try:
                self._prefill(todo, n_keep, stats)
            except BaseException:
                self.reset()   # a half-filled cache is worse than an empty one
                raise
        self.cache = prompt[:-1]
        return prompt[-1]

    def _run(self, prompt: list[int], max_tokens: int, sp: SamplingParams, stats: GenerationStats,
             stop: set[int], use_draft: bool) -> Iterator[int]:
        t_start = time.perf_counter()
        pending = self._start(prompt, stats)
        chooser = TokenChooser(sp)
        greedy = sp.greedy and not sp.has_penalties
        n_draft = self.n_draft if (use_draft and self.drafter is not None) else 0
        # the gate's choices follow measured timings, which changes how a sampled request consumes its
        # random numbers: a repeatable (seeded) request keeps fixed drafting (the same text every time),
        # any other is gated like a greedy one, with its own acceptance history (sampled acceptance is lower)
        gate = None
        if n_draft:
            gate = self.gate if sp.greedy else (None if sp.is_repeatable else self.gate_sampled)
        # DFlash2, sampled: propose from the selector's distribution (the drafter's own proposer only)
        lattice = chooser if (self.lattice is not None and not sp.greedy and type(self.proposer) is DrafterProposer) else None
        produced = 0
        try:
            while produced < max_tokens:
                pos = len(self.cache)
                if pos >= self.target.n_ctx:
                    stats.finish = "context"
                    return
                t_step = time.perf_counter()   # the gate is charged the step's whole work, not the caller's time
                want = gate.choose() if gate is not None else n_draft
                n = min(want, max_tokens - produced - 1, self.target.n_ctx - pos - 1)
                n, q = self._draft_block(pos, pending, n, stats, lattice)
                saved = self._rollback.save(n)
                rows = self._verify_block(pos, pending, n, greedy, stats)
                if greedy:
                    commit = greedy_accept(self._draft[:n], self._argmax[:n + 1])
                else:
                    commit = sampled_accept(self._draft[:n], self.target.logits_row, chooser, q)
                a = len(commit) - 1
                stats.observe_step(n, a)
                commit = cut_at_stop(commit, stop)
                t_work = time.perf_counter() - t_step
                consumed = 0
                try:
                    for tok in commit:
                        consumed += 1
                        produced += 1
                        stats.n_generated += 1
                        yield tok
                finally:
                    t_fin = time.perf_counter()
                    self._finish_block(pos, consumed, rows, saved, stats)
                    if consumed:
                        chooser.accept(commit[:consumed])
                        self.cache.append(pending)
                        self.cache.extend(commit[:consumed - 1])
                        pending = commit[consumed - 1]
                    t_work += time.perf_counter() - t_fin
                if gate is not None:
                    # draft (with any deferred feature injection), verify, acceptance, sampling, keeping
                    # the rows and rolling back: everything a step of this length costs on this machine
                    gate.record(n, a, t_work)
                if commit[-1] in stop:
                    stats.finish = "stop"
                    return
            stats.finish = "length"
        finally:
            self._settle_features(stats)
            stats.t_total += time.perf_counter() - t_start

    def _settle_features(self, stats: GenerationStats) -> None:
        """At the end of a generation the drafter's cache holds every committed row again (rows of plain
        steps are batched on the host only within a generation)."""
        if self.features is None or self.closed or not self.features.n:
            return
        t0 = time.perf_counter()
        try:
            self.features.flush()
        except DFlashError as e:     # e.g. the drafter's context is full: drafting loses context, not exactness
            log.debug("drafter features not injected: %s", e)
            self.features.clear()
        stats.t_inject += time.perf_counter() - t0
