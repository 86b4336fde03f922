"""A request's prompt into both caches: prefix reuse, the prefill, and its tail fused into the first step.

The methods of :class:`dflash_gguf.decoding.decoder.DFlashDecoder` that bring a prompt into a slot's
caches (a mixin, as :mod:`.scheduling` is): what a slot already holds is kept (``keep_prefix``), the rest
is decoded a ubatch at a time, the rows the drafter will attend to in chunks whose features are kept on
the host (``_prefill``; a joining request's a chunk per step, ``_prefill_chunk``), and the prompt's last
tokens go with its last one into the request's first step, whose last row gives the first token
(``_fusable``).
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np

from dflash_gguf.decoding.sequence import Slot
from dflash_gguf.decoding.stats import GenerationStats
from dflash_gguf.errors import ContextOverflowError

# target rows whose taps a decode keeps (llama_dflash_set_tap_rows_max): a verify block and the
# prompt's last rows in chunks of this many; five taps of a 2048-wide target cost 2.6 MiB of its
# compute buffer at 64 rows instead of 21 MiB for a 512-row ubatch (BENCHMARKS.md section 7).
# A decoder of several sequences keeps at least a block of each (their verify rows share a decode).
TAP_ROWS = 64

log = logging.getLogger("dflash_gguf.decoding")


class Prompts:
    """Mixed into DFlashDecoder (which sets the contexts, ``seqs``, ``tap_rows`` and ``PREFILL_CHUNK``)."""

    def keep_prefix(self, n: int, slot: int = 0) -> int:
        """Cut a slot's caches back to its first ``n`` cached tokens; returns how many are kept.

        Recurrent state: llama.cpp accepts any rollback within n_rs_seq, but its snapshots only cover
        the rows of the last decode (a 1-token step leaves the older slots stale), so a partial
        removal could silently restore the wrong state: both caches are cleared instead (0 kept)
        and the caller re-evaluates.
        """
        s = self.seqs[slot]
        n = min(n, len(s.cache))
        if n == len(s.cache) and self.target.pos_max(s.slot) < n:
            return n                      # nothing beyond the prefix to remove
        ok = s.rollback.partial_prefix and self.target.truncate(n, s.slot)
        if ok and self.drafter is not None:
            ok = self.drafter.truncate(n, s.slot)
            s.features.truncate(n)
        if not ok:
            log.debug("partial cache removal refused at %d; re-evaluating", n)
            self._reset_seq(s)
            return 0
        s.cache = s.cache[:n]
        return n

    def feed(self, tokens: Sequence[int], slot: int = 0) -> None:
        """Decode ``tokens`` after a slot's cached ones into both caches (no sampling)."""
        s = self.seqs[slot]
        if len(s.cache) + len(tokens) > self.n_ctx:
            raise ContextOverflowError(f"{len(tokens)} more tokens do not fit the context ({self.n_ctx})")
        self._prefill(s, np.asarray(tokens, dtype=np.int32), len(s.cache), GenerationStats())
        s.cache.extend(int(t) for t in tokens)

    def _prefill(self, s: Slot, tokens: np.ndarray, pos0: int, stats: GenerationStats, end: int | None = None) -> None:
        """Decode ``tokens`` at ``pos0`` into both caches; ``end``: where the whole fill ends when this is
        one chunk of it (rows the drafter's window drops by then are not injected)."""
        t0 = time.perf_counter()
        self.policy.interrupt()   # the next step follows a prefill, not a step of its gate
        end = pos0 + len(tokens) if end is None else end
        feed = s.features
        # rows the drafter will attend to (its window's worth at the end) are decoded tap_rows at a
        # time and kept on the host for the next draft; the rest in whole ubatches (one per decode:
        # direct taps), nothing kept
        split = 0
        if feed is not None and feed.window:
            split = min(max(end - feed.window - pos0, 0), len(tokens))
        elif feed is None:
            split = len(tokens)
        step = self.target.n_ubatch   # llama.cpp keeps n_ubatch <= n_batch
        for off in range(0, split, step):
            chunk = tokens[off:min(off + step, split)]
            self.target.decode(chunk, pos0 + off, out_row0=self._out_row0(s, pos0 + off, len(chunk)), seq=s.slot)
            self._sink_rows(s, pos0 + off, 0, len(chunk))
        step = min(self.tap_rows, TAP_ROWS)
        for off in range(split, len(tokens), step):
            chunk = tokens[off:off + step]
            self.target.decode(chunk, pos0 + off, out_row0=self._out_row0(s, pos0 + off, len(chunk)), seq=s.slot)
            self._sink_rows(s, pos0 + off, 0, len(chunk))
            feed.keep(pos0 + off, len(chunk), end=end)   # on the host until a draft needs them (features.py)
        stats.t_prefill += time.perf_counter() - t0

    @staticmethod
    def _out_row0(s: Slot, pos: int, n: int) -> int:
        """The first of a prefill chunk's ``n`` rows (at ``pos..``) whose logits the request's sink takes
        (``n``: none of them)."""
        if s.logits_sink is None:
            return n
        return min(max(s.sink_from - pos, 0), n)

    def _sink_rows(self, s: Slot, pos: int, row0: int, n: int) -> None:
        """Hand rows ``row0..row0+n`` of the last decode (positions ``pos..``) to the request's sink (those
        at ``s.sink_from`` and after)."""
        if s.logits_sink is not None:
            for j in range(max(s.sink_from - pos, 0), n):
                s.logits_sink(pos + j, self.target.logits_row(row0 + j))

    def _fusable(self, s: Slot, others: list[Slot]) -> int:
        """How many of the prompt tokens before its last one the request on ``s`` may decode in its first
        step beside the steps of ``others`` (0: none, the prompt is prefilled on its own).

        That step is a plain one for ``s`` whose last row gives the first token, as a prefill's last row
        would: one target decode less per request (upstream's prefill samples its first token the same
        way), which at short requests is several percent of the time. Its rows are kept whole or rolled
        back to the prompt, so the rollback must keep any prefix (seq_rm; a recurrent state keeps the last
        rows' snapshots only); not where every block is padded to the longest (the tail would pad them
        all), where the logits sink wants the tail's rows, or where nothing is generated. Within the taps'
        row cap beside the others' blocks (every row's features are kept), and a prefill chunk."""
        if (self._pad or s.max_tokens <= 0 or s.rollback.name != "seq_rm"
                or (s.logits_sink is not None and s.sink_from < len(s.prompt) - 1)):
            return 0
        others_rows = sum(max(o.n_draft, self.n_copy if o.copy is not None else 0) + 1 + len(o.head) for o in others)
        return max(min(self.tap_rows, self.PREFILL_CHUNK) - 1 - others_rows, 0)

    def _prefill_chunk(self, s: Slot, leave: int = 0, whole: bool = False) -> bool:
        """The next ``PREFILL_CHUNK`` tokens of a deferred prompt (``whole``: all of it), short of its last
        ``leave`` (those go with the first step); True when the prompt is all in (its tail, if any, in
        ``s.head``)."""
        if len(s.todo) > leave:
            pos = len(s.cache)
            n = len(s.todo) - leave if whole else min(self.PREFILL_CHUNK, len(s.todo) - leave)
            chunk, s.todo = s.todo[:n], s.todo[n:]
            try:
                self._prefill(s, chunk, pos, s.stats, end=len(s.prompt) - 1)
            except BaseException:
                self._reset_seq(s)
                raise
            s.cache = s.prompt[:pos + len(chunk)]
            if len(s.todo):
                return False       # more next step (the tail left, if that is all, goes with the first step then)
        s.head, s.todo = s.todo, None      # the prompt is in but for this tail (none where all was prefilled)
        s.pending = s.prompt[-1]
        return True
