"""One request, one slot, one step: the records the batched decoder (:mod:`.decoder`) keeps per sequence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from dflash_gguf.decoding.constraints import Constraints
from dflash_gguf.decoding.features import FeatureFeed
from dflash_gguf.decoding.ngram import NgramIndex, Rates
from dflash_gguf.decoding.rollback import Rollback
from dflash_gguf.decoding.stats import GenerationStats
from dflash_gguf.decoding.gate import DraftLength
from dflash_gguf.decoding.sampling import SamplingParams, TokenChooser


NO_HEAD = np.zeros(0, dtype=np.int32)


@dataclass
class Request:
    """One generation for :meth:`DFlashDecoder.run`: ``max_tokens`` tokens after ``prompt`` (token ids)."""
    prompt: Sequence[int]
    max_tokens: int
    sampling: SamplingParams | None = None
    stop_tokens: Sequence[int] | None = None   # None: the target's end-of-generation tokens
    use_draft: bool = True                     # False: plain decoding (in the same batch)
    stats: GenerationStats | None = None       # filled in as it runs (None: a new one, set here)
    # called with each step's committed tokens: None keeps them all, k keeps the first k and ends the
    # request (e.g. a stop string complete after them); both caches keep exactly what is kept
    consumer: Callable[[list[int]], int | None] | None = None
    error: BaseException | None = None         # set when the request failed (its prompt could not be decoded)
    constraints: Constraints | None = None     # logits processors and a grammar (the decoder closes it at the end)
    # called with (position, logits row) for every prompt row and every committed token's row, before the
    # tokens are handed over (what llama_cpp keeps with logits_all=True)
    logits_sink: Callable[[int, np.ndarray], None] | None = None
    sink_from: int = 0   # ... from this position on (rows before it are neither computed nor handed over:
                         # len(prompt) - 1 gives only the rows that predict generated tokens)


@dataclass
class Step:
    """What :meth:`DFlashDecoder._advance` did for one sequence: ``n`` drafted tokens verified, ``commit``
    (cut at a stop token), the verify rows and their first row in the batch, what the rollback saved."""
    pos: int
    n: int
    accepted: int
    commit: list[int]
    rows: np.ndarray
    row0: int
    saved: bytes | None
    head: int = 0     # prompt rows decoded before ``pending`` (a prompt's tail fused into its first step)
    copied: bool = False   # the block was copied by prompt lookup (no draft ran)
    proposed: int = -1     # tokens drafted (-1: ``n``): more where the block was cut before the verify (the
                           # drafter's confidence, a grammar), which then cost a longer draft and a shorter verify


@dataclass
class TakenStep:
    """A step taken and not yet kept (:meth:`DFlashDecoder._take_step`): the running requests' slots, what
    each committed, the draft policy's plan of it, the seconds the step's work took so far;
    ``ended``: slots whose consumers end their requests with it (``stop``: as a stop string or token
    does; a caller that stops iterating a generator does not say why)."""
    active: list["Slot"]
    steps: list[Step]
    plan: Any
    seconds: float
    ended: set[int] = field(default_factory=set)
    stop: bool = True


@dataclass
class Slot:
    """One slot of the decoder: llama.cpp sequence ``slot`` of both contexts, the tokens its caches hold,
    and while a request runs on it, that request's state."""
    slot: int
    rollback: Rollback
    features: FeatureFeed | None
    cache: list[int] = field(default_factory=list)   # tokens whose KV is in the target (features in the drafter)
    # the running request
    index: int = -1
    pending: int = 0
    produced: int = 0
    max_tokens: int = 0
    stop: frozenset[int] | set[int] = frozenset()
    chooser: TokenChooser | None = None
    logits_sink: Callable[[int, np.ndarray], None] | None = None
    sink_from: int = 0
    greedy: bool = True
    n_draft: int = 0                  # most tokens this request drafts per step (0: plain)
    gate: DraftLength | None = None   # its speed gate alone (None: fixed length)
    lattice: bool = False             # DFlash2, sampled: proposals drawn from the selector's lattice
    markov: bool = False              # DSpark, sampled: proposals drawn through the Markov head's chain
    copy: NgramIndex | None = None    # prompt lookup: the request's tokens so far, indexed (None: no copying)
    copy_rates: Rates | None = None   # ... its copies' acceptance, and its drafted blocks' (beside a drafter)
    draft_rates: Rates | None = None
    copy_declined: int = 0            # ... matches not copied (the copies did not pay), counted for probes
    copied: list[int] = field(default_factory=list)   # this step's copied block (empty: drafted or plain)
    stats: GenerationStats = field(default_factory=GenerationStats)
    consumer: Callable[[list[int]], int | None] | None = None
    prompt: list[int] = field(default_factory=list)
    todo: np.ndarray | None = None    # prompt tokens still to prefill (run / admit: a chunk per step)
    # the prompt's last tokens before ``pending``, decoded with it in the request's first step (a plain
    # step: its logits give the first token, as a prefill's last row does, with no decode of its own)
    head: np.ndarray = field(default_factory=lambda: NO_HEAD)
    request: Request | None = None
    t_start: float = 0.0
    done: bool = True
    order: int = 0                    # when its request was admitted (shared cells: the latest gives way first)
