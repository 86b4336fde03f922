"""One target's verify cost per row count: a k-row decode after a short prompt, fastest of N calls.

    python bench/verify_rows.py TARGET.gguf [ROWS] [CALLS] [--threads T]

ROWS: comma list (default 1,2,4,8,16); CALLS per row count (default 10). Prints one line per row
count: fastest and median milliseconds, and the fastest over the one-row decode's. The ggml libraries
are whichever the process loads: ``LD_LIBRARY_PATH=DIR`` puts another build's ``libggml*.so`` (a
variant, an older series) in front of the wheel's, for an A/B of kernels on the same libllama
(BENCHMARKS.md section 9, "Weight prefetch"); ``GGML_CPU_X86MM=0`` gives ggml's own kernels.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from dflash_gguf.native.engine import Context, ContextOptions, Model

PROMPT = b"def merge_sorted(a, b):\n    out = []\n    i = j = 0\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("rows", nargs="?", default="1,2,4,8,16")
    ap.add_argument("calls", nargs="?", type=int, default=10)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    tm = Model(a.target)
    ids = tm.tokenize(PROMPT, add_bos=False)
    ctx = Context(tm, ContextOptions(n_ctx=256, n_batch=512, n_ubatch=512, n_threads=a.threads))
    ctx.decode(np.array(ids, dtype=np.int32), 0, out_row0=len(ids) - 1, argmax=np.zeros(1, dtype=np.int32))
    pos, rng, t1 = len(ids), np.random.default_rng(0), None
    for k in (int(x) for x in a.rows.split(",")):
        batch = rng.integers(0, tm.n_vocab, k).astype(np.int32)
        am = np.zeros(k, dtype=np.int32)
        ts = []
        for _ in range(a.calls):
            t0 = time.perf_counter()
            ctx.decode(batch, pos, out_row0=0, argmax=am)
            ts.append(time.perf_counter() - t0)
            ctx.truncate(pos)
        best = min(ts) * 1e3
        t1 = best if k == 1 else t1
        ratio = f"  {best / t1:.2f} x t1" if t1 else ""
        print(f"{k} min {best:.1f} ms  med {np.median(ts) * 1e3:.1f}{ratio}", flush=True)
    ctx.close()
    tm.close()


if __name__ == "__main__":
    main()
