"""Drafter window sweep: acceptance and speed of a bounded drafter window at long prompts.

``python -m dflash_gguf.bench.window [--pair DIR] [--windows 0,256,...] [--prompt-tokens 1024,1920]``

Each long prompt is earlier prompts of the bench sets (code, math, prose) as filler, ending with one
whole prompt, so the continuation is in the pair's domain. For every prompt length and window it
decodes greedily with fixed drafting, checks the tokens against plain decoding of the same target
(lossless whatever the window) and reports the acceptance length, decode tokens/s, prefill time
and the drafter cache's size. Window 0 is the unbounded drafter. Where the tokens differ it prints
plain's own top-2 logit gap at that position (README: what "lossless" means here); the command
fails if a gap is not a near-tie.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys

log = logging.getLogger("dflash_gguf.bench.window")
NEAR_TIE = 0.01   # plain's top-2 logit gap below which batched and one-row kernels may pick differently


def long_prompts(model, n_tokens: int, n_prompts: int) -> list[list[int]]:
    """``n_prompts`` prompts of exactly ``n_tokens`` tokens: filler, then one whole bench prompt."""
    from dflash_gguf.bench.prompts import load_prompts

    texts = [p["text"] for p in load_prompts(["all"])]
    pieces = [model.tokenize(t.encode(), add_bos=False) for t in texts]
    out = []
    for i in range(n_prompts):
        last = pieces[i % len(pieces)]
        filler: list[int] = []
        j = i + 1
        while len(filler) < n_tokens:
            filler.extend(pieces[j % len(pieces)])
            j += 1
        body = filler[-(n_tokens - len(last) - 1):] if n_tokens - len(last) - 1 > 0 else []
        out.append(model.tokenize(b"", add_bos=True)[:1] + body + last)
    return out


def sweep(target: str, drafter: str, windows: list[int], lengths: list[int], n_gen: int, n_prompts: int,
          threads: int | None) -> list[dict]:
    from dflash_gguf.bench.ours import top2_gap
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, SpecOptions
    from dflash_gguf.decoding.decoder import common_prefix_len

    rows = []
    with Model(target) as tm, Model(drafter) as dm:
        for length in lengths:
            prompts = long_prompts(tm, length, n_prompts)
            n_ctx = length + n_gen + 16
            base = ContextOptions(n_ctx=n_ctx, n_threads=threads)
            with Context(tm, base) as tctx:
                plain, plain_tps = [], []
                for p in prompts:
                    st = GenerationStats()
                    plain.append(list(DFlashDecoder(tctx, None).generate(p, n_gen, stats=st)))
                    plain_tps.append(st.n_generated / max(st.t_total - st.t_prefill, 1e-9))
                for w in windows:
                    opts = ContextOptions(n_ctx=n_ctx, n_threads=threads, draft_window=w)
                    with Context(dm, opts, other=tctx) as dctx:
                        dec = DFlashDecoder(tctx, dctx, SpecOptions())
                        taus, tps, prefill, same, cells, gaps = [], [], [], 0, 0, []
                        for p, ref in zip(prompts, plain):
                            dec.reset()
                            st = GenerationStats()
                            got = list(dec.generate(p, n_gen, stats=st))
                            same += got == ref
                            if got != ref:   # plain's own top-2 logit gap where they part (a near-tie?)
                                k = common_prefix_len(got, ref)
                                gaps.append(top2_gap(tctx, p + ref[:k]))
                            taus.append(st.tau)
                            tps.append(st.n_generated / max(st.t_total - st.t_prefill, 1e-9))
                            prefill.append(st.t_prefill)
                            cells = max(cells, dctx.pos_max() + 1 - dctx.pos_min())
                        rows.append({"prompt_tokens": length, "window": w, "drafter_n_ctx": dctx.n_ctx,
                                     "cells_after": cells, "tau": statistics.mean(taus),
                                     "tps": statistics.median(tps), "prefill_s": statistics.median(prefill),
                                     "plain_tps": statistics.median(plain_tps),
                                     "lossless": f"{same}/{len(prompts)}",
                                     "gaps": [g for g in gaps if g is not None]})
                        log.info("L=%d window=%s tau=%.2f tok/s=%.1f lossless %d/%d", length, w or "all",
                                 rows[-1]["tau"], rows[-1]["tps"], same, len(prompts))
    return rows


def table(rows: list[dict]) -> str:
    ref = {r["prompt_tokens"]: r for r in rows if r["window"] == 0}
    lines = ["| prompt tokens | drafter window | drafter n_ctx | cache cells after | acceptance length | "
             "decode tok/s | vs unbounded | vs plain | prefill s | identical to plain (plain's top-2 gap where not) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = ref.get(r["prompt_tokens"])
        rel = f"{r['tps'] / base['tps']:.2f}x" if base and base["tps"] else "-"
        lines.append(f"| {r['prompt_tokens']} | {r['window'] or 'all'} | {r['drafter_n_ctx']} | {r['cells_after']} | "
                     f"{r['tau']:.2f} | {r['tps']:.1f} | {rel} | {r['tps'] / r['plain_tps']:.2f}x | {r['prefill_s']:.3f} | "
                     f"{r['lossless']}"
                     + (f" ({', '.join(f'{g:.1e}' for g in r['gaps'])})" if r["gaps"] else "") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.native.logs import set_log_handler
    from dflash_gguf.pair import pair_files

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.window", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", help="converted pair directory (default: the shipped demo pair)")
    ap.add_argument("--windows", default="0,256,512,1024,2048", help="comma list; 0 = unbounded")
    ap.add_argument("--prompt-tokens", default="1024,1920", help="comma list of prompt lengths")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per prompt")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per length")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("dflash_gguf.llama_cpp").setLevel(logging.ERROR)
    set_log_handler()
    if a.pair:
        target, drafter = pair_files(a.pair)
    else:
        from dflash_gguf.demo import demo_pair
        target, drafter = demo_pair()
    windows = [int(x) for x in a.windows.split(",")]
    if any(w < 0 for w in windows):
        ap.error("--windows: each window must be >= 0")
    rows = sweep(str(target), str(drafter), windows, [int(x) for x in a.prompt_tokens.split(",")], a.tokens,
                 a.prompts, a.threads)
    print(table(rows))
    # a divergence that is not a near-tie of the target's own logits would be a bug
    return 0 if all(g < NEAR_TIE for r in rows for g in r["gaps"]) else 1


if __name__ == "__main__":
    sys.exit(main())

