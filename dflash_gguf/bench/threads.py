"""``python -m dflash_gguf.bench.threads``: what a second host thread that once ran a graph costs decoding.

ggml's CPU backend is built with OpenMP; libgomp keeps a pool of workers for every host thread that has
run a parallel region, for as long as that thread lives, and while it manages more threads than the
process has CPUs its workers sleep at barriers instead of spinning (``dflash_gguf.native.threads``). This bench
decodes one token at a time (``llama_cpp.Llama.eval``, plain decoding of the target) on one worker
thread, in rounds of three phases:

* ``alone``    - no other thread has run a graph;
* ``other``    - another thread decoded a few tokens once and is still alive (blocked, doing nothing);
* ``after``    - that thread has exited.

Reported per phase: tokens/s (median over rounds) and the process's thread count while it ran, and the
ratios ``other / alone`` and ``after / alone``. Run it as ``OMP_WAIT_POLICY=ACTIVE python -m
dflash_gguf.bench.threads`` to see the same with workers that always spin.

Models: a ``bench.scale`` pair's target by shape and type (``--pair 0.6b:q4_0``, the default) or any
GGUF (``--model PATH``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path

from dflash_gguf.native.threads import SerialWorker

log = logging.getLogger("dflash_gguf.bench.threads")

PHASES = ("alone", "other", "after")


def n_threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def decode_rate(llm, n_tokens: int) -> float:
    """Tokens/s of ``n_tokens`` one-token decodes after a one-token prompt (the same token fed back: the
    cost of a decode does not depend on which token it is)."""
    tok = llm.token_bos() if llm.token_bos() >= 0 else 0
    llm.reset()
    llm.eval([tok])
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        llm.eval([tok])
    return n_tokens / (time.perf_counter() - t0)


def measure(model: Path, *, n_tokens: int, rounds: int, threads: int) -> dict:
    from dflash_gguf.native.llama import llama_cpp

    llm = llama_cpp.Llama(str(model), n_ctx=max(64, n_tokens + 16), n_threads=threads, n_batch=64, verbose=False)
    worker = SerialWorker(idle_s=3600, name="bench-decoder")   # one thread for every timed decode
    rates: dict[str, list[float]] = {p: [] for p in PHASES}
    counts: dict[str, list[int]] = {p: [] for p in PHASES}

    def phase(name: str) -> None:
        rates[name].append(worker.submit(decode_rate, llm, n_tokens).result())
        counts[name].append(n_threads_now())
        log.info("round %d %-5s %6.1f tok/s, %d threads", len(rates[name]), name, rates[name][-1], counts[name][-1])

    def other_thread(decoded: threading.Event, release: threading.Event) -> None:
        decode_rate(llm, 4)        # it runs graphs once, then waits, alive
        decoded.set()
        release.wait()

    try:
        worker.submit(decode_rate, llm, 4).result()     # warm-up: the worker's own pool exists from here
        for _ in range(rounds):
            phase("alone")
            decoded, release = threading.Event(), threading.Event()
            other = threading.Thread(target=other_thread, args=(decoded, release), name="bench-other", daemon=True)
            other.start()
            decoded.wait()
            phase("other")
            release.set()
            other.join()
            phase("after")
    finally:
        llm.close()
    med = {p: statistics.median(rates[p]) for p in PHASES}
    return {
        "model": str(model), "tokens": n_tokens, "rounds": rounds, "threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpus": os.cpu_count(),
        "tokens_per_second": {p: {"median": med[p], "runs": rates[p]} for p in PHASES},
        "process_threads": {p: counts[p] for p in PHASES},
        "other_over_alone": med["other"] / med["alone"], "after_over_alone": med["after"] / med["alone"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.threads", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="0.6b:q4_0", help="a bench.scale pair SHAPE:TYPE whose target decodes")
    ap.add_argument("--model", type=Path, default=None, help="any GGUF instead of --pair's target")
    ap.add_argument("--tokens", type=int, default=64, help="one-token decodes per phase and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = a.model
    if model is None:
        from dflash_gguf.bench.serve import pair_files
        model = pair_files(a.pair)[0]
    from dflash_gguf.bench.serve import cpu_name
    r = measure(model, n_tokens=a.tokens, rounds=a.rounds, threads=a.threads)
    r["cpu"] = cpu_name()
    tps = r["tokens_per_second"]
    print(f"{r['cpu']}, {a.threads} threads, OMP_WAIT_POLICY={r['omp_wait_policy'] or 'unset'}: "
          + ", ".join(f"{p} {tps[p]['median']:.1f} tok/s ({max(r['process_threads'][p])} threads)" for p in PHASES)
          + f"; other / alone {r['other_over_alone']:.2f}x, after / alone {r['after_over_alone']:.2f}x")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
