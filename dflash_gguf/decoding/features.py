"""The drafter's context features: injected at once while drafting, kept on the host while not.

Every token the target commits must reach the drafter's cache (its features: the target's tapped
hidden states at that position). While the speed gate decodes plainly, injecting one row per token
costs a drafter graph run per token for nothing; :class:`FeatureFeed` instead copies the row's taps to
a host buffer (``llama_dflash_get_taps``) and injects all buffered rows in one call
(``llama_dflash_inject_features``, patch 0007) when the drafter next needs them: before a draft, or
before rows are injected straight from a decode. They stay on the host between generations (a
decoder's caches are its token list, ``Slot.cache``: the drafter's KV plus these rows), so rows no
draft ever reads - a request that decodes plainly to its end, then a new prompt - are never injected.
Buffered rows always cover the contiguous positions ``[start, start + n)``, right after the drafter's cache.

A drafter context with a window (``Context.window``, see :func:`dflash_gguf.engine.drafter_options`)
keeps the features of the last ``window`` positions only: before rows are written, older positions
leave its cache, and rows that would leave it at once (the head of a long prompt) are never injected.
Positions stay absolute, as the drafter was trained. One feed per sequence (``seq``): its rows of a
batched decode start at ``row0``.
"""
from __future__ import annotations

import numpy as np

from dflash_gguf import _bindings as B
from dflash_gguf.engine import Context, DrafterInfo
from dflash_gguf.errors import DFlashError

MAX_ROWS = 64    # injected when this many rows are buffered (host memory: MAX_ROWS * n_taps * n_embd floats;
                 # a larger one saves little: injecting costs about 6.5 us a row and 60 us a call on the demo pair)


class FeatureFeed:
    def __init__(self, target: Context, drafter: Context, info: DrafterInfo, seq: int = 0):
        self.target, self.drafter = target, drafter
        self.seq = seq
        self.taps = np.asarray(info.target_layers, dtype=np.int32)
        self._taps_c = B.ffi.from_buffer("int32_t[]", self.taps)
        self.row = len(self.taps) * target.model.n_embd
        self.buf: np.ndarray | None = None      # allocated on first use
        self._buf_c = None                      # ... and its C view (keep() runs once per plain step)
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

    def inject(self, pos: int, n_rows: int, what: str, end: int | None = None, row0: int = 0) -> None:
        """Rows ``row0..row0+n_rows`` of the target's last decode, at ``pos``, straight into the drafter.

        ``end``: the position the cache will reach once a longer fill (a prompt in chunks) is done;
        rows the window drops by then are skipped now.
        """
        self.flush()
        skip = self._first_kept(pos, n_rows, end)
        if n_rows > skip:
            B.check(B.lib.llama_dflash_inject(self.drafter.cptr, self.target.cptr, self.seq, pos + skip, row0 + skip,
                                              n_rows - skip), what)

    def keep(self, pos: int, n_rows: int, row0: int = 0) -> None:
        """Rows ``row0..row0+n_rows`` of the target's last decode, at ``pos``, into the host buffer."""
        if n_rows == 0:
            return
        if self.n and self.start + self.n != pos or self.n + n_rows > MAX_ROWS:
            self.flush()
        if self.buf is None:
            self.buf = np.empty((MAX_ROWS, self.row), dtype=np.float32)
            self._buf_c = B.ffi.from_buffer("float[]", self.buf)
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
