"""The one place a front door gets its engine: contexts, rollback, the drafter's context, the decoder.

``dflash_gguf.Llama`` (on llama_cpp's own target context), :class:`dflash_gguf.batch.BatchLlama`, the
server's ``--parallel`` slots and :func:`dflash_gguf.pair.open_pair` all go through here, so a rule about
how an engine is put together - how many tokens a block drafts, how a hybrid target rolls back and what
that may cost, how large the drafter's cache is, that a front door's decoder keeps the pair's acceptance
history and starts from this machine's measured step costs (:mod:`dflash_gguf.decoding.calibration`) -
has one home.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from dflash_gguf.decoding.decoder import DFlashDecoder, SpecOptions
from dflash_gguf.decoding.ngram import NgramOptions
from dflash_gguf.decoding.proposer import Proposer
from dflash_gguf.decoding.rollback import choose_for_memory, recurrent_state_bytes
from dflash_gguf.native.engine import Context, ContextOptions, DrafterInfo, Model, clamp_n_draft
from dflash_gguf.errors import InvalidArgumentError
from dflash_gguf.native.memory import release_free_heap

log = logging.getLogger("dflash_gguf.runtime")

# the context a hybrid target's recurrent state is measured on when no context of its own exists yet
_PROBE = ContextOptions(n_ctx=256, n_batch=256, n_ubatch=256)


@dataclass
class DraftSettings:
    """What a user says about drafting, whichever front door they came through."""
    n_max: int | None = None               # tokens drafted per block (None: the drafter's most; 0: none)
    adaptive: bool = True                  # the speed gate (dflash_gguf.decoding.gate): per step as many as pays
    window: int | None = None              # drafter context positions (None: the drafter's own window, else
                                           # DEFAULT_DRAFT_CACHE - block; 0: the whole context)
    rollback_memory_mb: float | None = None   # hybrid targets: the most memory rollback may take, all
                                              # sequences together (None: snapshots, the fastest)
    ngram: NgramOptions | None = None      # prompt lookup (decoding.ngram): copies with or without a drafter

    def __post_init__(self) -> None:
        if self.n_max is not None and self.n_max < 0:
            raise InvalidArgumentError(f"draft_n_max must be >= 0 (0: no drafting), got {self.n_max}")
        if self.window is not None and self.window < 0:
            raise InvalidArgumentError(f"draft_window must be >= 0 (0: the whole context), got {self.window}")
        if self.rollback_memory_mb is not None and self.rollback_memory_mb < 0:
            raise InvalidArgumentError(f"rollback_memory_mb must be >= 0, got {self.rollback_memory_mb}")


def snapshots(model: Model, drafter: Model | None, opts: ContextOptions, draft: DraftSettings,
              measure_on: Context | None = None) -> int:
    """Recurrent-state snapshots per sequence a target context needs (its ``n_rs_seq``): 0 for a target
    without recurrent state, without a drafter or drafting nothing, or where ``n_draft`` snapshots of every
    sequence's state exceed ``draft.rollback_memory_mb`` (then rollback restores one host checkpoint per
    sequence and replays the kept rows). The state is measured on ``measure_on`` (an empty context of the
    target) or on a small probe context; only under a cap."""
    if drafter is None or not (model.is_hybrid or model.is_recurrent):
        return 0
    per_seq = min(opts.n_batch, opts.n_ubatch) // opts.n_seq   # a verify holds a block of every sequence
    n_draft = clamp_n_draft(DrafterInfo.read(drafter), draft.n_max, n_batch=per_seq, n_ubatch=per_seq, hybrid=True)
    if n_draft == 0:
        return 0
    cap = None if draft.rollback_memory_mb is None else int(draft.rollback_memory_mb * 2**20)
    state = 0
    if cap is not None:
        if measure_on is not None:
            state = recurrent_state_bytes(measure_on)
        else:
            with Context(model, replace(_PROBE, n_threads=opts.n_threads)) as probe:
                state = recurrent_state_bytes(probe)
    kind = choose_for_memory(state, n_draft * opts.n_seq, cap)
    log.info("recurrent state %.1f MiB per copy, %d sequence(s) x %d snapshots -> %s rollback",
             state / 2**20, opts.n_seq, n_draft, kind)
    return n_draft if kind == "snapshot" else 0


class Runtime:
    """A target context, the drafter's context beside it (borrowing the target's embeddings and LM head)
    and the decoder on both. ``close()`` frees what this runtime created: the drafter's context always, the
    target's when :meth:`open` made it (a borrowed one, ``Llama``'s, stays its owner's)."""

    def __init__(self, target: Context, drafter: Model | None, draft: DraftSettings | None = None, *,
                 spec: SpecOptions | None = None, proposer: Proposer | None = None, own_target: bool = False,
                 make_decoder: bool = True):
        """``spec``: the decoder's options as they are (tests, benchmarks); by default a front door's:
        the speed gate as ``draft`` says, started from the calibration and the kept acceptance history.
        ``make_decoder=False``: the contexts only (decoders from :meth:`decoder_with`)."""
        self.draft = draft = draft or DraftSettings()
        self.target = target
        self._own_target = own_target
        self.drafter: Context | None = None
        self.decoder: DFlashDecoder | None = None
        try:
            if drafter is not None:
                window = target.opts.draft_window if draft.window is None else draft.window
                self.drafter = Context(drafter, replace(target.opts, n_rs_seq=0, draft_window=window), other=target)
                release_free_heap()   # what loading the drafter freed goes back to the system
            if spec is None:
                spec = SpecOptions(n_draft=draft.n_max, adaptive=draft.adaptive, keep_history=True, ngram=draft.ngram)
            if make_decoder:
                self.decoder = DFlashDecoder(target, self.drafter, spec, proposer)
        except BaseException:
            self.close()
            raise

    @classmethod
    def open(cls, model: Model, drafter: Model | None, opts: ContextOptions, draft: DraftSettings | None = None,
             *, choose_rollback: bool = True, **kw) -> "Runtime":
        """A runtime on a target context of its own (``opts``); its recurrent-state snapshots chosen here
        (:func:`snapshots`) unless ``opts.n_rs_seq`` sets them, or ``choose_rollback`` is False (then
        ``opts`` as they are: the pair opener's contexts for tests and tools)."""
        draft = draft or DraftSettings()
        n_rs_seq = snapshots(model, drafter, opts, draft) if choose_rollback and opts.n_rs_seq == 0 else opts.n_rs_seq
        target = Context(model, replace(opts, n_rs_seq=n_rs_seq))
        try:
            return cls(target, drafter, draft, own_target=True, **kw)
        except BaseException:
            target.close()
            raise

    def decoder_with(self, spec: SpecOptions | None = None, proposer: Proposer | None = None) -> DFlashDecoder:
        """Another decoder on the same contexts (it clears both caches; the first one must not run meanwhile)."""
        return DFlashDecoder(self.target, self.drafter, spec, proposer)

    def plain(self) -> DFlashDecoder:
        """The one-token-per-step reference decoder on the same target context (it clears the caches)."""
        return DFlashDecoder(self.target, None)

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.closed = True   # a generator finalized later must not touch freed contexts
        for ctx, owned in ((self.drafter, True), (self.target, self._own_target)):
            if ctx is not None and owned:
                ctx.close()
        self.drafter = None
        if self._own_target:
            self.target = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
