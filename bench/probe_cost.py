"""What the speed gate's probes cost on a pair where it decodes plainly (the shipped demo pair by default).

    python bench/probe_cost.py [--target T.gguf --drafter D.gguf] [--calls 40] [--tokens 96] [-t 2]

One process, one pair, one prompt. Two parts:

1. Four decoders on the same contexts, one call each in turn per round (all tokens over all time):
   ``plain`` (no drafter), ``gated`` (the default: a kept speed gate), ``gate_off`` (gated, its gate
   forced to plain: no probes) and ``no_keep`` (that, and no rows kept for the drafter). Printed: each
   one's time per call and plain's over it.
2. A kept gate's calls, every step timed: calls with a probe against calls without, the mean excess
   over a plain step of the plain steps after a probe (summed over 10 / 20 / 40 / 60), and where the
   probes fell (step, the gap then, what the gate charged each probe).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dflash_gguf.decoding import SpecOptions
from dflash_gguf.demo import DEFAULT_PROMPT, demo_pair
from dflash_gguf.native.engine import ContextOptions
from dflash_gguf.pair import open_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()
    t, d = demo_pair()
    pair = open_pair(a.target or t, a.drafter or d,
                     ContextOptions(n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=a.threads))
    ids = pair.target.tokenize(DEFAULT_PROMPT.encode())
    n = a.tokens

    decs = {"plain": pair.plain(), "gated": pair.decoder(SpecOptions(adaptive=True))}
    for name in ("gate_off", "no_keep"):
        dec = decs[name] = pair.decoder(SpecOptions(adaptive=True))
        dec.gate.choose = lambda: 0
        dec.gate.record = lambda *args, **kw: None
        if name == "no_keep":
            for s in dec.seqs:
                s.features.keep = lambda *args, **kw: None
    for dec in decs.values():
        dec.reset()
        list(dec.generate(ids, n))
    times = {k: [] for k in decs}
    for _ in range(a.calls):
        for k, dec in decs.items():
            dec.reset()
            t0 = time.perf_counter()
            list(dec.generate(ids, n))
            times[k].append(time.perf_counter() - t0)
    base = sum(times["plain"])
    print(f"1. {a.calls} rounds of {n}-token calls, {a.threads} threads")
    for k, v in times.items():
        print(f"   {k:9s} {sum(v) / len(v) * 1e3:7.2f} ms a call (median {statistics.median(v) * 1e3:7.2f})  "
              f"plain / this {base / sum(v):.3f}")

    dec = pair.decoder(SpecOptions(adaptive=True))
    gate, log, probes = dec.gate, [], []
    advance, choose = dec._advance, gate.choose

    def timed(seqs):
        t0 = time.perf_counter()
        out = advance(seqs)
        log.append((out[0][0].n, time.perf_counter() - t0))
        return out

    def noted():
        k = choose()
        if k:
            probes.append((gate.steps, k, gate.probe_every, gate._plan))
        return k
    dec._advance, gate.choose = timed, noted
    list(dec.generate(ids, n))
    first = len(log)
    calls = []
    for _ in range(a.calls):
        dec.reset()
        at = len(log)
        list(dec.generate(ids, n))
        calls.append((any(k for k, _ in log[at:]), sum(s for _, s in log[at:])))
    plain = statistics.median(s for k, s in log[first:] if k == 0)
    tails = []
    for i in range(first, len(log)):
        if log[i][0]:
            after = [s for k, s in log[i + 1:i + 100] if k == 0][:60]
            if len(after) == 60:
                tails.append(np.array(after) - plain)
    w = [s for p, s in calls if p]
    wo = [s for p, s in calls if not p]
    print(f"2. a kept gate, {a.calls} calls after one: plain step median {plain * 1e6:.0f} us")
    if w and wo:
        print(f"   calls with a probe {len(w)}: {statistics.mean(w) * 1e3:.2f} ms; without {len(wo)}: "
              f"{statistics.mean(wo) * 1e3:.2f} ms")
    if tails:
        m = np.mean(tails, axis=0)
        print(f"   plain steps after a probe ({len(tails)}), excess (us): {(m[:10] * 1e6).round().astype(int).tolist()}; "
              "summed over 10/20/40/60: " + " / ".join(f"{m[:k].sum() * 1e3:.2f}" for k in (10, 20, 40, 60)) + " ms")
    print(f"   probes (step, tokens, gap, plan): {probes}")
    print(f"   what the gate charges a probe now: {gate._probe_seen * 1e3:.2f} ms; its gap {gate._probe_gap()} steps")
    pair.close()


if __name__ == "__main__":
    main()
