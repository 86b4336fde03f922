"""``python -m dflash_gguf.bench.replay_server``: our server with a replayed acceptance profile in its slots.

A ``bench.scale`` pair's drafter has random weights and is never right, so a server on it shows what
serving costs, not what drafting buys. This is ``python -m dflash_gguf.server`` (the same flags, ``-np``
required) whose slots' engine replaces each drafted block with a replayed one
(:class:`dflash_gguf.bench.scale.replay.ReplayBook`): before serving, every prompt of ``--replay-prompts``
(a JSON list of completion prompts) is decoded plainly on the model's own context, and a block drafted
after one of those prompts is that continuation, right as often as the profile says. The drafter still
runs every step (its cost is paid, its cache fed), so the speed is the engine's at that acceptance.
A request whose prompt is not in the list drafts wrong blocks (counted in the log at exit).

``--replay traces:SPEC`` replays recorded steps instead of a profile (``bench.confidence``'s traces:
``demo-dspark``, the shipped DSpark demo drafter's, or a JSON file): each block is right for the step's
recorded accepted count and comes with the step's per-token confidences, so the slots cut their blocks
by the calibrated confidence as they would with that drafter's confidence head.

Benchmarks only: ``python -m dflash_gguf.bench.serve --replay demo`` starts it.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger("dflash_gguf.bench.replay_server")


def references(llm, prompts: list[str], n_tokens: int) -> list[list[int]]:
    """Each prompt's tokens as the server's completions tokenize it, then its plain greedy continuation
    (``n_tokens``) on ``llm``'s own context."""
    from dflash_gguf.native.threads import run_in_own_thread

    def run() -> list[list[int]]:
        out = []
        for p in prompts:
            ids = llm.tokenize(p.encode("utf-8"), special=True)
            llm.decoder.reset()
            out.append(list(ids) + list(llm.decoder.generate(ids, n_tokens, use_draft=False)))
        return out

    # on a thread that ends with the work: a thread that once decoded slows the slots' (dflash_gguf.native.threads)
    return run_in_own_thread(run, name="dflash-replay-refs")


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.bench.scale.replay import ReplayBook, expected_tau, parse_profile
    from dflash_gguf.decoding.proposer import OverrideProposer
    from dflash_gguf.options import setup_logging
    from dflash_gguf.server.cli import build, parser, serve

    ap: argparse.ArgumentParser = parser("python -m dflash_gguf.bench.replay_server")
    g = ap.add_argument_group("replay")
    g.add_argument("--replay", required=True, metavar="PROFILE",
                   help="acceptance profile: demo, demo-dspark, strong, none, p1,p2,... or a JSON list file "
                        "(bench.scale's); traces:SPEC (demo-dspark or a JSON file of steps): recorded steps with "
                        "their confidences (bench.confidence's)")
    g.add_argument("--replay-prompts", type=Path, required=True, metavar="FILE",
                   help="JSON list of the completion prompts the benchmark sends")
    g.add_argument("--replay-tokens", type=int, required=True, metavar="N",
                   help="tokens of each prompt's continuation to replay (the requests' max_tokens)")
    g.add_argument("--replay-seed", type=int, default=0)
    args = ap.parse_args(argv)
    setup_logging(args.verbose, logging.INFO)
    if args.parallel is None:
        ap.error("--replay needs --parallel N (the slots' engine is where the blocks are replayed)")
    traces = args.replay.startswith("traces:")
    if traces:
        from dflash_gguf.bench.confidence import TraceBook, load_traces
        name, steps = load_traces(args.replay.removeprefix("traces:"))
        if args.draft_n_max is None:     # the recorded drafter's block: positions past it were never scored
            args.draft_n_max = max(len(c) for c, _a in steps)
    else:
        name, cum = parse_profile(args.replay)
    prompts = json.loads(args.replay_prompts.read_text())
    app, llm = build(args)
    slots = app.state.server.slots
    if slots.drafter is None:
        ap.error("--replay needs a drafter (-md)")
    n = slots.decoder.n_draft
    refs = references(llm, prompts, args.replay_tokens + n + 1)
    if traces:
        book = TraceBook(refs, steps, slots.model.n_vocab, start=997 * args.replay_seed)
        slots.decoder.proposer = book
        log.info("replaying %d recorded steps of %s (mean accepted %.2f) with their confidences over %d prompts",
                 len(steps), name, sum(a for _c, a in steps) / len(steps), len(refs))
    else:
        book = ReplayBook(refs, cum, slots.model.n_vocab, seed=args.replay_seed)
        slots.decoder.proposer = OverrideProposer(book)
        log.info("replaying profile %s (acceptance length %.2f at %d drafted) over %d prompts", name,
                 expected_tau(cum, n), n, len(refs))
    try:
        serve(app, args)
    finally:
        log.info("replayed %d blocks, %d of them after a context no prompt's continuation starts",
                 book.blocks if traces else book.steps, book.diverged)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
