"""Probes of the whole block while decoding plainly (gate ``_explore_deep``): a kept gate with them and
without them, beside plain decoding, on the shipped demo pair as shipped (F16) and quantized to Q8_0,
or on a ``bench.scale`` pair of a real shape with replayed acceptance profiles.

    python bench/deep_probes.py [--types f16,q8_0] [--rounds 10] [--tokens 96] [-t 2]
    python bench/deep_probes.py --scale 0.6b --profile demo --profile none --profile 0.6,0.2,0.05 --rounds 4 --tokens 64

One process per weight type (or profile), one pair, the demo prompt. Three decoders on the same
contexts, one call each in turn per round after one untimed call each: ``plain`` (no drafter),
``gated`` (the default gate) and ``short`` (the same gate with its acceptance probes always short, as
before whole-block probes); with ``--scale``, both gated decoders replay the profile over the prompt's
plain continuation (``bench.scale.replay``). Printed per decoder: tokens/s over all calls, the ratio to
plain, its drafting steps and acceptance length. Q8_0 files are written to a temporary directory and
removed at the end.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dflash_gguf.convert.quantize import quantize_file
from dflash_gguf.decoding import GenerationStats, SpecOptions
from dflash_gguf.demo import DEFAULT_PROMPT, demo_pair
from dflash_gguf.native.engine import ContextOptions
from dflash_gguf.decoding.gate import DraftLength
from dflash_gguf.pair import open_pair


class ShortProbes(DraftLength):
    """The gate with every acceptance probe while decoding plainly a short one."""

    def _explore_deep(self) -> bool:
        return False


def run(target: Path, drafter: Path, rounds: int, tokens: int, threads: int,
        profile: list[float] | None = None) -> dict[str, GenerationStats]:
    pair = open_pair(target, drafter, ContextOptions(n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=threads))
    try:
        ids = pair.target.tokenize(DEFAULT_PROMPT.encode())
        plain = pair.plain()
        proposer = lambda: None  # noqa: E731
        if profile is not None:
            from dflash_gguf.bench.scale.replay import ReplayProposer
            from dflash_gguf.decoding import OverrideProposer

            ref = ids + list(plain.generate(ids, tokens + 32))
            proposer = lambda: OverrideProposer(ReplayProposer(ref, profile, pair.target.n_vocab, seed=0))  # noqa: E731
        decs = {"plain": plain, "gated": pair.decoder(SpecOptions(adaptive=True), proposer()),
                "short": pair.decoder(SpecOptions(adaptive=True), proposer())}
        decs["short"].gate.__class__ = ShortProbes
        for dec in decs.values():
            dec.reset()
            list(dec.generate(ids, tokens))
        stats = {k: GenerationStats() for k in decs}
        for _ in range(rounds):
            for k, dec in decs.items():
                dec.reset()
                list(dec.generate(ids, tokens, stats=stats[k]))
        return stats
    finally:
        pair.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="f16,q8_0")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--scale", metavar="SHAPE", help="a bench.scale Q4_0 pair of this shape (0.6b, 1.7b, ...) instead")
    ap.add_argument("--profile", action="append", default=[],
                    help="with --scale: an acceptance profile to replay (repeatable; default demo)")
    a = ap.parse_args()
    if a.scale:
        from dflash_gguf.bench.scale import synth
        from dflash_gguf.bench.scale.replay import parse_profile

        d = synth.make_pair(a.scale, "q4_0")
        for spec in a.profile or ["demo"]:
            name, cum = parse_profile(spec)
            report(f"{a.scale} Q4_0 pair, profile {name}", run(d / "target.gguf", d / "drafter.gguf", a.rounds, a.tokens,
                                                               a.threads, cum), a)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in a.types.split(","):
            files = demo_pair()
            if qtype != "f16":
                files = tuple(Path(tmp) / f"{qtype}-{p.name}" for p in demo_pair())
                for src, dst in zip(demo_pair(), files):
                    quantize_file(src, dst, qtype, a.threads)
            report(f"demo pair, {qtype}", run(*files, a.rounds, a.tokens, a.threads), a)


def report(what: str, stats: dict[str, GenerationStats], a) -> None:
    base = stats["plain"].tokens_per_second
    print(f"{what}: {a.rounds} rounds of {a.tokens}-token calls, {a.threads} threads")
    for k, st in stats.items():
        print(f"  {k:6s} {st.tokens_per_second:8.1f} tok/s  {st.tokens_per_second / base:.3f}x plain  "
              f"drafting steps {st.steps:4d}  acceptance length {st.tau:.2f}")


if __name__ == "__main__":
    main()
