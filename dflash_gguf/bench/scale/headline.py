"""What DFlash buys at a realistic size, measured here in seconds: the demo's second line.

``python -m dflash_gguf.bench.scale.headline [--shape 0.6b] [--type q4_0]`` (and ``make demo``, after
the shipped pair) measures plain decoding against DFlash as a ``Llama`` runs it - the speed gate on,
kept between calls, starting from this machine's calibrated step costs - on a ``bench.scale`` pair of
a real shape (random weights, the real 151,936-token vocabulary, the reduced draft head the converter
makes), with the shipped demo pair's measured per-position acceptance replayed (the drafter runs every
step and its cost is paid; only its proposals are replaced, see :mod:`dflash_gguf.bench.scale.replay`).

Random weights cannot show acceptance and a 6 M-parameter model cannot show cost: the shipped pair gives
the first, this pair the second. Output equals plain decoding token for token in every run (checked).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

log = logging.getLogger("dflash_gguf.bench.scale")

SHAPE, WTYPE, DRAFT_VOCAB = "0.6b", "q4_0", 32768
SHAPE_NAMES = {"0.6b": "Qwen3-0.6B", "1.7b": "Qwen3-1.7B", "4b": "Qwen3-4B", "8b": "Qwen3-8B"}


def prepare(shape: str = SHAPE, wtype: str = WTYPE, draft_vocab: int | None = DRAFT_VOCAB) -> tuple[Path, Path]:
    """(target.gguf, drafter.gguf) of the cached scale pair, written on first use (logged, with progress)."""
    from dflash_gguf.bench.scale import synth

    pair = synth.make_pair(shape, wtype)
    dpair = synth.reduced_pair(pair, draft_vocab) if draft_vocab else pair
    return pair / "target.gguf", dpair / "drafter.gguf"


def measure(target: Path, drafter: Path, *, tokens: int = 64, trials: int = 3, threads: int | None = None,
            profile: str = "demo") -> dict:
    """Plain vs gated DFlash (one decoder for every call, as a ``Llama`` keeps it), trials interleaved."""
    from dflash_gguf.bench.scale.replay import ReplayProposer, expected_tau, parse_profile
    from dflash_gguf.bench.scale.run import PROMPT, _gen
    from dflash_gguf.kernels.cpu import cpu_model
    from dflash_gguf.decoding import DFlashDecoder, OverrideProposer, SpecOptions
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    name, cum = parse_profile(profile)
    t0 = time.perf_counter()
    tm = Model(target)
    ids = tm.tokenize(PROMPT.encode(), add_bos=False)
    opts = ContextOptions(n_ctx=len(ids) + tokens + 64, n_batch=512, n_ubatch=512, n_threads=threads)
    tctx = Context(tm, opts)
    pctx = Context(tm, opts)        # plain decoding in a context of its own: no taps, as a plain user has it
    dm = Model(drafter)
    dctx = Context(dm, opts, other=tctx)
    plain = DFlashDecoder(pctx, None)

    def run(dec):
        return _gen(dec, ids, tokens)

    ref, _ = run(plain)
    reference = ids + ref
    spec = DFlashDecoder(tctx, dctx, SpecOptions(adaptive=True))   # calibrates once per pair and machine
    log.info("pair loaded and calibrated in %.1f s", time.perf_counter() - t0)
    p_tps, d_tps, taus, exact = [], [], [], True
    for trial in range(trials + 1):             # trial 0 warms the gate (a Llama's first call); not counted
        spec.proposer = OverrideProposer(ReplayProposer(reference, cum, tm.n_vocab, seed=[trial]))
        got, st = run(spec)
        exact = exact and got == ref
        _, sp = run(plain)
        if trial:
            d_tps.append(st.tokens_per_second)
            p_tps.append(sp.tokens_per_second)
            taus.append(st.tau)
        log.info("trial %d: plain %.1f tok/s, DFlash %.1f tok/s (tau %.2f)", trial, sp.tokens_per_second,
                 st.tokens_per_second, st.tau)
    n_draft = spec.n_draft
    del spec, plain
    dctx.close()
    pctx.close()
    tctx.close()
    dm.close()
    tm.close()
    ratios = [d / p for d, p in zip(d_tps, p_tps) if p]
    return {"profile": name, "expected_tau_full_block": round(expected_tau(cum, n_draft), 2),
            "plain_tps": round(statistics.median(p_tps), 2), "dflash_tps": round(statistics.median(d_tps), 2),
            "x_plain": round(statistics.median(ratios), 3) if ratios else None,
            "tau": round(statistics.median(taus), 2), "exact": exact, "tokens": tokens, "trials": trials,
            "threads": threads, "cpu": cpu_model() or "?"}


def line(r: dict, shape: str = SHAPE, wtype: str = WTYPE) -> str:
    """The demo's one labelled line."""
    what = f"{SHAPE_NAMES.get(shape, shape)}-shaped {wtype.upper()} pair, random weights"
    return (f"At a realistic size ({what}, the demo pair's measured acceptance replayed; this machine, "
            f"{r['threads'] or 'all'} threads): plain {r['plain_tps']:.1f} tok/s, DFlash {r['dflash_tps']:.1f} "
            f"tok/s = {r['x_plain']:.2f}x (acceptance length {r['tau']:.2f}; same tokens as plain: "
            f"{'yes' if r['exact'] else 'NO'})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.scale.headline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default=SHAPE, choices=sorted(SHAPE_NAMES))
    ap.add_argument("--type", dest="wtype", default=WTYPE, choices=["q4_0", "q8_0"])
    ap.add_argument("--draft-vocab", default=str(DRAFT_VOCAB), help="reduced draft head rows; 'off': the full head")
    ap.add_argument("--profile", default="demo", help="acceptance profile (bench.scale's names or a list)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from dflash_gguf.native.logs import set_log_handler

    set_log_handler()
    dv = None if a.draft_vocab.lower() == "off" else int(a.draft_vocab)
    target, drafter = prepare(a.shape, a.wtype, dv)
    r = measure(target, drafter, tokens=a.tokens, trials=a.trials, threads=a.threads, profile=a.profile)
    print(json.dumps(r, indent=1) if a.json else line(r, a.shape, a.wtype))
    return 0 if r["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
