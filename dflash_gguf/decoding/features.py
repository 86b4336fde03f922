"""The drafter's context features: injected at once while drafting, kept on the host while not.

Every token the target commits must reach the drafter's cache (its features: the target's tapped
hidden states at that position). While the speed gate decodes plainly, injecting one row per token
costs a drafter graph run per token for nothing; :class:`FeatureFeed` instead copies the row's taps to
a host buffer (``llama_dflash_get_taps``) and injects all buffered rows in one call
(``llama_dflash_inject_features``, patch 0007) when the drafter next needs them: before a draft,
before rows are injected straight from a decode, or when the buffer would pass ``MAX_BYTES``. A
prompt's rows are kept the same way. They stay on the host between generations (a decoder's caches
are its token list, ``Slot.cache``: the drafter's KV plus these rows), so rows no draft ever reads - a
request that decodes plainly to its end, then a new prompt - are never injected, and a decoder whose
gate decodes plainly never runs the drafter between its probes. Buffered rows always cover the
contiguous positions ``[start, start + n)``, right after the drafter's cache.

A drafter context with a window (``Context.window``, see :func:`dflash_gguf.native.engine.drafter_options`)
keeps the features of the last ``window`` positions only: before rows are written, older positions
leave its cache, and rows that would leave it at once (the head of a long prompt) are never injected.
Positions stay absolute, as the drafter was trained. One feed per sequence (``seq``): its rows of a
batched decode start at ``row0``.
"""
from __future__ import annotations

import numpy as np

from dflash_gguf.native import _bindings as B
from dflash_gguf.native.engine import Context, DrafterInfo
from dflash_gguf.errors import DFlashError

MAX_BYTES = 4 << 20    # rows are injected when the buffer would pass this (per sequence; it grows by doubling
                       # from FIRST_ROWS: 819 rows of the demo pair, 102 at the Qwen3-1.7B shape with 5 taps). A
                       # flush mid-run costs more than its 6.5 us a row and 60 us a call: the drafter's graph
                       # run pushes a small target out of the CPU's caches for the plain steps after it, so
                       # the cap is far above a small pair's row. Not higher: a long prompt's kept rows fill
                       # the buffer while the target's compute buffer is in full use, and a growth holds the
                       # old buffer and the new one at once, all of it on top of plain decoding's peak
FIRST_ROWS = 64


class FeatureFeed:
    def __init__(self, target: Context, drafter: Context, info: DrafterInfo, seq: int = 0):
        self.target, self.drafter = target, drafter
        self.seq = seq
        self.taps = np.asarray(info.target_layers, dtype=np.int32)
        self._taps_c = B.ffi.from_buffer("int32_t[]", self.taps)
        self.row = len(self.taps) * target.model.n_embd
        self.buf: np.ndarray | None = None      # allocated on first use, grown by doubling up to max_rows
        self._buf_c = None                      # ... and its C view (keep() runs once per plain step)
        self.max_rows = max(FIRST_ROWS, MAX_BYTES // (4 * self.row))
        self.start = 0
        self.n = 0
        self.window = drafter.window

    def _first_kept(self, pos: int, n_rows: int, end: int | None) -> int:
        """Slide the window to end at ``end`` (default ``pos + n_rows``); the first of the rows at
        ``pos..pos+n_rows`` that stays in it."""
        if not self.window:
            return 0
        low = (pos + n_rows if end is None else end) - self.window
        if low > 0 and not self.drafter.forget_before(low, self.seq):
            raise DFlashError(f"the drafter refused to drop positions before {low}")
        return min(max(low - pos, 0), n_rows)

    def inject(self, pos: int, n_rows: int, what: str, row0: int = 0) -> None:
        """Rows ``row0..row0+n_rows`` of the target's last decode, at ``pos``, straight into the drafter."""
        self.flush()
        skip = self._first_kept(pos, n_rows, None)
        if n_rows > skip:
            B.check(B.lib.llama_dflash_inject(self.drafter.cptr, self.target.cptr, self.seq, pos + skip, row0 + skip,
                                              n_rows - skip), what)

    def keep(self, pos: int, n_rows: int, row0: int = 0, end: int | None = None) -> None:
        """Rows ``row0..row0+n_rows`` of the target's last decode, at ``pos``, into the host buffer.

        ``end``: the position the cache will reach once a longer fill (a prompt in chunks) is done: with
        a window, the drafter's cache slides to end there now (the prompt's untapped head leaves it) and
        rows it would drop by then are not kept.
        """
        if n_rows == 0:
            return
        if not self.window and pos + n_rows > self.drafter.n_ctx:
            # past what the drafter's cache holds: inject now, so that the error comes where it did (with
            # the rows that do not fit), not at some later draft
            self.inject(pos, n_rows, "injecting features into the drafter", row0=row0)
            return
        if self.n and self.start + self.n != pos or self.n + n_rows > self.max_rows:
            self.flush()
        if end is not None and self.window:
            if self.n and end - self.window > self.start:
                self.flush()          # buffered rows the slide would pass: into the drafter first
            skip = self._first_kept(pos, n_rows, end)
            pos, row0, n_rows = pos + skip, row0 + skip, n_rows - skip
            if n_rows == 0:
                return
        need = self.n + n_rows
        if self.buf is None or len(self.buf) < need:
            size = FIRST_ROWS if self.buf is None else len(self.buf)
            while size < need:
                size *= 2
            buf = np.empty((min(size, max(self.max_rows, need)), self.row), dtype=np.float32)
            if self.n:
                buf[:self.n] = self.buf[:self.n]
            self.buf, self._buf_c = buf, B.ffi.from_buffer("float[]", buf)
        if not self.n:
            self.start = pos
        B.check(B.lib.llama_dflash_get_taps(self.target.cptr, self._taps_c, len(self.taps), row0, n_rows,
                                            self._buf_c + self.n * self.row, n_rows * self.row),
                "keeping the features of a plain step")
        self.n += n_rows

    def flush(self) -> None:
        """Inject the buffered rows (one call)."""
        if not self.n:
            return
        n, self.n = self.n, 0
        skip = self._first_kept(self.start, n, None)
        rows = self.buf[skip:n]
        if len(rows):
            B.check(B.lib.llama_dflash_inject_features(self.drafter.cptr, self.seq, self.start + skip,
                                                       B.ffi.from_buffer("float[]", rows), len(rows), rows.size),
                    "injecting the features of plain steps into the drafter")

    def truncate(self, n_keep: int) -> None:
        """Forget buffered rows at positions >= ``n_keep``."""
        self.n = max(0, min(self.n, n_keep - self.start))

    def clear(self) -> None:
        self.n = 0
