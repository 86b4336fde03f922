"""Side-by-side benchmark: plain decoding vs our DFlash vs upstream llama.cpp's C++ DFlash.

    python -m dflash_gguf.bench                                   # shipped demo pair, code prompts
    python -m dflash_gguf.bench --prompts all --trials 5 --max-tokens 128
    python -m dflash_gguf.bench -m target.gguf -md drafter.gguf --prompts prompts.txt
    python -m dflash_gguf.bench --sweep-block                     # n_draft = 1 .. block_size - 1
    python -m dflash_gguf.bench --profile                         # CPU cost profile (verify rows, draft)

Columns, all greedy (temperature 0) on the same GGUF pair in one process:

* ``plain``    - :class:`dflash_gguf.decoding.DFlashDecoder` with no drafter: one target pass per token;
* ``dflash``   - our DFlash loop (drafter proposes a block, the target verifies it in one pass);
* ``upstream`` - ``llama-speculative-simple --spec-type draft-dflash`` from ``dflash_gguf.paths.tools_dir()``
  (one subprocess per prompt; its own ``decoded N tokens in X s`` timer, which like ours excludes
  the prompt).

Tokens/s excludes prompt processing; each trial runs every prompt once, modes interleaved per
trial so a machine whose load changes affects all columns alike. Results go to ``--out``
(``results.json``, ``results.png`` when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from dflash_gguf.bench.ours import profile, run_ours, sweep, top2_gap
from dflash_gguf.bench.prompts import load_prompts
from dflash_gguf.bench.report import print_summary, write_chart
from dflash_gguf.bench.results import ModeResult, _peak_rss_mb, _r, _rss_mb, machine_info, versions
from dflash_gguf.bench.upstream import run_upstream, run_upstream_one, upstream_binary

log = logging.getLogger("dflash_gguf.bench")

NEAR_TIE = 1e-2   # top-2 logit gap below which batched-vs-single-row rounding may flip a greedy choice


# --------------------------------------------------------------------------- chart
def _parse(argv):
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    from dflash_gguf.options import add_flag

    m = ap.add_argument_group("model (without -m: the shipped demo pair)")
    add_flag(m, "model", type=Path)
    add_flag(m, "draft", type=Path)
    add_flag(m, "threads", "cores, at most 8")
    add_flag(m, "gpu_layers")
    add_flag(m, "gpu_layers_draft")
    add_flag(m, "draft_max", dest="n_draft")
    add_flag(m, "draft_adaptive", dest="adaptive")
    ap.add_argument("--prompts", nargs="+", default=["code"],
                    help="prompt sets (code, math, prose, all) or files with '### name' headers (default: code)")
    add_flag(ap, "n_predict", default=128)
    ap.add_argument("--trials", type=int, default=3, help="timed trials; each runs every prompt (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of each mode (default 1)")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream llama.cpp column")
    ap.add_argument("--sweep-block", action="store_true", help="also run n_draft = 1 .. block_size - 1")
    ap.add_argument("--profile", action="store_true", help="also profile verify cost vs rows and draft cost")
    ap.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default ./bench-results)")
    ap.add_argument("--tag", default=None, help="name of the result files (default results)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv=None) -> int:
    a = _parse(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, format="%(message)s")
    logging.getLogger("dflash_gguf.llama_cpp").setLevel(logging.DEBUG if a.verbose else logging.ERROR)
    from dflash_gguf.demo import demo_pair
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.native.logs import set_log_handler
    from dflash_gguf.decoding import DFlashDecoder, SpecOptions

    set_log_handler()
    tpath, dpath = demo_pair()
    tpath = a.model or tpath
    dpath = a.draft or (None if a.model else dpath)
    if dpath is None:
        log.error("--model needs --draft (the DFlash drafter for that target)")
        return 2
    for p in (tpath, dpath):
        if not Path(p).is_file():
            log.error("model not found: %s", p)
            return 2
    prompts = load_prompts(a.prompts)
    threads = a.threads or min(8, os.cpu_count() or 1)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None

    rss0 = _rss_mb()
    ngl = a.n_gpu_layers
    ngld = a.draft_n_gpu_layers if a.draft_n_gpu_layers is not None else ngl
    gpu_args = ("-ngl", str(ngl), "-ngld", str(ngld)) if ngl or ngld else ()
    tm = Model(tpath, n_gpu_layers=ngl)
    opts = ContextOptions(n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=threads)
    tctx = Context(tm, opts)
    rss_t = _rss_mb()
    dm = Model(dpath, n_gpu_layers=ngld)
    dctx = Context(dm, opts, other=tctx)
    rss_d = _rss_mb()
    plain = DFlashDecoder(tctx, None)
    spec = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=a.n_draft, adaptive=a.adaptive))
    n_draft = spec.n_draft
    ids = [tm.tokenize(p["text"].encode("utf-8")) for p in prompts]
    echoes = [tm.detokenize(i, special=True) for i in ids]

    exe, why = (None, "--no-upstream") if a.no_upstream else upstream_binary()
    if exe is None and not a.no_upstream:
        log.warning("upstream column skipped: %s", why)

    log.info("bench: %d prompts (%s), %d tokens each, %d trials + %d warm-up, %d threads, n_draft %d (block %d)",
             len(prompts), ", ".join(a.prompts), a.max_tokens, a.trials, a.warmup, threads, n_draft,
             spec.info.block_size)
    modes = {"plain": ModeResult("plain"), "dflash": ModeResult("dflash")}
    if exe is not None:
        modes["upstream"] = ModeResult("upstream")
    # warm-up: first prompt, each mode
    for _ in range(a.warmup):
        w = ModeResult("warmup")
        run_ours(plain, prompts[:1], ids[:1], min(a.max_tokens, 32), w, tm, False)
        run_ours(spec, prompts[:1], ids[:1], min(a.max_tokens, 32), w, tm, False)
        if exe is not None:
            run_upstream_one(exe, tpath, dpath, prompts[0]["text"], min(a.max_tokens, 32), n_draft, threads,
                             extra=gpu_args)
    for t in range(a.trials):
        first = t == 0
        line = [f"trial {t + 1}/{a.trials}:"]
        line.append(f"plain {run_ours(plain, prompts, ids, a.max_tokens, modes['plain'], tm, first):.1f}")
        line.append(f"dflash {run_ours(spec, prompts, ids, a.max_tokens, modes['dflash'], tm, first):.1f}")
        if exe is not None:
            tps = run_upstream(exe, tpath, dpath, prompts, echoes, a.max_tokens, n_draft, threads, modes["upstream"],
                               modes["dflash"].raw, modes["plain"].raw, first, extra=gpu_args)
            line.append(f"upstream {tps:.1f}")
        log.info("%s tokens/s", " ".join(line))

    # token-by-token check against plain decoding; where they part, measure the target's top-2 logit
    # gap there: a near-tie flipped by rounding (batched rows vs one row) is a property of the kernels,
    # which upstream's loop shows identically, not of the DFlash loop
    diffs = {}
    for p, tok_ids in zip(prompts, ids):
        key = f"{p['set']}/{p['name']}"
        a_, b_ = modes["plain"].tokens[key], modes["dflash"].tokens[key]
        if a_ != b_:
            i = next((k for k in range(min(len(a_), len(b_))) if a_[k] != b_[k]), min(len(a_), len(b_)))
            gap = top2_gap(tctx, tok_ids + a_[:i])
            diffs[key] = {"first_difference": i, "plain_top2_logit_gap": _r(gap, 6),
                          "near_tie": gap is not None and gap < NEAR_TIE}
    equal_ours = not diffs
    up_equal = up_equal_plain = None
    if exe is not None:
        up_equal = all(pp.get("tokens_equal_ours") is True for pp in modes["upstream"].per_prompt.values())
        up_equal_plain = all(pp.get("tokens_equal_plain") is True for pp in modes["upstream"].per_prompt.values())
    summ = {k: m.summary() for k, m in modes.items()}
    summ["plain"]["peak_rss_mb"] = _r(_peak_rss_mb(), 1)   # whole process: both models loaded
    summ["dflash"]["peak_rss_mb"] = summ["plain"]["peak_rss_mb"]
    if exe is not None:
        summ["upstream"]["binary"] = str(exe)
    else:
        summ["upstream"] = {"skipped": True, "reason": why}

    def ratio(x, y):
        try:
            return _r(summ[x]["tokens_per_second"]["median"] / summ[y]["tokens_per_second"]["median"], 3)
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    result = {
        "meta": {
            "title": f"{Path(tpath).name} + {Path(dpath).name}, {', '.join(a.prompts)} prompts, {a.max_tokens} tokens, "
                     f"{threads} threads, n_draft {n_draft}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m dflash_gguf.bench"] + (argv if argv is not None else sys.argv[1:])),
            "target": str(tpath), "drafter": str(dpath), "target_mb": _r(Path(tpath).stat().st_size / 1e6),
            "drafter_mb": _r(Path(dpath).stat().st_size / 1e6), "block_size": spec.info.block_size,
            "n_draft": n_draft, "max_tokens": a.max_tokens, "trials": a.trials, "warmup": a.warmup,
            "threads": threads, "prompt_sets": a.prompts, "n_prompts": len(prompts),
            "loadavg_start": load0, "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "machine": machine_info(), "versions": versions(),
            "rss_mb": {"start": _r(rss0, 1), "after_target": _r(rss_t, 1), "after_drafter": _r(rss_d, 1)},
            "definitions": {
                "tokens_per_second": "generated tokens / decode seconds (prompt processing excluded), per trial "
                                     "over all prompts; median/min/max across trials",
                "acceptance_length": "tokens committed per target verify pass = 1 + accepted drafts per step",
                "per_position_acceptance": "share of drafts whose k-th token was accepted (prefix acceptance)",
                "peak_rss_mb": "plain/dflash: peak RSS of this process (Python + both models loaded); "
                               "upstream: largest VmHWM of a llama-speculative-simple run (sampled every 5 ms)",
            },
        },
        "prompts": [{"set": p["set"], "name": p["name"], "n_tokens": len(i)} for p, i in zip(prompts, ids)],
        "modes": summ,
        "speedup": {"dflash_over_plain": ratio("dflash", "plain"), "dflash_over_upstream": ratio("dflash", "upstream"),
                    "upstream_over_plain": ratio("upstream", "plain")},
        "outputs_equal": {"dflash_vs_plain": equal_ours,
                          "dflash_vs_plain_prompts": f"{len(prompts) - len(diffs)}/{len(prompts)}",
                          "differences": diffs, "upstream_vs_ours": up_equal, "upstream_vs_plain": up_equal_plain},
        "sample_output": {k: v for k, v in list(modes["plain"].texts.items())[:1]},
    }
    if a.sweep_block:
        log.info("sweep over n_draft 1..%d", spec.info.block_size - 1)
        result["sweep"] = sweep(tctx, dctx, tm, prompts, ids, a.max_tokens, max(1, min(a.trials, 3)),
                                summ["plain"]["tokens_per_second"]["median"])
    if a.profile:
        log.info("profiling verify / draft cost")
        result["profile"] = profile(tctx, dctx, ids[0])

    a.out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or "results"
    jpath = a.out / f"{tag}.json"
    jpath.write_text(json.dumps(result, indent=2) + "\n")
    png = a.out / f"{tag}.png"
    chart = write_chart(result, png)
    print_summary(result, jpath, png if chart else None)
    hard = {k: v for k, v in diffs.items() if not v["near_tie"]}
    if hard:
        log.error("DFlash output differed from plain output away from a near-tie: this is a bug (%s)", hard)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
