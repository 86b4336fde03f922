"""Acceptance at temperature > 0: proposals drawn from the drafter's own distribution (DFlash2: its
selector's lattice; DSpark: its Markov chain) vs one-hot proposals (the greedy walk, q = 1 on the
drafted token).

``python -m dflash_gguf.bench.sampling [--target T.gguf] [--drafter D.gguf] [--temperatures 0.7,1.0]``

Without paths it uses the shipped demo target and its DFlash2 drafter (``data/demo-dflash2``;
``--drafter dflash_gguf/data/demo-dspark/drafter.gguf`` for the DSpark one; the modes keep their
names, ``lattice`` being the drafter's own distribution). For
each temperature, each prompt and each seed it generates four ways on the same contexts: plain
decoding, DFlash with fixed drafting and one-hot proposals (``SpecOptions(sample_lattice=False)``),
DFlash with fixed drafting and lattice proposals (these three with the seed), and lattice proposals
with the speed gate choosing the draft length (``lattice+gate``: an unseeded request, as a ``Llama``
without ``seed`` makes it; its gate is kept across the runs). Every DFlash mode is lossless (the acceptance rule takes the q they
proposed with, see ``decoding/acceptance.py``); what changes is how much of each block is kept. It reports the
acceptance length, the share of drafted tokens accepted, acceptance per block position and decode
tokens/s (prefill excluded), with DFlash's ratio to plain measured in the same run. Greedy (T = 0)
rows can be added with ``--temperatures 0,...`` (both modes are then the same greedy walk).
``--api ROUNDS`` also times whole unseeded ``create_completion`` calls the way users make them:
``llama_cpp.Llama`` against ``dflash_gguf.Llama`` with the gate (its default) and with fixed drafting.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from dflash_gguf.decoding.stats import GenerationStats

log = logging.getLogger("dflash_gguf.bench.sampling")
_DATA = Path(__file__).resolve().parent.parent / "data"
MODES = ("plain", "one-hot", "lattice", "lattice+gate")
GATED = "lattice+gate"   # unseeded requests: the speed gate chooses the draft length (kept across calls)


def measure(target: str, drafter: str, prompts: list[str], temperatures: list[float], seeds: int, n_gen: int,
            threads: int | None) -> list[dict]:
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding.sampling import SamplingParams
    from dflash_gguf.decoding import DFlashDecoder, SpecOptions

    rows = []
    with Model(target) as tm, Model(drafter) as dm:
        toks = [tm.tokenize(p.encode()) for p in prompts]
        n_ctx = max(map(len, toks)) + n_gen + 16
        opts = ContextOptions(n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_threads=threads)
        with Context(tm, opts) as tc, Context(dm, opts, other=tc) as dc:
            decs = {"plain": DFlashDecoder(tc, None),
                    "one-hot": DFlashDecoder(tc, dc, SpecOptions(sample_lattice=False)),
                    "lattice": DFlashDecoder(tc, dc, SpecOptions(sample_lattice=True)),
                    GATED: DFlashDecoder(tc, dc, SpecOptions(sample_lattice=True, adaptive=True))}
            if decs["lattice"].lattice is None and decs["lattice"].markov is None:
                raise SystemExit(f"{drafter} is neither a DFlash2 drafter with a selector nor a DSpark drafter: "
                                 "nothing to compare")
            for p in toks[:1]:                       # warm-up (first-call allocations)
                for dec in decs.values():
                    dec.reset()
                    list(dec.generate(p, 8, SamplingParams(temperature=0.7, seed=0)))
            for temp in temperatures:
                st = {m: GenerationStats() for m in MODES}
                secs = dict.fromkeys(MODES, 0.0)
                t0 = time.perf_counter()
                for seed in range(seeds):
                    for p in toks:
                        for m in MODES:              # interleaved: the machine's drift hits all alike
                            dec = decs[m]
                            dec.reset()
                            s = GenerationStats()
                            sp = SamplingParams(temperature=temp, seed=None if m == GATED else 1000 + seed)
                            list(dec.generate(p, n_gen, sp, stats=s, stop_tokens=[]))
                            st[m].merge(s)
                            secs[m] += s.t_total - s.t_prefill
                row = {"temperature": temp, "prompts": len(toks), "seeds": seeds, "tokens_each": n_gen}
                for m in MODES:
                    s = st[m]
                    row[m] = {"tokens": s.n_generated, "decode_s": round(secs[m], 3),
                              "tps": s.n_generated / max(secs[m], 1e-9)}
                    if m != "plain":
                        row[m].update(tau=s.tau, steps=s.steps, drafted=s.drafted, accepted=s.accepted,
                                      accept_rate=s.accepted / max(s.drafted, 1),
                                      per_pos=[a / d if d else 0.0 for a, d in zip(s.accepted_per_pos, s.drafted_per_pos)])
                rows.append(row)
                log.info("T=%.2f (%.0f s): tau one-hot %.2f, lattice %.2f; tok/s plain %.1f, one-hot %.1f, lattice %.1f, "
                         "gated %.1f", temp, time.perf_counter() - t0, row["one-hot"]["tau"], row["lattice"]["tau"],
                         row["plain"]["tps"], row["one-hot"]["tps"], row["lattice"]["tps"], row[GATED]["tps"])
            for dec in decs.values():
                dec.reset()
    return rows


def through_api(target: str, drafter: str, prompts: list[str], temperatures: list[float], rounds: int, n_gen: int,
                threads: int | None) -> list[dict]:
    """Tokens/s of whole ``create_completion`` calls without a seed, as users make them: llama_cpp.Llama,
    dflash_gguf.Llama with its defaults (the gate) and with fixed drafting; each kept across the calls."""
    from dflash_gguf.native.llama import llama_cpp

    from dflash_gguf import Llama

    kw = dict(n_ctx=max(1024, n_gen + 512), n_threads=threads, verbose=False, flash_attn=True)
    llms = {"llama_cpp": llama_cpp.Llama(model_path=target, **kw),
            "gate": Llama(target, draft_model_path=drafter, **kw),
            "fixed": Llama(target, draft_model_path=drafter, draft_adaptive=False, **kw)}
    rows = []
    try:
        for temp in temperatures:
            tokens, secs = dict.fromkeys(llms, 0), dict.fromkeys(llms, 0.0)
            for _ in range(rounds):
                for p in prompts:
                    for name, llm in llms.items():    # interleaved, as in measure()
                        t0 = time.perf_counter()
                        out = llm.create_completion(p, max_tokens=n_gen, temperature=temp)
                        secs[name] += time.perf_counter() - t0
                        tokens[name] += out["usage"]["completion_tokens"]
            row = {"temperature": temp, **{name: tokens[name] / max(secs[name], 1e-9) for name in llms}}
            rows.append(row)
            log.info("API, T=%.2f: llama_cpp %.1f, gate %.1f, fixed %.1f tok/s", temp, row["llama_cpp"], row["gate"],
                     row["fixed"])
    finally:
        for llm in llms.values():
            llm.close()
    return rows


def api_table(rows: list[dict]) -> str:
    out = ["| T | llama_cpp.Llama tok/s | dflash_gguf.Llama (gate) | dflash_gguf.Llama (fixed drafting) |",
           "|---|---|---|---|"]
    for r in rows:
        b = r["llama_cpp"]
        out.append(f"| {r['temperature']:g} | {b:.1f} | {r['gate']:.1f} ({r['gate'] / b:.2f}x) | "
                   f"{r['fixed']:.1f} ({r['fixed'] / b:.2f}x) |")
    return "\n".join(out)


def table(rows: list[dict]) -> str:
    out = ["| T | proposals | acceptance length | drafted tokens accepted | accepted at block positions 1..n "
           "| decode tok/s | x plain |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        plain = r["plain"]["tps"]
        out.append(f"| {r['temperature']:g} | plain | - | - | - | {plain:.1f} | 1.00 |")
        for m in MODES[1:]:
            x = r[m]
            if not x["steps"]:     # the gate decoded plainly throughout
                out.append(f"| {r['temperature']:g} | {m} | - (no block drafted) | - | - | {x['tps']:.1f} | "
                           f"{x['tps'] / plain:.2f} |")
                continue
            per = " ".join(f"{v:.2f}" for v in x["per_pos"])
            out.append(f"| {r['temperature']:g} | {m} | {x['tau']:.2f} | {x['accept_rate']:.1%} | {per} | "
                       f"{x['tps']:.1f} | {x['tps'] / plain:.2f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.bench.prompts import load_prompts
    from dflash_gguf.bench.results import machine_info, versions
    from dflash_gguf.native.logs import set_log_handler

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.sampling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(_DATA / "demo" / "target.gguf"))
    ap.add_argument("--drafter", default=str(_DATA / "demo-dflash2" / "drafter.gguf"), help="a DFlash2 or DSpark drafter GGUF")
    ap.add_argument("--prompts", nargs="+", default=["code"], help="prompt sets (code, math, prose, all) or files")
    ap.add_argument("--temperatures", default="0.7,1.0")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per prompt and temperature (default 3)")
    ap.add_argument("-n", "--tokens", type=int, default=96, help="tokens generated per run (default 96)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--api", type=int, default=0, metavar="ROUNDS",
                    help="also time whole unseeded create_completion calls (prompt included) through llama_cpp.Llama "
                         "and dflash_gguf.Llama, ROUNDS passes over the prompts (default 0: skip)")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON and the table as Markdown here")
    a = ap.parse_args(argv)
    temps = [float(t) for t in a.temperatures.split(",")]
    if any(t < 0 for t in temps) or a.seeds < 1 or a.tokens < 1 or a.api < 0:
        ap.error("temperatures must be >= 0, --seeds and --tokens >= 1, --api >= 0")
    for f in (a.target, a.drafter):
        if not Path(f).is_file():
            ap.error(f"{f} not found")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    set_log_handler()
    prompts = [p["text"] for p in load_prompts(a.prompts)]
    rows = measure(a.target, a.drafter, prompts, temps, a.seeds, a.tokens, a.threads)
    md = table(rows)
    api = through_api(a.target, a.drafter, prompts, temps, a.api, a.tokens, a.threads) if a.api > 0 else []
    if api:
        md += "\n\nWhole calls through the API (unseeded, prompt processing included):\n\n" + api_table(api)
    print(md)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        doc = {"command": "python -m dflash_gguf.bench.sampling " + " ".join(argv if argv is not None else sys.argv[1:]),
               "target": a.target, "drafter": a.drafter, "rows": rows, "api": api, "machine": machine_info(),
               "versions": versions()}
        (a.out / "sampling.json").write_text(json.dumps(doc, indent=2) + "\n")
        (a.out / "sampling.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
