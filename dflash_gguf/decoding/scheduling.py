"""Many requests on a decoder's slots: admission, the batched step, the request loop.

The methods of :class:`dflash_gguf.decoding.decoder.DFlashDecoder` that run several requests at once
(one engine: they drive the same step, ``_advance`` and ``_settle``, as the one-sequence ``generate``).
A request takes a free slot, its prompt is prefilled a chunk per step beside the running requests,
and each step drafts and verifies every running request's block in one drafter and one target decode.

Shared cells (``ContextOptions.shared``: the sequences share one KV cache of ``n_cells`` cells, any of them
may use all of it as the others leave room, as llama-server's ``-np`` slots do): a request is admitted when
the cache has room for its prompt and a block beside what the running ones hold (:meth:`Scheduling.room_for`;
idle slots' kept prefixes give way first), and before every step the running requests' blocks and the next
prompt chunk must fit (``_make_room``). When they do not, the most recently admitted request gives its cells
back and resumes later: its prompt and every token it committed are prefilled again and its next step
goes on from its pending token, with its sampler, grammar, stop-string and logprobs state untouched - so
its tokens are the ones it gets alone (greedy and seeded sampling are position-keyed; nothing is drawn
twice), and its consumer sees one uninterrupted stream. A request alone is never preempted: it may use
every cell, as alone it always could.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator, Sequence

import numpy as np

from dflash_gguf.decoding.sequence import Request, TakenStep
from dflash_gguf.decoding.stats import GenerationStats
from dflash_gguf.errors import DecodeError
from dflash_gguf.decoding.sampling import SamplingParams

log = logging.getLogger("dflash_gguf.decoding")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    eq = np.asarray(a[:n], dtype=np.int64) == np.asarray(b[:n], dtype=np.int64)
    return n if eq.all() else int(np.argmin(eq))


class Scheduling:
    """Mixed into DFlashDecoder (which sets ``_free``, ``_active``, ``_ended``, ``_filling``)."""

    @property
    def free_slots(self) -> int:
        """Slots a new request can take now (:meth:`admit`)."""
        return len(self._free)

    @property
    def running(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self._active) + len(self._ended) + len(self._filling)

    def room_for(self, n_prompt: int) -> bool:
        """Whether a request with an ``n_prompt``-token prompt may start now: always with cells of its own per
        sequence, or with nothing running; with shared cells, when its prompt and a block fit beside what the
        running requests hold and will hold (their prompts, a block each), and no request waits to resume."""
        if self.n_cells is None or not self.running:
            return True
        if any(s.order < 0 for s in self._filling):    # a preempted request resumes first
            return False
        block = self._block_cells()
        held = sum(max(len(s.cache) + len(s.head), len(s.prompt)) + block for s in self._running_slots())
        return held + n_prompt + block <= self.n_cells

    def cells_used(self) -> int:
        """KV cells the slots' tokens hold now (kept prefixes of idle slots included)."""
        return sum(len(s.cache) for s in self.seqs)

    def _running_slots(self) -> list:
        return self._active + list(self._filling)

    def _block_cells(self) -> int:
        """Cells one step of a running request may add: its longest block (drafted or copied) and its token."""
        return max(self.n_draft, self.n_copy) + 1

    def admit(self, r: Request, index: int = -1, slot: int | None = None) -> bool:
        """Start request ``r`` on a free slot - the one whose caches share the longest prefix with its
        prompt, or ``slot``; False when every slot is taken (or ``slot`` is). Its prompt is prefilled by the following steps, one
        ``PREFILL_CHUNK`` per step beside the running requests' steps (so their next tokens wait for
        at most one chunk), then its tokens come from :meth:`step`, tagged with ``index``. Raises (and
        takes no slot) on a bad prompt."""
        free = self._free if slot is None else [q for q in self._free if q.slot == slot]
        if not free:
            return False
        prompt = self._check(r.prompt)
        s = max(free, key=lambda q: common_prefix_len(q.cache, prompt))
        sp = r.sampling or SamplingParams()
        if r.stats is None:
            r.stats = GenerationStats()
        stats = r.stats
        self._free.remove(s)
        try:
            self._begin(s, prompt, r.max_tokens, sp, stats,
                        self.eog if r.stop_tokens is None else set(map(int, r.stop_tokens)), r.use_draft, index,
                        constraints=r.constraints, logits_sink=r.logits_sink,
                        sink_from=r.sink_from)
        except BaseException:
            self._free.append(s)
            raise
        s.consumer, s.request = r.consumer, r
        self._admitted += 1
        s.order = self._admitted
        if s.todo is not None and s.max_tokens > 0:
            self._filling.append(s)
        elif self._finished(s, None):
            self._end(s)
            self._ended.append(s)
        else:
            self._active.append(s)
        return True

    def step(self) -> list[tuple[int, list[int], bool]]:
        """One draft-verify step of every running request, in one drafter and one target decode:
        ``(index, tokens, ended)`` for each (tokens: those kept this step; ended: its slot is free again)."""
        out, taken = self._take_step()
        if taken is None:
            return out
        kept = []
        for s, st in zip(taken.active, taken.steps):
            want = s.consumer(st.commit) if s.consumer is not None else None
            # a number from the consumer ends the request
            kept.append(len(st.commit) if want is None else max(0, min(int(want), len(st.commit))))
            if want is not None:
                taken.ended.add(s.slot)
        return out + self._keep_step(taken, kept)

    def _take_step(self) -> tuple[list[tuple[int, list[int], bool]], "TakenStep | None"]:
        """The first half of :meth:`step`: requests that ended at admission and failed prefills reported, the
        next prompt chunk prefilled, then the draft-verify step of every running request - what each
        committed, nothing kept yet (None: no request runs). :meth:`_keep_step` keeps what the consumers
        took. ``generate`` hands the tokens to its caller in between, one at a time."""
        out = [(s.index, [], True) for s in self._ended]
        self._free.extend(self._ended)
        self._ended = []
        fill = self._make_room() if self.n_cells is not None else True
        if self._filling and fill:
            s = self._filling[0]
            try:
                # alone, the whole prompt at once; beside running requests a chunk (their next token waits
                # for it); its last tokens (those that fit beside the running blocks) go with its first step
                filled = self._prefill_chunk(s, self._fusable(s, self._active), whole=not self._active)
            except Exception as e:   # this request fails (e.g. its context is full); the others go on
                log.debug("prefill of request %d failed: %s", s.index, e)
                self._filling.popleft()
                if s.request is not None:
                    s.request.error = e
                s.stats.finish = "error"
                self._end(s)
                self._free.append(s)
                out.append((s.index, [], True))
                filled = False
            if filled:
                self._filling.popleft()
                if self._finished(s, None):
                    self._end(s)
                    self._free.append(s)
                    out.append((s.index, [], True))
                else:
                    self._active.append(s)
        if not self._active:
            return out, None
        t0 = time.perf_counter()
        try:
            steps, plan = self._advance(self._active)
        except DecodeError:
            self._check_servers()   # a lost rpc-server explains a failed draft or verify: RpcLostError
            raise
        return out, TakenStep(list(self._active), steps, plan, time.perf_counter() - t0)

    def _keep_step(self, taken: "TakenStep", kept: list[int]) -> list[tuple[int, list[int], bool]]:
        """The second half of :meth:`step`: both caches keep the first ``kept[i]`` committed tokens of each
        running request and roll the rest back, the gate is charged the step's work (not the consumers'
        time), and requests that are done (``taken.ended``, end of generation, max_tokens, a full context)
        leave their slots: ``(index, tokens, ended)`` for each."""
        active, steps = taken.active, taken.steps
        for s, k in zip(active, kept):
            s.produced += k
            s.stats.n_generated += k
        t0 = time.perf_counter()
        self._settle([(s, st, k) for s, st, k in zip(active, steps, kept)])
        self.policy.observe(list(zip(active, steps)), taken.plan, taken.seconds + time.perf_counter() - t0)
        self._active = []
        out = []
        for s, st, k in zip(active, steps, kept):
            ended = s.slot in taken.ended
            if ended and taken.stop:
                s.stats.finish = "stop"
            ended = ended or self._finished(s, st)
            if ended:
                self._end(s)
                self._free.append(s)
            else:
                self._active.append(s)
            out.append((s.index, st.commit[:k], ended))
        return out

    # ------------------------------------------------------------------ shared cells
    def _make_room(self) -> bool:
        """Shared cells: free what this step needs - idle slots' kept prefixes first, then the cells of the most
        recently admitted requests (:meth:`_preempt`) - until the running requests' blocks fit; True when the
        next prompt chunk fits too (else it waits a step). A request alone goes on whatever it needs: alone it
        never holds more than the cache (its positions are bounded by ``n_ctx``)."""
        block = self._block_cells()

        def need() -> int:
            return (sum(len(s.cache) + len(s.head) + block for s in self._active)
                    + sum(len(s.cache) for s in self._filling) + sum(len(s.cache) for s in self._free))

        while need() > self.n_cells:
            if self._free_idle_prefixes():
                continue
            holders = [s for s in self._running_slots() if s.cache or s.head is not None and len(s.head)]
            if len(holders) > 1:
                self._preempt(max(holders, key=lambda q: abs(q.order)))
            else:
                break
        if not self._filling:
            return True
        f = self._filling[0]
        whole = not self._active
        # its next chunk, or all of it with the tail its first step decodes, and that step's block
        chunk = len(f.todo) if (whole or len(f.todo) <= self.PREFILL_CHUNK + self.tap_rows) else self.PREFILL_CHUNK
        while need() + chunk + block > self.n_cells:
            if self._free_idle_prefixes():
                continue
            others = [s for s in self._running_slots() if s is not f and s.cache and abs(s.order) > abs(f.order)]
            if others:
                self._preempt(max(others, key=lambda q: abs(q.order)))
            elif self._active:
                return False           # it waits for room; the running requests go on
            else:
                return True            # alone (or the others hold nothing): as it always could
        return True

    def _free_idle_prefixes(self) -> bool:
        """Drop the prefixes idle slots keep for reuse (the first cells to give way); False when none holds any."""
        idle = [s for s in self._free if s.cache]
        for s in idle:
            self._reset_seq(s)
        return bool(idle)

    def _preempt(self, s) -> None:
        """The request on ``s`` gives its cells back and waits to resume: everything it holds (its prompt and
        the tokens it committed) is prefilled again, then its next step goes on from its pending token."""
        if s in self._active:
            self._active.remove(s)
            tokens = list(s.cache) + [int(t) for t in s.head] + [int(s.pending)]
        else:
            self._filling.remove(s)
            tokens = list(s.prompt)
        if s.logits_sink is not None:    # rows it already handed over are not handed over again
            s.sink_from = max(s.sink_from, len(s.cache))
        log.debug("request %d gives back %d cells (the shared cache is full); it resumes later", s.index, len(s.cache))
        self._reset_seq(s)
        s.prompt, s.todo, s.head = tokens, np.asarray(tokens[:-1], dtype=np.int32), np.zeros(0, dtype=np.int32)
        s.order = -abs(s.order)           # waiting to resume (room_for: before new requests)
        self.preempted += 1
        self._filling.append(s)
        self._filling = type(self._filling)(sorted(self._filling, key=lambda q: abs(q.order)))

    def abandon(self) -> None:
        """End every running request where it is (both caches keep what was kept)."""
        for s in self._active + self._ended + list(self._filling):
            self._end(s)
            self._free.append(s)
        self._active, self._ended = [], []
        self._filling.clear()

    def run(self, requests: Iterable[Request]) -> Iterator[tuple[int, list[int]]]:
        """Run ``requests`` on every slot at once: yields ``(index, tokens)`` as each request's tokens are
        kept (index: its position in ``requests``; a request's last item may have no tokens).

        Each step drafts every running request's block in one drafter decode and verifies them all in
        one target decode; the next request (read from ``requests`` only then) takes a slot as soon as
        one is free, between steps, in order. Every request's tokens are the ones it would get alone
        (greedy: token for token; sampled: the same distribution).
        """
        todo = iter(enumerate(requests))
        try:
            while True:
                while self._free:
                    nxt = next(todo, None)
                    if nxt is None:
                        break
                    self.admit(nxt[1], nxt[0])
                if not self.running:
                    return
                for i, toks, _ in self.step():
                    yield i, toks
        finally:
            self.abandon()

    def generate_batch(self, requests: Sequence[Request]) -> list[list[int]]:
        """Every request's tokens (see :meth:`run`), in request order."""
        out: list[list[int]] = [[] for _ in requests]
        for i, toks in self.run(requests):
            out[i].extend(toks)
        return out
