"""One scale case (a synthetic pair, one or more drafters) measured in its own process.

``python -m dflash_gguf.bench.scale.run CASE.json OUT.json`` is what :mod:`dflash_gguf.bench.scale`
starts per (shape, type), so that only one big model is in memory at a time and the peak RSS
belongs to that case. It measures, with 2 threads (or ``threads``):

* costs: one-row target decode ``t1``, k-row verify for k = 1..16 (greedy argmax path), one drafter
  call drafting 15 tokens (block 16), fastest of ``repeats`` calls each (the least disturbed by other
  load); break-even acceptance length ``(t_draft + t_verify(16)) / t1`` with one ``t1`` for all
  drafters (the fastest measured);
* speed: plain decoding, then per drafter and acceptance profile our loop with the replayed proposer,
  interleaved per trial; tokens/s exclude the prompt; the tau-limited ideal
  ``tau * t1 / (t_draft + t_verify(n + 1))`` (x plain) from the same run's costs;
* ours with the drafter's own (random) proposals, the acceptance-1 case upstream's column runs.
"""
from __future__ import annotations

import json
import logging
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("dflash_gguf.bench.scale")

PROMPT = ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
          "    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n")


def _ms(x: float) -> float:
    return round(x * 1000, 3)


def measure_costs(tctx, dctx, prompt_ids: list[int], n_draft: int, repeats: int, max_rows: int = 16) -> dict:
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.decoding import DFlashDecoder

    dec = DFlashDecoder(tctx, dctx)
    first = list(dec.generate(prompt_ids, 1, stop_tokens=[]))
    pos, pending = len(prompt_ids), first[-1]
    dec.features.flush()   # the rows kept on the host: what the decoder's next draft injects first
    rng = np.random.default_rng(0)
    verify = {}
    for rows in range(1, max_rows + 1):
        batch = np.concatenate([[pending], rng.integers(0, tctx.model.n_vocab, rows - 1)]).astype(np.int32)
        am = np.zeros(rows, dtype=np.int32)
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            tctx.decode(batch, pos, out_row0=0, argmax=am)
            ts.append(time.perf_counter() - t0)
            tctx.truncate(pos)
        verify[rows] = min(ts[1:])
    buf = np.zeros(64, dtype=np.int32)
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        B.check(B.lib.llama_dflash_draft(dctx.cptr, 0, pos, pending, n_draft, B.ffi.from_buffer("llama_token[]", buf)),
                "drafting")
        ts.append(time.perf_counter() - t0)
    t_draft = min(ts[1:])
    dec.reset()
    t1 = verify[1]
    return {"t1_ms": _ms(t1), "verify_ms": {k: _ms(v) for k, v in verify.items()}, "draft_ms": _ms(t_draft),
            "draft_ms_median": _ms(statistics.median(ts[1:])), "n_draft": n_draft,
            "break_even_tau": round((t_draft + verify[n_draft + 1]) / t1, 3)}


def _gen(dec, prompt_ids, n, stats=None):
    from dflash_gguf.decoding import GenerationStats

    st = stats or GenerationStats()
    dec.reset()
    toks = list(dec.generate(prompt_ids, n, stop_tokens=[], stats=st))
    return toks, st


