#!/usr/bin/env python
"""Measure a shipped DSpark demo drafter against the demo's DFlash and DFlash2 drafters, and record its
per-step traces.

    .venv/bin/python examples/demo_pair/traces.py dflash_gguf/data/demo-dspark

On the benchmark prompts (``bench/prompts``: code, math, prose), greedy, ``--tokens`` tokens each, every
block verified whole (no speed gate, so the confidence never shortens a block): each drafter's
acceptance length and per-position acceptance, and for the DSpark drafter every step's drafted count,
accepted count and per-row confidence. Written to ``traces.json`` in the drafter's folder (the format is
in its model card), whose ``per_position_acceptance`` key makes it an acceptance profile for
``python -m dflash_gguf.bench.scale --profiles <traces.json>``; then the model card is rewritten with
the measured tables.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA = REPO / "dflash_gguf" / "data"
BINS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0)


def run_drafter(target: Path, drafter: Path, prompts: list[dict], tokens: int, threads: int, trace: bool) -> dict:
    from dflash_gguf.decoding import GenerationStats, SpecOptions
    from dflash_gguf.decoding.proposer import DrafterProposer
    from dflash_gguf.native.engine import ContextOptions
    from dflash_gguf.pair import compare_with_plain, open_pair

    class Tracing(DrafterProposer):
        """The drafter's own proposals, with each step's confidences kept (one sequence)."""

        def __init__(self):
            self.steps: list[tuple[int, list[float]]] = []

        def propose(self, drafter, seqs, pos, pending, n, out, context, conf=None):
            got = super().propose(drafter, seqs, pos, pending, n, out, context, conf)
            self.steps.append((got, [] if conf is None else [round(float(c), 4) for c in conf[0, :got]]))
            return got

    opts = ContextOptions(n_ctx=1024, n_batch=256, n_ubatch=256, n_threads=threads)
    total, rows = GenerationStats(), []
    with open_pair(target, drafter, opts) as pair:
        dec = pair.decoder(SpecOptions())
        info = dec.info
        for p in prompts:
            tr = Tracing()
            dec.proposer = tr
            ids = pair.target.tokenize(p["text"].encode())
            c = compare_with_plain(pair, ids, tokens, decoder=dec)
            total.merge(c.stats)
            row = {"set": p["set"], "name": p["name"], "equal": c.equal, "tau": round(c.stats.tau, 3),
                   "n": len(c.spec)}
            if trace:
                acc = c.stats.accepted_per_step
                assert len(acc) == len(tr.steps), (len(acc), len(tr.steps))
                row["steps"] = [[n, a, cf] for (n, cf), a in zip(tr.steps, acc)]
            rows.append(row)
    cum = [a / total.steps for a in total.accepted_per_pos]          # P(accepted >= i), i = 1..
    return {"kind": info.kind, "n_draft": dec.n_draft, "has_confidence": bool(info.has_confidence),
            "tau": round(total.tau, 3), "steps": total.steps, "drafted": total.drafted, "accepted": total.accepted,
            "all_equal": all(r["equal"] for r in rows), "per_position_acceptance": [round(x, 4) for x in cum],
            "prompts": rows}


def calibration(rows: list[dict]) -> dict:
    """Per row position k: over the steps that reached row k (rows before it all accepted), the mean
    confidence and the share the target accepted; and the same by confidence bin over all reached rows."""
    per: dict[int, list[tuple[float, int]]] = {}
    for r in rows:
        for n, a, conf in r["steps"]:
            for k in range(min(n, a + 1, len(conf))):
                per.setdefault(k, []).append((conf[k], int(k < a)))
    pos = []
    for k in sorted(per):
        c, hit = np.array(per[k]).T
        pos.append({"position": k + 1, "reached": len(c), "mean_confidence": round(float(c.mean()), 4),
                    "acceptance_rate": round(float(hit.mean()), 4)})
    allc = np.array([x for k in per for x in per[k]])
    bins = []
    for lo, hi in zip(BINS, BINS[1:]):
        m = (allc[:, 0] >= lo) & ((allc[:, 0] < hi) if hi < 1.0 else (allc[:, 0] <= hi))
        if m.any():
            bins.append({"confidence": [lo, hi], "rows": int(m.sum()), "mean_confidence": round(float(allc[m, 0].mean()), 4),
                         "acceptance_rate": round(float(allc[m, 1].mean()), 4)})
    brier = float(((allc[:, 0] - allc[:, 1]) ** 2).mean())
    base = float(((allc[:, 1].mean() - allc[:, 1]) ** 2).mean())
    return {"by_position": pos, "by_confidence": bins, "brier": round(brier, 4), "brier_constant": round(base, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dest", type=Path, help="the DSpark drafter's folder (drafter.gguf, training.json)")
    ap.add_argument("--target", type=Path, default=DATA / "demo" / "target.gguf")
    ap.add_argument("--prompts", nargs="+", default=["all"], help="bench prompt sets or files (default all)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-card", action="store_true", help="do not rewrite the model card")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from dflash_gguf.bench.prompts import load_prompts
    from dflash_gguf.native.logs import set_log_handler

    set_log_handler()
    prompts = load_prompts(a.prompts)
    others = {"dflash": DATA / "demo" / "drafter.gguf", "dflash2": DATA / "demo-dflash2" / "drafter.gguf"}
    compare = {k: run_drafter(a.target, p, prompts, a.tokens, a.threads, False) for k, p in others.items() if p.is_file()}
    ours = run_drafter(a.target, a.dest / "drafter.gguf", prompts, a.tokens, a.threads, True)
    for k, r in {**compare, "dspark": ours}.items():
        print(f"{k:8s} acceptance length {r['tau']:.2f} ({r['n_draft']} drafted per block; output == plain on "
              f"{sum(p['equal'] for p in r['prompts'])}/{len(r['prompts'])} prompts); P(accepted >= i): "
              + " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]))
    cal = calibration(ours["prompts"]) if ours["has_confidence"] else None
    if cal:
        for row in cal["by_position"]:
            print(f"  position {row['position']}: mean confidence {row['mean_confidence']:.3f}, accepted "
                  f"{row['acceptance_rate']:.3f} of {row['reached']} reached")
        print(f"  Brier score {cal['brier']:.4f} (a constant forecast: {cal['brier_constant']:.4f})")
    out = {
        "what": "greedy per-step traces of the DSpark demo drafter on the benchmark prompts (every block verified whole)",
        "target": str(Path(a.target).resolve().relative_to(REPO)) if Path(a.target).resolve().is_relative_to(REPO) else str(a.target),
        "drafter": "drafter.gguf", "prompt_sets": a.prompts, "max_tokens": a.tokens, "greedy": True,
        "n_draft": ours["n_draft"], "tau": ours["tau"], "per_position_acceptance": ours["per_position_acceptance"],
        "calibration": cal,
        "compare": {k: {**{f: r[f] for f in ("kind", "n_draft", "tau", "steps", "all_equal", "per_position_acceptance")},
                        "prompt_tau": [p["tau"] for p in r["prompts"]]}
                    for k, r in {**compare, "dspark": ours}.items()},
        "prompts": ours["prompts"],
    }
    (a.dest / "traces.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {a.dest / 'traces.json'}")
    if not a.no_card and (a.dest / "training.json").is_file():
        sys.path.insert(0, str(HERE.parent))
        from demo_pair.publish import dspark_card

        info = json.loads((a.dest / "training.json").read_text())
        (a.dest / "MODEL_CARD.md").write_text(dspark_card(info, a.dest))
        print(f"rewrote {a.dest / 'MODEL_CARD.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
