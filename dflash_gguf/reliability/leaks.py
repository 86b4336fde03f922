"""No leaks: RSS, open file descriptors and gc-tracked Python objects over many generations.

    python -m dflash_gguf.reliability.leaks                # CI size: 200 generations, reopen every 50
    python -m dflash_gguf.reliability.leaks --full         # 1,000 generations, reopen every 100

Two phases, each measured after every cycle (``gc.collect()`` first):

1. ``Llama`` with DFlash (demo pair by default): ``--generations`` completions (seeded prompts,
   max_tokens 4..64, greedy and sampled, streamed and not, with and without stop strings,
   a ``save_state``/``load_state`` now and then), closing and reopening the ``Llama`` every
   ``--reopen`` generations; a cycle = one open ... close.
2. ``Model``/``Context``/``DFlashDecoder``: ``--cycles`` open - generate 16 tokens - close.

RSS here is the resident *anonymous* memory (``RssAnon``: heap and buffers; the model files'
mapped pages are page cache, not a leak), measured after ``gc.collect()`` and glibc's
``malloc_trim(0)``. The first cycle of each phase is warm-up (allocator arenas, llama.cpp's
one-time tables, lazy imports). After it, the figures must stay flat: RSS within ``--rss-tol-mib`` (default 8 MiB)
of the post-warm-up value, the same number of open file descriptors, and at most
``--gc-tol`` (default 100) more gc-tracked objects. The exit status is 1 when one is exceeded.
"""
from __future__ import annotations

from dflash_gguf import paths
import argparse
import ctypes
import gc
import json
import logging
import os
import random
import time
from collections import Counter
from pathlib import Path

log = logging.getLogger("dflash_gguf.reliability.leaks")

DEMO_DIR = paths.DEMO_DIR


def rss_bytes(field: str = "RssAnon") -> int:
    """Resident anonymous memory (heap, buffers): the model files' mapped pages are not a leak and
    come and go with the page cache, so they are left out (VmRSS counts them)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _trim() -> None:
    """Give freed heap memory back to the OS (glibc), so that RSS shows what is still allocated."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def snapshot(types: bool = False):
    """(rss, fds, gc objects[, Counter of types]); a tuple of ints is not tracked by gc itself."""
    gc.collect()
    gc.collect()
    _trim()
    objs = gc.get_objects()
    out = (rss_bytes(), n_fds(), len(objs))
    if types:
        out += (tuple(sorted(Counter(type(o).__name__ for o in objs).items())),)
    del objs
    return out


def _prompts(seed: int):
    from dflash_gguf.reliability.soak import gen_text
    rng = random.Random(seed)
    while True:
        yield rng, gen_text(rng, rng.randint(2, 30))


def llama_phase(target: str, drafter: str, generations: int, reopen: int, seed: int = 0, max_tokens: int = 64) -> list:
    from dflash_gguf.api import Llama

    kw = dict(n_ctx=512, n_batch=64, n_threads=1, n_threads_batch=1, verbose=False, seed=0)
    marks = []
    prompts = _prompts(seed)
    done = 0
    while done < generations:
        llm = Llama(target, draft_model_path=drafter, **kw)
        state = None
        for _ in range(min(reopen, generations - done)):
            rng, text = next(prompts)
            call = dict(max_tokens=rng.randint(min(4, max_tokens), max_tokens),
                        temperature=rng.choice([0.0, 0.0, 0.7]), seed=rng.randrange(1000))
            if rng.random() < 0.3:
                call["stop"] = [rng.choice(["\n", ")", ":", "def"])]
            if rng.random() < 0.4:
                for _chunk in llm(text, stream=True, **call):
                    pass
            else:
                llm(text, **call)
            r = rng.random()
            if r < 0.05:
                state = llm.save_state()
            elif r < 0.1 and state is not None:
                llm.load_state(state)
            done += 1
        state = None
        llm.close()
        del llm
        s = snapshot(types=not marks or done >= generations) + (done,)
        marks.append(s)
        log.info("llama: %d generations, RSS %.1f MiB, %d fds, %d gc objects", done, s[0] / 2 ** 20, s[1], s[2])
    return marks


def engine_phase(target: str, drafter: str, cycles: int, per_mark: int) -> list[dict]:
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder

    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1)
    marks = []
    for i in range(cycles):
        with Model(target) as t, Model(drafter) as d:
            with Context(t, opts) as tc, Context(d, opts, other=tc) as dc:
                dec = DFlashDecoder(tc, dc)
                list(dec.generate(t.tokenize(b"def main():"), 16))
        del dec, t, d, tc, dc
        if (i + 1) % per_mark == 0 or i + 1 == cycles:
            s = snapshot(types=not marks or i + 1 == cycles) + (i + 1,)
            marks.append(s)
            log.info("engine: %d cycles, RSS %.1f MiB, %d fds, %d gc objects", i + 1, s[0] / 2 ** 20, s[1], s[2])
    return marks


