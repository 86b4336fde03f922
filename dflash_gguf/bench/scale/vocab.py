"""Acceptance lost to a reduced draft vocabulary, on a trained pair.

    python -m dflash_gguf.bench.scale.vocab                                  # the demo pair, N = 512 1024 2048
    python -m dflash_gguf.bench.scale.vocab --pair DIR --sizes 8192 32768 --corpus FILE...

For every head size N and token choice (``lowest-ids`` - the N smallest ids, the naive choice;
``tokenizer-rank`` - the default, the tokenizer's merge order; ``builtin-corpus`` - counts over
Python's standard library (documentation + modules) then the merge order; ``corpus`` - frequencies over
``--corpus`` files) it writes the
reduced drafter to a temporary file, runs greedy generation over the bench prompts (our loop,
fixed n_draft) and reports the acceptance length next to the full head's, plus whether every output
equalled plain decoding. Each prompt runs from an empty cache; acceptance is the pooled
(accepted + steps) / steps over all prompts.
"""
from __future__ import annotations

from dflash_gguf import paths
import argparse
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

log = logging.getLogger("dflash_gguf.bench.scale")

DEMO_DIR = paths.DEMO_DIR
def _run(target: Path, drafter: Path, prompts: list[str], n_tok: int, threads: int) -> tuple[float, int, list]:
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats

    with Model(target) as tm, Model(drafter) as dm:
        opts = ContextOptions(n_ctx=1024, n_threads=threads)
        with Context(tm, opts) as tctx, Context(dm, opts, other=tctx) as dctx:
            plain_dec, dec = DFlashDecoder(tctx, None), None
            acc = steps = exact = 0
            outs = []
            for text in prompts:
                ids = tm.tokenize(text.encode(), add_bos=True)
                plain_dec.reset()
                plain = list(plain_dec.generate(ids, n_tok))
                dec = DFlashDecoder(tctx, dctx)
                st = GenerationStats()
                got = list(dec.generate(ids, n_tok, stats=st))
                acc += st.accepted
                steps += st.steps
                exact += got == plain
                outs.append(got)
    return (acc + steps) / steps if steps else 0.0, exact, outs


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.bench.prompts import load_prompts
    from dflash_gguf.convert import draft_vocab as dv
    from dflash_gguf.convert.manifest import load_manifest

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.scale.vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default=str(DEMO_DIR), help="converted pair directory (default: the demo pair)")
    ap.add_argument("--sizes", nargs="+", type=int, default=[512, 1024, 2048])
    ap.add_argument("--corpus", nargs="*", default=None, help="also measure a choice by these calibration files")
    ap.add_argument("--prompts", nargs="+", default=["all"], help="bench prompt sets or files (default: all)")
    ap.add_argument("--methods", nargs="+", default=None, help="only these choices (lowest-ids, tokenizer-rank, "
                    "builtin-corpus, corpus)")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dflash_gguf.native.logs import set_log_handler

    set_log_handler()
    m = load_manifest(a.pair)
    corpus = a.corpus or []
    prompts = [p["text"] for p in load_prompts(a.prompts)]
    v = dv.read_vocab(m.target.path)
    tau_full, ex, _ = _run(m.target.path, m.drafter.path, prompts, a.tokens, a.threads)
    rows = [("full", v.n_vocab, tau_full, ex, None)]
    print(f"full head ({v.n_vocab} tokens): acceptance length {tau_full:.3f}, {ex}/{len(prompts)} outputs == plain",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="dflash-dv-") as tmp:
        for n in a.sizes:
            b = dv.choose(v, n, builtin=True)
            choices = {"lowest-ids": np.arange(n, dtype=np.int64), "tokenizer-rank (default)": dv.choose(v, n).ids,
                       "builtin-corpus": b.ids}
            cov = {"builtin-corpus": b.corpus_coverage}
            if corpus:
                c = dv.choose(v, n, corpus)
                choices["corpus"] = c.ids
                cov["corpus"] = c.corpus_coverage
            for method, ids in choices.items():
                if a.methods and method.split()[0] not in a.methods:
                    continue
                out = Path(tmp) / f"d-{n}-{method}.gguf"
                dv.write_reduced_drafter(m.drafter.path, m.target.path, ids, out)
                tau, ex, _ = _run(m.target.path, out, prompts, a.tokens, a.threads)
                rows.append((method, n, tau, ex, cov.get(method)))
                print(f"N={n:6d} {method:25s}: acceptance length {tau:.3f} ({tau / tau_full:.1%} of full), "
                      f"{ex}/{len(prompts)} outputs == plain", flush=True)
                out.unlink()
    print()
    print("| head | tokens | acceptance length | vs full | outputs == plain |")
    print("|---|---|---|---|---|")
    for method, n, tau, ex, c in rows:
        extra = f" (corpus coverage {c:.1%})" if c is not None else ""
        print(f"| {method}{extra} | {n} | {tau:.2f} | {tau / tau_full:.0%} | {ex}/{len(prompts)} |")
    if corpus:
        print(f"\ncorpus: {', '.join(Path(c).name for c in corpus)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
