"""Block verify on ggml's AMX path vs the regular CPU path: t_verify(k) / t_decode(1), k = 1..16.

    python bench/amx_verify.py --pair DIR [--pair DIR ...] [--trials 3] [--repeats 5] [--threads 2]
    python bench/amx_verify.py --model target.gguf [--draft drafter.gguf]

Each (pair, mode) is measured in its own process, because ``GGML_CPU_AMX`` decides at library load
whether quantized weights are repacked for AMX (mode ``on``: AMX tiles for 2..n rows, AVX512-VNNI
for one row) or take the regular path (mode ``off``: ggml's CPU_REPACK / AVX-512 kernels). Trials
interleave the modes (on, off, on, off, ...) so that a burst of load from elsewhere hits both.

Per process: the target decodes a 64-token prompt, then for k = 1..16 the time of one k-row decode
at the end of it with per-row argmax (what a DFlash verify step costs; the cache is cut back after
each call), fastest of ``repeats`` calls; the 64-token prompt itself (prefill); with a drafter, one
drafter call proposing 15 tokens. The report gives, per mode, the median over trials and the
spread (min..max), t_verify(k)/t1, and the DFlash speed-up those costs allow at two acceptance
profiles (tau * t1 / (t_draft + t_verify(16)), block 16): the demo pair's measured profile and a
strong drafter's. Pairs: any target/drafter GGUF pair, e.g. the synthetic Qwen3-shaped pairs of the
scale benchmark (random weights: acceptance is not measured here, only costs).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("dflash_gguf.bench.amx_verify")

# P(at least i drafted tokens accepted), i = 1..15 (block 16): the demo pair's measured profile with
# a geometric tail, and a strong block-16 drafter (0.885^i), as in the scale benchmark
PROFILES = {
    "demo": [0.78, 0.68, 0.61, 0.56, 0.51, 0.46, 0.42],
    "strong": [0.885 ** i for i in range(1, 16)],
}
for _name, _p in PROFILES.items():
    while len(_p) < 15:
        _p.append(_p[-1] * _p[-1] / _p[-2])


def tau(profile: list[float]) -> float:
    return 1.0 + sum(profile)


def child(args) -> dict:
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder

    opts = ContextOptions(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=args.threads)
    target = Model(args.model)
    tctx = Context(target, opts)
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, min(target.n_vocab, 30000), 64).astype(np.int32)
    res: dict = {"mode": os.environ.get("GGML_CPU_AMX", ""), "model": str(args.model)}

    ts = []
    for _ in range(args.repeats + 1):
        tctx.truncate(0)
        t0 = time.perf_counter()
        tctx.decode(prompt, 0, argmax=np.zeros(1, dtype=np.int32))
        ts.append(time.perf_counter() - t0)
    res["prefill64_ms"] = 1e3 * min(ts[1:])
    pos = len(prompt)
    verify = {}
    for rows in range(1, args.max_rows + 1):
        batch = rng.integers(100, min(target.n_vocab, 30000), rows).astype(np.int32)
        am = np.zeros(rows, dtype=np.int32)
        ts = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            tctx.decode(batch, pos, out_row0=0, argmax=am)
            ts.append(time.perf_counter() - t0)
            tctx.truncate(pos)
        verify[rows] = 1e3 * min(ts[1:])
    res["verify_ms"] = verify
    if args.draft:
        drafter = Model(args.draft)
        dctx = Context(drafter, opts, other=tctx)
        dec = DFlashDecoder(tctx, dctx)
        tctx.truncate(0)
        first = list(dec.generate(prompt.tolist(), 1, stop_tokens=[]))
        pos, pending = len(prompt), first[-1]
        n_draft = args.max_rows - 1
        buf = np.zeros(64, dtype=np.int32)
        ts = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            B.check(B.lib.llama_dflash_draft(dctx.cptr, 0, pos, pending, n_draft,
                                             B.ffi.from_buffer("llama_token[]", buf)), "drafting")
            ts.append(time.perf_counter() - t0)
        res["draft_ms"] = 1e3 * min(ts[1:])
        res["n_draft"] = n_draft
    return res


def run_one(model: Path, draft: Path | None, mode: str, args) -> dict:
    env = dict(os.environ, GGML_CPU_AMX="1" if mode == "on" else "0")
    cmd = [sys.executable, __file__, "--child", "--model", str(model), "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--max-rows", str(args.max_rows)]
    if draft:
        cmd += ["--draft", str(draft)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{mode} on {model} failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["mode"] = mode
    return out


def summarize(runs: list[dict], max_rows: int) -> dict:
    def med(xs):
        return statistics.median(xs), min(xs), max(xs)

    s = {"trials": len(runs), "prefill64_ms": med([r["prefill64_ms"] for r in runs])}
    s["verify_ms"] = {k: med([r["verify_ms"][str(k)] for r in runs]) for k in range(1, max_rows + 1)}
    t1 = s["verify_ms"][1][0]
    s["ratio"] = {k: s["verify_ms"][k][0] / t1 for k in range(1, max_rows + 1)}
    if all("draft_ms" in r for r in runs):
        s["draft_ms"] = med([r["draft_ms"] for r in runs])
        step = s["draft_ms"][0] + s["verify_ms"][max_rows][0]
        s["speedup"] = {name: tau(p[:max_rows - 1]) * t1 / step for name, p in PROFILES.items()}
        s["break_even_tau"] = step / t1
    return s


def report(results: dict, max_rows: int) -> str:
    lines = []
    for name, modes in results.items():
        lines.append(f"### {name}\n")
        hdr = "| k | " + " | ".join(f"AMX {m}: t_verify(k) ms (min..max) | /t1" for m in modes) + " |"
        lines += [hdr, "|---|" + "---|---|" * len(modes)]
        for k in range(1, max_rows + 1):
            cells = []
            for s in modes.values():
                v, lo, hi = s["verify_ms"][k]
                cells.append(f"{v:.1f} ({lo:.1f}..{hi:.1f}) | {s['ratio'][k]:.2f}")
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        for m, s in modes.items():
            v, lo, hi = s["prefill64_ms"]
            extra = f"64-token prompt {v:.0f} ms ({lo:.0f}..{hi:.0f})"
            if "draft_ms" in s:
                d = s["draft_ms"]
                extra += (f"; draft ({max_rows - 1} tokens) {d[0]:.1f} ms ({d[1]:.1f}..{d[2]:.1f}); break-even tau "
                          f"{s['break_even_tau']:.2f}; cost-model speed-up: "
                          + ", ".join(f"{p} {x:.2f}x" for p, x in s["speedup"].items()))
            lines.append(f"\nAMX {m}: {extra}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, action="append", default=[], help="pair directory (target.gguf, drafter.gguf)")
    ap.add_argument("--model", type=Path, help="target GGUF (instead of --pair)")
    ap.add_argument("--draft", type=Path, help="drafter GGUF for --model")
    ap.add_argument("--modes", default="on,off")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5, help="calls per measurement; the fastest is kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-rows", type=int, default=16)
    ap.add_argument("--out", type=Path, help="write the JSON results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        print(json.dumps(child(args)))
        return 0
    cases = [(p.name, p / "target.gguf", p / "drafter.gguf") for p in args.pair]
    if args.model:
        cases.append((args.model.stem, args.model, args.draft))
    if not cases:
        ap.error("give --pair DIR or --model GGUF")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results, raw = {}, {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    log.info("load average before: %s", os.getloadavg())
    for name, model, draft in cases:
        runs = {m: [] for m in modes}
        for t in range(args.trials):
            for m in modes:
                r = run_one(model, draft if draft and draft.is_file() else None, m, args)
                runs[m].append(r)
                log.info("%s trial %d AMX %s: t1 %.1f ms, t%d %.1f ms, load %.1f", name, t + 1, m,
                         r["verify_ms"]["1"], args.max_rows, r["verify_ms"][str(args.max_rows)], os.getloadavg()[0])
        raw[name] = runs
        results[name] = {m: summarize(runs[m], args.max_rows) for m in modes}
    log.info("load average after: %s", os.getloadavg())
    print(report(results, args.max_rows))
    if args.out:
        args.out.write_text(json.dumps({"summary": results, "runs": raw, "args": vars(args)}, default=str, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
