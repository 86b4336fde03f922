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

Rollback kinds: attention KV (``seq_rm``), recurrent snapshots (``n_rs_seq``, Qwen3.5-class
hybrids) and checkpoint-and-replay (host copy of the recurrent state, re-decode of the
committed tokens) where neither is available.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from dflash_gguf import _bindings as B
from dflash_gguf.engine import Context
from dflash_gguf.errors import ContextOverflowError, InvalidArgumentError, RollbackError
from dflash_gguf.gate import DraftLength
from dflash_gguf.sampling import SamplingParams, TokenChooser

log = logging.getLogger("dflash_gguf.spec")

KIND_NAMES = {1: "dflash", 2: "dflash2", 3: "dspark"}


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = np.asarray(a[:n], dtype=np.int64) == np.asarray(b[:n], dtype=np.int64)
    return n if eq.all() else int(np.argmin(eq))


@dataclass
class DrafterInfo:
    kind: str
    block_size: int
    mask_token: int
    selector_top_k: int
    causal: bool
    target_layers: list[int]

    @classmethod
    def from_c(cls, info) -> "DrafterInfo":
        return cls(kind=KIND_NAMES.get(info.kind, "?"), block_size=info.block_size, mask_token=info.mask_token,
                   selector_top_k=info.selector_top_k, causal=bool(info.causal),
                   target_layers=[info.target_layers[i] for i in range(info.n_target_layers)])


@dataclass
class GenerationStats:
    """What one generation call did. ``tau`` = mean tokens committed per drafting step."""
    n_prompt: int = 0
    n_reused: int = 0
    n_generated: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)   # histogram source
    t_prefill: float = 0.0
    t_draft: float = 0.0
    t_verify: float = 0.0
    t_inject: float = 0.0
    t_rollback: float = 0.0
    t_total: float = 0.0
    finish: str | None = None  # "stop" (EOS / stop token), "length", "context"

    @property
    def tau(self) -> float:
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    @property
    def t_python(self) -> float:
        return max(0.0, self.t_total - self.t_prefill - self.t_draft - self.t_verify - self.t_inject - self.t_rollback)

    @property
    def tokens_per_second(self) -> float:
        t = self.t_total - self.t_prefill
        return self.n_generated / t if t > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "acceptance_length": round(self.tau, 4), "drafted": self.drafted, "accepted": self.accepted,
            "steps": self.steps, "tokens_per_second": round(self.tokens_per_second, 2),
            "per_position_acceptance": [round(x, 4) for x in self.acceptance_rate_per_pos],
            "n_prompt": self.n_prompt, "n_reused": self.n_reused, "n_generated": self.n_generated,
            "time": {k: round(getattr(self, f"t_{k}"), 6) for k in
                     ("prefill", "draft", "verify", "inject", "rollback", "python", "total")},
            "finish": self.finish,
        }


@dataclass
class SpecOptions:
    n_draft: int | None = None   # tokens drafted per block; default and maximum: block_size - 1
    rollback: str = "auto"       # auto | seq_rm | snapshot | checkpoint
    adaptive: bool = False       # speed gate: draft per step as many tokens as pays (gate.DraftLength)
    # test hook: replaces the drafter's proposal (context tokens, n) -> n token ids; the drafter
    # still receives every feature injection, so its cache stays exactly as without the hook
    proposer: Callable[[list[int], int], Sequence[int]] | None = None


