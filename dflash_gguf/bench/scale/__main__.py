"""``python -m dflash_gguf.bench.scale``: the scale benchmark's command line (see the package docstring)."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_gguf.bench.scale import synth
from dflash_gguf.bench.scale.replay import DESCRIPTIONS, PROFILES

log = logging.getLogger("dflash_gguf.bench.scale")

LABEL = "synthetic random weights, replayed acceptance"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.scale", description=__doc__)
    ap.add_argument("--shapes", default="0.6b,1.7b,4b", help=f"comma list of {', '.join(synth.SHAPES)} "
                    "(8b only where memory allows; default 0.6b,1.7b,4b)")
    ap.add_argument("--types", default="q4_0,q8_0", help="comma list of q4_0, q8_0")
    ap.add_argument("--profiles", nargs="+", default=["demo", "strong", "none"], help="acceptance profiles: "
                    f"names ({', '.join(PROFILES)}, demo-dspark), 'p1,p2,...' lists of P(accepted >= i), or JSON list files")
    ap.add_argument("--draft-vocab", default="32768", help="also run a drafter with a reduced head of N rows "
                    "(python -m dflash_gguf.convert.draft_vocab); 'off' to skip")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default 128)")
    ap.add_argument("--trials", type=int, default=3, help="trials per column, interleaved (default 3)")
    ap.add_argument("--repeats", type=int, default=5, help="calls per cost measurement (fastest kept)")
    ap.add_argument("-t", "--threads", type=int, default=None, help="threads (default: all cores)")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers of the target and the drafter "
                    "to offload to the GPU (default 0; 99: all), ours and upstream's")
    ap.add_argument("--gate", action="store_true", help="also run every profile with the speed gate on")
    ap.add_argument("--gate-only", action="store_true", help="run every profile with the speed gate on only "
                    "(no fixed-drafting columns: long runs of slow profiles)")
    ap.add_argument("--gate-warm", action="store_true", help="gated columns keep one decoder for all trials, as a "
                    "Llama keeps its gate between calls (the first, cold trial is reported apart from the median)")
    ap.add_argument("--no-own", action="store_true", help="skip the random drafter's own proposals (slow columns "
                    "at acceptance 1; upstream's column is the comparison for them)")
    ap.add_argument("--no-upstream", action="store_true", help="skip upstream's llama-speculative-simple column")
    ap.add_argument("--out", default="bench/results", help="folder for scale-<tag>.json and .md")
    ap.add_argument("--tag", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--seed", type=int, default=0, help="weights seed of the synthetic pairs")
    ap.add_argument("--kernels", default="x86mm", help="comma list of kernel sets, each case run once per set in "
                    "this run: x86mm (patches/0014's CPU_X86MM, the default on x86), amx (ggml's AMX path, as before "
                    "0014 on a CPU with AMX-INT8) and ggml (ggml's own kernels without AMX, as before 0014 elsewhere)")
    return ap


def _mem_ok(shape: str, wtype: str) -> bool:
    s = synth.SHAPES[shape]
    need = s.params * (18 / 32 if wtype == "q4_0" else 34 / 32) * 1.3
    try:
        avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return True
    return avail > need * 1.5


# kernel sets: the ggml switches each sets for the case's child processes (ours and upstream's); AMX's
# switch only matters on a CPU with AMX-INT8 (patches/0004: on by default, after CPU_X86MM)
KERNELS = {"x86mm": {"GGML_CPU_X86MM": "1"},
           "amx": {"GGML_CPU_X86MM": "0", "GGML_CPU_AMX": "1"},
           "ggml": {"GGML_CPU_X86MM": "0", "GGML_CPU_AMX": "0"}}


@contextlib.contextmanager
def kernel_env(name: str):
    saved = {k: os.environ.get(k) for k in KERNELS[name]}
    os.environ.update(KERNELS[name])
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_one(case: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="dflash-scale-") as tmp:
        cf, of = Path(tmp) / "case.json", Path(tmp) / "out.json"
        cf.write_text(json.dumps(case))
        r = subprocess.run([sys.executable, "-m", "dflash_gguf.bench.scale.run", str(cf), str(of)])
        if r.returncode != 0 or not of.is_file():
            raise RuntimeError(f"scale case {case['name']} failed (exit {r.returncode})")
        return json.loads(of.read_text())


def run_upstream(pair: Path, tokens: int, threads: int, ngl: int = 0) -> dict:
    from dflash_gguf.bench.scale.run import PROMPT
    from dflash_gguf.bench.upstream import run_upstream_one, upstream_binary

    exe, why = upstream_binary()
    if exe is None:
        return {"skipped": why}
    got, _ = run_upstream_one(exe, pair / "target.gguf", pair / "drafter.gguf", PROMPT, tokens,
                              synth.BLOCK_SIZE - 1, threads,
                              extra=("-ngl", str(ngl), "-ngld", str(ngl)) if ngl else ())
    return {"tps": got.get("tps"), "acceptance_length": got.get("mean_acc_len"),
            "peak_rss_mb": got.get("peak_rss_mb"), "n_decoded": got.get("n_decoded")}


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(results: list[dict], meta: dict) -> str:
    L = [f"Scale benchmark ({LABEL}). {meta['command']}", "",
         f"Machine: {meta['cpu']}, {meta['cores']} cores, load average at start {meta['load_start']}, "
         f"at end {meta['load_end']}; {meta['threads']} threads; {meta['tokens']} tokens x {meta['trials']} trials.", "",
         "Costs (fastest of the repeats, ms): one-row decode t1, k-row verify, one drafter call drafting 15 "
         "tokens (full head / reduced head), break-even acceptance length (t_draft + t_verify(16)) / t1.", "",
         "| pair | t1 | verify k=2 / 4 / 8 / 16 (x t1 at 16) | drafter call full / reduced "
         "| break-even full / reduced | peak RSS |",
         "|---|---|---|---|---|---|"]
    for r in results:
        ds = r["drafters"]
        full = ds.get("full", {}).get("costs", {})
        red = next((d["costs"] for k, d in ds.items() if k != "full"), {})
        v = full.get("verify_ms", {})
        g = lambda k, v=v: v.get(k) or v.get(str(k))  # noqa: E731
        L.append(f"| {r['name']} | {_f(full.get('t1_ms'))} | {_f(g(2))} / {_f(g(4))} / {_f(g(8))} / {_f(g(16))} "
                 f"({_f((g(16) or 0) / (full.get('t1_ms') or 1), 2)}x) | {_f(full.get('draft_ms'))} / "
                 f"{_f(red.get('draft_ms'))} | {_f(full.get('break_even_tau'), 2)} / {_f(red.get('break_even_tau'), 2)} "
                 f"| {_f(r.get('peak_rss_mb'), 0)} MB |")
    ks = range(1, 17)
    L += ["", "Verify cost per row count: t_verify(k) / t1 (full-head drafter's case).", "",
          "| pair | " + " | ".join(f"k={k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for r in results:
        full = r["drafters"].get("full", {}).get("costs", {})
        v, t1 = full.get("verify_ms", {}), full.get("t1_ms") or 0
        if t1:
            L.append(f"| {r['name']} | " + " | ".join(_f((v.get(k) or v.get(str(k)) or 0) / t1, 2) for k in ks) + " |")
    L += ["", "Speed (tokens/s median; `x` = vs plain in the same run; tau = measured acceptance length; "
          "ideal = tau * t1 / (t_draft + t_verify(16))). `own` = the random drafter's own proposals "
          "(acceptance ~1), the case upstream's column runs.", ""]
    cols = []
    for r in results:
        for lab, d in r["drafters"].items():
            for name in d["runs"]:
                if (lab, name) not in cols:
                    cols.append((lab, name))
    L.append("| pair | plain | " + " | ".join(f"{n} ({lab} head)" for lab, n in cols) + " | upstream C++ (own) |")
    L.append("|---|---|" + "---|" * len(cols) + "---|")
    for r in results:
        cells = []
        for lab, name in cols:
            x = r["drafters"].get(lab, {}).get("runs", {}).get(name)
            if not x:
                cells.append("-")
                continue
            ideal = f", ideal {x['ideal_x_plain']:.2f}x" if x.get("ideal_x_plain") else ""
            cold = f", first call {x['tps_cold']:.2f}" if x.get("tps_cold") else ""
            cells.append(f"{x['tps_median']:.2f} ({x['x_plain']:.2f}x, tau {x['tau']:.2f}{ideal}{cold})")
        up = r.get("upstream") or {}
        if up.get("tps"):
            ux = up["tps"] / r["plain_tps_median"]
            ucell = f"{up['tps']:.2f} ({ux:.2f}x, tau {_f(up.get('acceptance_length'), 2)}, {_f(up.get('peak_rss_mb'), 0)} MB)"
        else:
            ucell = up.get("skipped", "-")
        L.append(f"| {r['name']} | {r['plain_tps_median']:.2f} | " + " | ".join(cells) + f" | {ucell} |")
    L += ["", "Profiles: " + "; ".join(f"`{k}` {v}" for k, v in DESCRIPTIONS.items()) + "."]
    return "\n".join(L) + "\n"


def _load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dflash_gguf.native.logs import set_log_handler

    set_log_handler()     # llama.cpp's own log goes to logging at DEBUG
    shapes = [s.strip() for s in a.shapes.split(",") if s.strip()]
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    for s in shapes:
        if s not in synth.SHAPES:
            raise SystemExit(f"error: unknown shape {s!r} (one of {', '.join(synth.SHAPES)})")
    for t in types:
        if t not in synth.TYPES:
            raise SystemExit(f"error: unknown type {t!r} (one of {', '.join(synth.TYPES)})")
    kernels = [k.strip() for k in a.kernels.split(",") if k.strip()]
    for k in kernels:
        if k not in KERNELS:
            raise SystemExit(f"error: unknown kernel set {k!r} (one of {', '.join(KERNELS)})")
    profiles = a.profiles
    from dflash_gguf.bench.scale.replay import parse_profile

    for p in profiles:
        parse_profile(p)          # fail early on a bad profile
    dv = None if a.draft_vocab.lower() == "off" else int(a.draft_vocab)
    threads = a.threads or os.cpu_count() or 1
    from dflash_gguf.bench.results import machine_info

    mi = machine_info()
    args = argv if argv is not None else sys.argv[1:]
    meta = {"label": LABEL, "command": "python -m dflash_gguf.bench.scale " + " ".join(args),
            "cpu": mi["cpu"], "cores": mi["cores"], "threads": threads, "tokens": a.tokens, "trials": a.trials,
            "load_start": _load(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    results = []
    for s in shapes:
        for t in types:
            name = f"qwen3-{s} {t.upper()}"
            if not _mem_ok(s, t):
                log.warning("skipping %s: not enough free memory for it", name)
                results.append({"name": name, "skipped": "memory", "drafters": {}, "plain_tps_median": 0})
                continue
            pair = synth.make_pair(s, t, seed=a.seed)
            drafters = {"full": str(pair / "drafter.gguf")}
            if dv:
                drafters[f"dv{dv}"] = str(synth.reduced_pair(pair, dv) / "drafter.gguf")
            for kern in kernels:
                kname = name if kernels == ["x86mm"] else f"{name} ({kern})"
                case = {"name": kname, "target": str(pair / "target.gguf"), "drafters": drafters,
                        "profiles": profiles, "tokens": a.tokens, "trials": a.trials, "repeats": a.repeats,
                        "threads": threads, "gate": "only" if a.gate_only else (a.gate or a.gate_warm),
                        "gate_warm": a.gate_warm, "own": not a.no_own, "n_gpu_layers": a.n_gpu_layers}
                log.info("case %s", kname)
                with kernel_env(kern):
                    r = run_one(case)
                    r["name"], r["kernels"] = kname, kern
                    if not a.no_upstream:
                        try:
                            r["upstream"] = run_upstream(pair, a.tokens, threads, a.n_gpu_layers)
                        except Exception as e:  # noqa: BLE001 - the other columns stand on their own
                            log.warning("upstream column failed: %s", e)
                            r["upstream"] = {"skipped": f"failed: {e}"}
                results.append(r)
    meta["load_end"] = _load()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown([r for r in results if r.get("drafters")], meta)
    (out / f"scale-{a.tag}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    (out / f"scale-{a.tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
