"""Decode batches of 1, 2, 4, 8 and 16 rows on one model and time each: the shapes DFlash runs (a
one-row decode, a verify of 2-16 rows). Run by tests/test_sme2.py in the emulated aarch64 CPython, and
on a real Arm CPU as it is (docs/arm.md): with ggml's KleidiAI log it says which kernel family serves
each row count, and on real hardware how long each takes.

Prints one JSON object: per row count, the seconds per decode, and ggml's KleidiAI log lines.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time

from arm_guest import Grab   # beside this script (run from tests/ or copied with it)

ROWS = (1, 2, 4, 8, 16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="timed decodes per row count")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    a = ap.parse_args(argv)

    grab = Grab(re.compile("kleidiai", re.I))
    logger = logging.getLogger("rows.llama_cpp")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(grab)
    from dflash_gguf.native.logs import set_log_handler
    set_log_handler(logger)
    import numpy as np
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    m = Model(a.target)
    c = Context(m, ContextOptions(n_ctx=256, n_threads=a.threads))
    toks = np.array(m.tokenize(b"def read_lines(path):\n    with open(path) as f:\n        return f.read()\n"),
                    dtype=np.int32)
    out = {}
    for rows in map(int, a.rows.split(",")):
        t = []
        for _ in range(a.repeat):
            c.clear()
            print(f"ROWS {rows}", file=sys.stderr, flush=True)   # marks where each row count starts
            t0 = time.perf_counter()
            c.decode(toks[:rows], 0, out_row0=rows - 1)
            t.append(time.perf_counter() - t0)
        out[rows] = round(min(t), 6)
    c.close(), m.close()
    print(json.dumps({"seconds": out, "log": grab.lines}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