class DFlashDecoder:
    """Runs lossless DFlash generation on a target context and a drafter context.

    The drafter context must have been created with ``other=target`` (it borrows the target's
    embeddings and LM head). With ``drafter=None`` the same loop decodes plainly, one token per
    step: the baseline the benchmarks and tests compare against.
    """

    def __init__(self, target: Context, drafter: Context | None, opts: SpecOptions | None = None):
        self.target = target
        self.drafter = drafter
        self.opts = opts or SpecOptions()
        self.info: DrafterInfo | None = None
        self.n_draft = 0
        if drafter is not None:
            cinfo = B.ffi.new("struct llama_dflash_drafter_info *")
            B.check(B.lib.llama_dflash_prepare(target.cptr, drafter.cptr, cinfo),
                    f"pairing drafter {drafter.model.path.name} with target {target.model.path.name}")
            self.info = DrafterInfo.from_c(cinfo)
            limit = min(self.info.block_size - 1, drafter.n_ubatch - 1, target.n_batch - 1)
            want = self.opts.n_draft if self.opts.n_draft is not None else limit
            if want < 0:
                raise InvalidArgumentError(f"n_draft must be >= 0, got {want}")
            if want > limit:
                log.info("n_draft %d clamped to %d (block size %d)", want, limit, self.info.block_size)
            self.n_draft = min(want, limit)
        self.rollback = self._rollback_kind()
        self.gate = DraftLength(self.n_draft) if (self.opts.adaptive and self.n_draft > 0) else None
        if self.rollback == "snapshot" and target.n_rs_seq < self.n_draft:
            raise InvalidArgumentError(f"snapshot rollback needs n_rs_seq >= {self.n_draft}, target has {target.n_rs_seq}")
        self.cache: list[int] = []     # tokens whose KV is in the target (and features in the drafter)
        self.closed = False            # set when the contexts are freed: a late generator cleanup then does nothing
        self._vocab = target.model.n_vocab
        bs = max(self.n_draft + 1, 1)
        self._draft = np.zeros(bs, dtype=np.int32)
        self._verify = np.zeros(bs, dtype=np.int32)
        self._argmax = np.zeros(bs, dtype=np.int32)
        self._eog = set(int(t) for t in target.model.eog_tokens)
        self.reset()   # the decoder owns both caches from here on
        log.debug("decoder ready: drafter=%s n_draft=%d rollback=%s", self.info, self.n_draft, self.rollback)

    # ------------------------------------------------------------------ setup
    def _rollback_kind(self) -> str:
        m = self.target.model
        memory_kind = "checkpoint" if (m.is_recurrent or m.is_hybrid) else "seq_rm"
        if memory_kind == "checkpoint" and self.target.n_rs_seq >= max(self.n_draft, 1):
            memory_kind = "snapshot"
        want = self.opts.rollback
        if want == "auto":
            return memory_kind
        if want == "seq_rm" and memory_kind != "seq_rm":
            raise InvalidArgumentError(f"{m.arch} has recurrent state: seq_rm rollback cannot serve it")
        if want not in ("seq_rm", "snapshot", "checkpoint"):
            raise InvalidArgumentError(f"unknown rollback kind {want!r}")
        return want

    def reset(self) -> None:
        self.target.clear()
        if self.drafter is not None:
            self.drafter.clear()
        self.cache = []

    # ------------------------------------------------------------------ phases
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
        ok = self.rollback == "seq_rm" and self.target.truncate(n)
        if ok and self.drafter is not None:
            ok = self.drafter.truncate(n)
        if not ok:
            log.debug("partial cache removal refused at %d; re-evaluating", n)
            self.reset()
            return 0
        self.cache = self.cache[:n]
        return n

    def _sync_prefix(self, prompt: Sequence[int]) -> int:
        """Keep the longest cached prefix usable for ``prompt`` (at least one token stays to decode)."""
        return self.keep_prefix(common_prefix_len(self.cache, prompt[:len(prompt) - 1]))

    def _prefill(self, tokens: np.ndarray, pos0: int, stats: GenerationStats) -> None:
        t0 = time.perf_counter()
        step = self.target.n_batch
        for off in range(0, len(tokens), step):
            chunk = tokens[off:off + step]
            self.target.decode(chunk, pos0 + off, out_row0=len(chunk))
            if self.drafter is not None:
                B.check(B.lib.llama_dflash_inject(self.drafter.cptr, self.target.cptr, 0, pos0 + off, 0, len(chunk)),
                        "injecting prompt features into the drafter")
        stats.t_prefill += time.perf_counter() - t0

    def _finish_block(self, pos: int, k: int, n_rows: int, saved: bytes | None, stats: GenerationStats) -> None:
        """Keep the first ``k`` rows of the verify batch in both caches (of ``n_rows`` decoded)."""
        if self.closed:
            return
        t0 = time.perf_counter()
        if self.drafter is not None:
            B.check(B.lib.llama_dflash_inject(self.drafter.cptr, self.target.cptr, 0, pos, 0, k),
                    "injecting verified features into the drafter")
        t1 = time.perf_counter()
        stats.t_inject += t1 - t0
        if k < n_rows:
            if self.rollback == "checkpoint":
                assert saved is not None
                self.target.restore_seq(saved)
                if not self.target.truncate(pos):
                    raise RollbackError(f"could not drop the rejected rows after restoring the state at {pos}")
                self.target.decode(self._verify[:k].copy(), pos, out_row0=k)   # replay the committed rows
            elif not self.target.truncate(pos + k):
                raise RollbackError(f"target refused to roll back from {pos + n_rows} to {pos + k} "
                                    f"(rollback={self.rollback}, n_rs_seq={self.target.n_rs_seq})")
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
                         self._eog if stop_tokens is None else set(map(int, stop_tokens)), use_draft)

    def _run(self, prompt: list[int], max_tokens: int, sp: SamplingParams, stats: GenerationStats,
             stop: set[int], use_draft: bool) -> Iterator[int]:
        t_start = time.perf_counter()
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
        pending = prompt[-1]
        chooser = TokenChooser(sp)
        fast_greedy = sp.greedy and not sp.has_penalties
        n_draft = self.n_draft if (use_draft and self.drafter is not None) else 0
        produced = 0
        try:
            while produced < max_tokens:
                pos = len(self.cache)
                if pos >= self.target.n_ctx:
                    stats.finish = "context"
                    return
                want = self.gate.choose() if (self.gate is not None and n_draft) else n_draft
                n = min(want, max_tokens - produced - 1, self.target.n_ctx - pos - 1)
                t_step = stats.t_draft + stats.t_verify
                # ---- draft
                if n > 0:
                    t0 = time.perf_counter()
                    got = B.check(B.lib.llama_dflash_draft(self.drafter.cptr, 0, pos, pending, n,
                                                           B.ffi.from_buffer("llama_token[]", self._draft)),
                                  "drafting a block")
                    stats.t_draft += time.perf_counter() - t0
                    n = got
                    if self.opts.proposer is not None:
                        self._draft[:n] = np.asarray(self.opts.proposer(self.cache + [pending], n), dtype=np.int32)[:n]
                # ---- verify
                self._verify[0] = pending
                self._verify[1:n + 1] = self._draft[:n]
                saved = self.target.save_seq() if (n > 0 and self.rollback == "checkpoint") else None
                t0 = time.perf_counter()
                vin = self._verify[:n + 1]
                if fast_greedy:
                    self.target.decode(vin, pos, out_row0=0, argmax=self._argmax[:n + 1])
                else:
                    self.target.decode(vin, pos, out_row0=0)
                stats.t_verify += time.perf_counter() - t0
                # ---- accept
                if fast_greedy:
                    if n:
                        ok = self._draft[:n] == self._argmax[:n]
                        a = n if ok.all() else int(np.argmin(ok))
                    else:
                        a = 0
                    commit = self._draft[:a].tolist() + [int(self._argmax[a])]
                else:
                    commit = []
                    for i in range(n + 1):
                        logits = self.target.logits_row(i)
                        if i < n:
                            ok, tok = chooser.verify(logits, int(self._draft[i]), commit)
                        else:
                            ok, tok = False, chooser.pick(logits, commit)
                        commit.append(tok)
                        if not ok:
                            break
                    a = len(commit) - 1
                if self.gate is not None and n_draft:
                    self.gate.record(n, a, stats.t_draft + stats.t_verify - t_step)
                if n:
                    stats.steps += 1
                    stats.drafted += n
                    stats.accepted += a
                    stats.accepted_per_step.append(a)
                    while len(stats.drafted_per_pos) < n:
                        stats.drafted_per_pos.append(0)
                        stats.accepted_per_pos.append(0)
                    for i in range(n):
                        stats.drafted_per_pos[i] += 1
                        stats.accepted_per_pos[i] += i < a
                # ---- commit (stop tokens and the budget truncate the block)
                for j, tok in enumerate(commit):
                    if tok in stop:
                        commit = commit[:j + 1]
                        break
                consumed = 0
                try:
                    for tok in commit:
                        consumed += 1
                        produced += 1
                        stats.n_generated += 1
                        yield tok
                finally:
                    self._finish_block(pos, consumed, n + 1, saved, stats)
                    if consumed:
                        chooser.accept(commit[:consumed])
                        self.cache.append(pending)
                        self.cache.extend(commit[:consumed - 1])
                        pending = commit[consumed - 1]
                if commit[-1] in stop:
                    stats.finish = "stop"
                    return
            stats.finish = "length"
        finally:
            stats.t_total += time.perf_counter() - t_start
