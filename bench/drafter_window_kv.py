"""The drafter context's KV and compute buffers at several windows, from llama.cpp's own buffer sizes.

    python bench/drafter_window_kv.py [PAIR_DIR] [--windows 1008,2032,4080]

PAIR_DIR defaults to the cached Qwen3-1.7B-shaped Q4_0 ``bench.scale`` pair with the reduced draft head
(its drafter: 5 layers, block 16). Buffers are what llama.cpp allocates when the context is made.
"""
from __future__ import annotations

import argparse
import logging

from dflash_gguf.bench.scale import headline
from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.native.logs import set_log_handler


class _Sizes(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if "buffer size" in msg:
            self.lines.append(msg.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pair", nargs="?", help="pair directory (target.gguf + drafter.gguf)")
    ap.add_argument("--windows", default="1008,2032,4080")
    a = ap.parse_args()
    sizes = _Sizes()
    logging.getLogger().addHandler(sizes)
    logging.getLogger().setLevel(logging.DEBUG)
    set_log_handler()
    if a.pair:
        target, drafter = f"{a.pair}/target.gguf", f"{a.pair}/drafter.gguf"
    else:
        target, drafter = headline.prepare("1.7b", "q4_0")
    with Model(target) as tm, Model(drafter) as dm:
        tc = Context(tm, ContextOptions(n_ctx=8192, n_batch=512, n_ubatch=512, n_threads=2))
        for w in (int(x) for x in a.windows.split(",")):
            sizes.lines.clear()
            dc = Context(dm, ContextOptions(n_ctx=8192, n_batch=512, n_ubatch=512, n_threads=2, draft_window=w),
                         other=tc)
            kv = [ln for ln in sizes.lines if "KV buffer" in ln]
            cb = [ln for ln in sizes.lines if "compute buffer" in ln]
            print(f"window {dc.window}: {kv[-1] if kv else '?'} | {cb[-1] if cb else '?'}")
            dc.close()
        tc.close()


if __name__ == "__main__":
    main()