def run_case(case: dict) -> dict:
    from dflash_gguf.bench.scale.replay import ReplayProposer, expected_tau, parse_profile
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, DrafterProposer, OverrideProposer, SpecOptions

    n_tok, trials, threads = case["tokens"], case["trials"], case.get("threads")
    t_load = time.perf_counter()
    tm = Model(case["target"], n_gpu_layers=case.get("n_gpu_layers", 0))
    prompt_ids = tm.tokenize(PROMPT.encode(), add_bos=False)
    opts = ContextOptions(n_ctx=len(prompt_ids) + n_tok + 64, n_batch=512, n_ubatch=512, n_threads=threads)
    tctx = Context(tm, opts)
    out = {"target": case["target"], "n_prompt": len(prompt_ids), "tokens": n_tok, "trials": trials,
           "threads": threads, "drafters": {}}
    plain = DFlashDecoder(tctx, None)
    log.info("target loaded; plain reference run (%d tokens)", n_tok)
    ref, _ = _gen(plain, prompt_ids, n_tok)
    reference = prompt_ids + ref
    out["load_s"] = round(time.perf_counter() - t_load, 2)
    plain_tps: list[float] = []
    for label, dpath in case["drafters"].items():
        dm = Model(dpath, n_gpu_layers=case.get("n_gpu_layers", 0))
        dctx = Context(dm, opts, other=tctx)
        probe = DFlashDecoder(tctx, dctx)
        n_draft = probe.n_draft
        log.info("drafter %s: measuring costs", label)
        costs = measure_costs(tctx, dctx, prompt_ids, n_draft, case["repeats"])
        log.info("drafter %s: t1 %.1f ms, verify(16) %.1f ms, draft %.1f ms", label, costs["t1_ms"],
                 costs["verify_ms"][16], costs["draft_ms"])
        runs = {}
        for spec in case["profiles"]:
            name, cum = parse_profile(spec)
            runs[name] = {"cum": cum, "expected_tau": round(expected_tau(cum, n_draft), 3), "tps": [], "tau": None}
        if case.get("own", True):
            runs["own"] = {"tps": [], "tau": None}      # the drafter's own proposals (random weights: ~never right)
        order = list(runs)                               # seeds follow the profiles, gated or not
        # "+gate": a fresh decoder per trial (the gate's warm-up in every run, as in a first call);
        # "+gate warm": one decoder for all trials, as a Llama keeps its gate between calls (the first
        # trial, cold, is kept apart from the median)
        warm = bool(case.get("gate_warm"))
        gated = "+gate warm" if warm else "+gate"
        if case.get("gate"):
            for name in order:
                runs[name + gated] = dict(runs[name], tps=[], tau=None)
            if case["gate"] == "only":
                runs = {name: r for name, r in runs.items() if name.endswith(gated)}
        keep: dict[str, DFlashDecoder] = {}
        for trial in range(trials):
            _, st = _gen(plain, prompt_ids, n_tok)
            plain_tps.append(st.tokens_per_second)
            for name, r in runs.items():
                base = name.removesuffix(gated)
                seed = [trial, order.index(base)]            # independent draws per profile and trial
                prop = None if base == "own" else ReplayProposer(reference, r["cum"], tm.n_vocab, seed=seed)
                proposer = OverrideProposer(prop) if prop is not None else None
                if name in keep:                             # the same gate, fresh caches and draws
                    dec = keep[name]
                    dec.reset()
                    dec.proposer = proposer or DrafterProposer()
                else:
                    dec = DFlashDecoder(tctx, dctx, SpecOptions(adaptive=name.endswith(gated)), proposer)
                    if warm and name.endswith(gated):
                        keep[name] = dec
                toks, st = _gen(dec, prompt_ids, n_tok)
                log.info("drafter %s trial %d %s: %.2f tok/s (plain %.2f), tau %.2f", label, trial, name,
                         st.tokens_per_second, plain_tps[-1], st.tau)
                r["tps"].append(st.tokens_per_second)
                r["tau"] = round(st.tau, 3)
                r["exact"] = r.get("exact", True) and toks == ref   # every trial
                if prop is not None:
                    r["diverged_steps"] = prop.diverged
                r["time_s_last_trial"] = st.as_dict()["time"]
        for name, r in runs.items():
            tps = r["tps"]
            if name in keep and len(tps) > 1:
                r["tps_cold"] = round(tps[0], 3)
                tps = tps[1:]
            r["tps_median"] = round(statistics.median(tps), 3)
            r.pop("cum", None)
        out["drafters"][label] = {"path": dpath, "costs": costs, "runs": runs, "n_draft": n_draft}
        del probe
        dctx.close()
        dm.close()
    # one t1 for every drafter (the fastest measured), so break-even and ideal compare the heads alone
    t1 = min(d["costs"]["t1_ms"] for d in out["drafters"].values())
    for d in out["drafters"].values():
        c, n = d["costs"], d["n_draft"]
        step = c["draft_ms"] + c["verify_ms"][n + 1]
        c["t1_ms_shared"] = t1
        c["break_even_tau"] = round(step / t1, 3)
        for r in d["runs"].values():
            if r.get("tau"):
                r["ideal_x_plain"] = round(r["tau"] * t1 / step, 3)
    out["plain_tps"] = [round(x, 3) for x in plain_tps]
    out["plain_tps_median"] = round(statistics.median(plain_tps), 3)
    for d in out["drafters"].values():
        for r in d["runs"].values():
            r["x_plain"] = round(r["tps_median"] / out["plain_tps_median"], 3)
    tctx.close()
    tm.close()
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dflash_gguf.native.logs import set_log_handler

    set_log_handler()
    case = json.loads(Path(argv[0]).read_text())
    res = run_case(case)
    Path(argv[1]).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
