"""What transparent huge pages buy a decode (patches/0024): one target loaded twice in one process, one
copy's large buffers allocated under ``GGML_HUGE_PAGES=0`` (4 KiB pages), the other as the library does
by default (huge pages advised); k-row decodes alternate between the copies round by round.

    python bench/huge_pages.py TARGET.gguf [--rows 1,16] [--rounds 8] [--calls 16] [--threads 2]

Prints, per round and row count, each copy's median milliseconds over ``--calls`` decodes and the
ratio huge / 4 KiB (below 1: huge pages faster), then the median ratio over the rounds, and how much
of each copy's anonymous memory the kernel backed with huge pages (``AnonHugePages`` of its mappings).
The order of the copies flips every round.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.native.logs import set_log_handler

PROMPT = b"def merge_sorted(a, b):\n    out = []\n    i = j = 0\n"


def _big_mappings() -> dict[tuple[int, int], int]:
    """Anonymous writable mappings of 32 MiB and more: (start, end) -> AnonHugePages in kB."""
    out, cur = {}, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = (a, b) if len(head) == 5 and head[1] == "rw-p" and b - a >= 32 << 20 else None
            elif cur is not None and line.startswith("AnonHugePages:"):
                out[cur] = int(head[1])
    return out


def load(path: str, huge: bool, threads: int):
    before = set(_big_mappings())
    if huge:
        os.environ.pop("GGML_HUGE_PAGES", None)
    else:
        os.environ["GGML_HUGE_PAGES"] = "0"
    try:
        model = Model(path)
        ctx = Context(model, ContextOptions(n_ctx=256, n_batch=512, n_ubatch=512, n_threads=threads))
    finally:
        os.environ.pop("GGML_HUGE_PAGES", None)
    return model, ctx, set(_big_mappings()) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=16)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    set_log_handler()       # llama.cpp's load log into logging (not shown)
    copies = {"4k": load(a.target, False, a.threads), "huge": load(a.target, True, a.threads)}
    now = _big_mappings()
    for name, (_, _, maps) in copies.items():
        total = sum(b - a_ for a_, b in maps) >> 20
        print(f"{name}: {total} MiB in large mappings, {sum(now.get(m, 0) for m in maps) >> 10} MiB of it on huge pages")
    model = copies["4k"][0]
    ids = np.array(model.tokenize(PROMPT, add_bos=False), dtype=np.int32)
    rng = np.random.default_rng(0)
    for _, ctx, _ in copies.values():
        ctx.decode(ids, 0, argmax=np.zeros(1, dtype=np.int32))
    rows = [int(x) for x in a.rows.split(",")]
    ratios: dict[int, list[float]] = {k: [] for k in rows}
    for r in range(a.rounds):
        order = ["4k", "huge"] if r % 2 == 0 else ["huge", "4k"]
        for k in rows:
            batch = rng.integers(0, model.n_vocab, k).astype(np.int32)
            am = np.zeros(k, dtype=np.int32)
            med = {}
            for name in order:
                ctx = copies[name][1]
                ts = []
                for _ in range(a.calls):
                    t0 = time.perf_counter()
                    ctx.decode(batch, len(ids), out_row0=0, argmax=am)
                    ts.append(time.perf_counter() - t0)
                    ctx.truncate(len(ids))
                med[name] = float(np.median(ts)) * 1e3
            ratios[k].append(med["huge"] / med["4k"])
            print(f"round {r} rows {k:>2}: 4k {med['4k']:.2f} ms  huge {med['huge']:.2f} ms  huge/4k {ratios[k][-1]:.3f}",
                  flush=True)
    for k in rows:
        print(f"rows {k}: median huge/4k {float(np.median(ratios[k])):.3f} over {a.rounds} rounds "
              f"({min(ratios[k]):.3f}-{max(ratios[k]):.3f})")
    for model, ctx, _ in copies.values():
        ctx.close()
        model.close()


if __name__ == "__main__":
    main()
