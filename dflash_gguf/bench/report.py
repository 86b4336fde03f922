"""Benchmark reporting: the PNG chart and the terminal summary of a :mod:`dflash_gguf.bench` run."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("dflash_gguf.bench")


def write_chart(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        log.warning("matplotlib is not installed: no chart written (pip install matplotlib)")
        return False
    cols = [c for c in ("plain", "dflash", "upstream") if result["modes"].get(c, {}).get("tokens_per_second", {}).get("median")]
    panels = 2 + bool(result.get("sweep")) + bool(result.get("profile"))
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4))
    ax = axes[0]
    med = [result["modes"][c]["tokens_per_second"]["median"] for c in cols]
    lo = [m - result["modes"][c]["tokens_per_second"]["min"] for m, c in zip(med, cols)]
    hi = [result["modes"][c]["tokens_per_second"]["max"] - m for m, c in zip(med, cols)]
    ax.bar(cols, med, yerr=[lo, hi], capsize=4, color=["#888", "#2a7", "#37c"][:len(cols)])
    for i, m in enumerate(med):
        ax.text(i, m / 2, f"{m:.0f}", ha="center", va="center", color="white", fontweight="bold")
    ax.set_ylabel("tokens / s (median, min-max)")
    ax.set_title("decode speed")
    ax = axes[1]
    for c, style in (("dflash", "o-"), ("upstream", "s--")):
        pa = result["modes"].get(c, {}).get("per_position_acceptance")
        if pa:
            ax.plot(range(1, len(pa) + 1), pa, style, label=f"{c} (tau {result['modes'][c]['acceptance_length']:.2f})")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title("per-position acceptance")
    ax.legend()
    k = 2
    if result.get("sweep"):
        ax = axes[k]
        k += 1
        sw = result["sweep"]
        ax.plot([r["n_draft"] for r in sw], [r["tokens_per_second"]["median"] for r in sw], "o-", label="dflash")
        ax.axhline(result["modes"]["plain"]["tokens_per_second"]["median"], color="#888", ls="--", label="plain")
        ax.set_xlabel("n_draft")
        ax.set_ylabel("tokens / s")
        ax.set_title("block size sweep")
        ax.legend()
    if result.get("profile"):
        ax = axes[k]
        pr = result["profile"]
        vm = {int(k): v for k, v in pr["verify_ms_argmax_min"].items()}
        dm = {int(k): v for k, v in pr["draft_ms_min"].items()}
        ax.plot(sorted(vm), [vm[x] for x in sorted(vm)], "o-", label="target verify (min)")
        ax.plot(sorted(dm), [dm[x] for x in sorted(dm)], "s-", label="drafter block (min)")
        ax.set_xlabel("rows / drafted tokens")
        ax.set_ylabel("ms")
        ax.set_title("CPU cost profile")
        ax.legend()
    fig.suptitle(result["meta"]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def print_summary(r: dict, jpath: Path, png: Path | None) -> None:
    m = r["modes"]
    print()
    print(f"{'mode':10s} {'tok/s med':>10s} {'min':>8s} {'max':>8s} {'accept len':>11s} {'peak RSS MB':>12s}")
    for k in ("plain", "dflash", "upstream"):
        d = m.get(k, {})
        if d.get("skipped"):
            print(f"{k:10s} skipped: {d['reason']}")
            continue
        t = d["tokens_per_second"]
        al = d.get("acceptance_length")
        print(f"{k:10s} {t['median']:10.1f} {t['min']:8.1f} {t['max']:8.1f} "
              f"{(f'{al:.2f}' if al else '-'):>11s} {d.get('peak_rss_mb') or 0:12.0f}")
    s = r["speedup"]
    print(f"speed-up: dflash/plain {s['dflash_over_plain']}, dflash/upstream {s['dflash_over_upstream']}, "
          f"upstream/plain {s['upstream_over_plain']}")
    pa = m["dflash"].get("per_position_acceptance")
    if pa:
        print("dflash per-position acceptance: " + " ".join(f"{x:.2f}" for x in pa if x is not None))
    if m["dflash"].get("time_share"):
        print("dflash time: " + ", ".join(f"{k} {v * 100:.0f}%" for k, v in m["dflash"]["time_share"].items()))
    e = r["outputs_equal"]
    print(f"outputs equal: dflash == plain on {e['dflash_vs_plain_prompts']} prompts, upstream == our dflash: "
          f"{e['upstream_vs_ours']}, upstream == plain: {e['upstream_vs_plain']}")
    for k, v in e["differences"].items():
        print(f"  {k}: dflash and plain part at generated token {v['first_difference']}; the target's top-2 logit gap "
              f"there is {v['plain_top2_logit_gap']}" + (" (a near-tie: rounding of batched vs one-row decoding "
                                                        "flips it; upstream's DFlash does the same)" if v["near_tie"] else ""))
    if r.get("sweep"):
        print("sweep: " + ", ".join(f"n={x['n_draft']}: {x['tokens_per_second']['median']:.0f} tok/s "
                                    f"(tau {x['acceptance_length']:.2f})" for x in r["sweep"]))
    if r.get("profile"):
        p = r["profile"]
        print("verify ms by rows (min): " + " ".join(f"{k}:{v:.2f}" for k, v in p["verify_ms_argmax_min"].items()))
        print("draft ms by n (min):     " + " ".join(f"{k}:{v:.2f}" for k, v in p["draft_ms_min"].items()))
        print("break-even acceptance length by n_draft: " + " ".join(f"{k}:{v:.2f}" for k, v in
                                                                    p["break_even_acceptance_length"].items()))
    load = r["meta"].get("loadavg_start")
    if load and load[0] > (r["meta"]["machine"]["cores"] or 1) * 0.5:
        print(f"note: the machine was busy (load average {load[0]:.1f} on {r['meta']['machine']['cores']} cores): "
              "timings are noisy")
    print(f"wrote {jpath}" + (f" and {png}" if png else ""))