def judge(marks: list[tuple], rss_tol: int, gc_tol: int) -> dict:
    """Growth after the first (warm-up) mark; ``ok`` when within the tolerances.

    A mark is (rss, fds, gc objects, [types,] count); types only on the first and the last.
    """
    base, last = marks[0], marks[-1]
    rss = [m[0] for m in marks]
    peak_rss = max(rss[1:]) if len(marks) > 1 else last[0]
    xs = [m[-1] for m in marks]
    slope = 0.0
    if len(marks) > 2:   # least-squares trend of RSS after warm-up, MiB per 100 units (generations, cycles)
        mx, my = sum(xs) / len(xs), sum(rss) / len(rss)
        den = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, rss)) / den * 100 / 2 ** 20 if den else 0.0
    grew = Counter(dict(last[3])) - Counter(dict(base[3])) if len(last) > 4 and len(base) > 4 else Counter()
    growth = {"rss_mib": round((last[0] - base[0]) / 2 ** 20, 2), "rss_peak_mib": round((peak_rss - base[0]) / 2 ** 20, 2),
              "rss_trend_mib_per_100": round(slope, 3),
              "fds": last[1] - base[1], "fds_max": max(m[1] for m in marks) - base[1],
              "gc_objects": last[2] - base[2], "gc_types": dict(grew.most_common(8))}
    growth["ok"] = (peak_rss - base[0] <= rss_tol and growth["fds_max"] == 0 and growth["gc_objects"] <= gc_tol)
    return growth


def run(target: str, drafter: str, generations: int, reopen: int, cycles: int, *, rss_tol_mib: float = 8.0,
        gc_tol: int = 100, max_tokens: int = 64) -> dict:
    t0 = time.monotonic()
    rss_tol = int(rss_tol_mib * 2 ** 20)
    lm = llama_phase(target, drafter, generations, reopen, max_tokens=max_tokens)
    em = engine_phase(target, drafter, cycles, max(1, cycles // 5))
    strip = lambda ms: [{"rss": m[0], "fds": m[1], "gc_objects": m[2], "count": m[-1]} for m in ms]   # noqa: E731
    rep = {"target": target, "drafter": drafter, "generations": generations, "reopen": reopen, "cycles": cycles,
           "max_tokens": max_tokens,
           "tolerance": {"rss_mib": rss_tol_mib, "fds": 0, "gc_objects": gc_tol},
           "llama": {"marks": strip(lm), "growth": judge(lm, rss_tol, gc_tol)},
           "engine": {"marks": strip(em), "growth": judge(em, rss_tol, gc_tol)},
           "seconds": round(time.monotonic() - t0, 1)}
    rep["ok"] = rep["llama"]["growth"]["ok"] and rep["engine"]["growth"]["ok"]
    return rep


def summary(rep: dict) -> str:
    out = [f"{rep['generations']} Llama generations (reopen every {rep['reopen']}), {rep['cycles']} engine "
           f"open/close cycles, {rep['seconds']} s; tolerance after warm-up: RSS {rep['tolerance']['rss_mib']} MiB, "
           f"fds 0, gc objects {rep['tolerance']['gc_objects']}"]
    for phase in ("llama", "engine"):
        g = rep[phase]["growth"]
        m = rep[phase]["marks"]
        out.append(f"  {phase}: RSS {m[0]['rss'] / 2 ** 20:.1f} -> {m[-1]['rss'] / 2 ** 20:.1f} MiB "
                   f"(growth {g['rss_mib']:+.2f}, peak {g['rss_peak_mib']:+.2f} MiB, trend {g['rss_trend_mib_per_100']:+.3f} "
                   f"MiB per 100), fds {m[0]['fds']} -> "
                   f"{m[-1]['fds']}, gc objects {g['gc_objects']:+d} {g['gc_types'] or ''} -> "
                   f"{'OK' if g['ok'] else 'GROWTH'}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.reliability.leaks", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(DEMO_DIR / "target.gguf"))
    ap.add_argument("--draft", default=str(DEMO_DIR / "drafter.gguf"))
    ap.add_argument("--generations", type=int, default=200)
    ap.add_argument("--reopen", type=int, default=50)
    ap.add_argument("--cycles", type=int, default=50, help="Model/Context open/close cycles")
    ap.add_argument("--full", action="store_true", help="1,000 generations, reopen every 100, 300 cycles")
    ap.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens of a generation (default 64)")
    ap.add_argument("--rss-tol-mib", type=float, default=8.0)
    ap.add_argument("--gc-tol", type=int, default=100)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.full:
        args.generations, args.reopen, args.cycles = 1000, 100, 300
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dflash_gguf.native.logs import set_log_handler
    set_log_handler()
    rep = run(args.model, args.draft, args.generations, args.reopen, args.cycles, rss_tol_mib=args.rss_tol_mib,
              gc_tol=args.gc_tol, max_tokens=args.max_tokens)
    print(summary(rep))
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
