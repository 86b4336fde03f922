"""An offline DFlash demo: stream a code completion, then compare plain and DFlash decoding.

    python -m dflash_gguf.demo                      # the shipped demo pair (dflash_gguf/data/demo)
    python -m dflash_gguf.demo --prompt "def fib(n):\\n" --max-tokens 64
    python -m dflash_gguf.demo --model target.gguf --draft drafter.gguf

The shipped pair is tiny (a ~6 M-parameter Qwen3 trained on the Python standard library's
source, and its ~2 M-parameter DFlash drafter): the point is to see the mechanics - the drafter
proposes a block of tokens, the target checks the whole block in one pass, and the output is
exactly what plain greedy decoding gives. Nothing here needs torch or a network.
"""
from __future__ import annotations

from dflash_gguf import paths
import argparse
import codecs
import logging
import os
import sys
import time
from pathlib import Path

DEMO_DIR = paths.DEMO_DIR
DEFAULT_PROMPT = "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"


def demo_pair() -> tuple[Path, Path]:
    """Paths of the shipped demo pair (target, drafter)."""
    return DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"


# the other drafters shipped for the demo target, each shown on a line of its own (name: file)
OTHER_DRAFTERS = {"DSpark": DEMO_DIR.parent / "demo-dspark" / "drafter.gguf"}


def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.demo", description=__doc__.split("\n\n")[0],
                                 epilog="Without --model/--draft the shipped demo pair is used.")
    ap.add_argument("--model", "-m", type=Path, help="target GGUF (default: the shipped demo target)")
    ap.add_argument("--draft", "-md", type=Path, help="DFlash drafter GGUF for that target (default: the shipped one)")
    ap.add_argument("--prompt", "-p", default=None, help="prompt text (default: the start of a Python function)")
    ap.add_argument("--max-tokens", "-n", type=int, default=96, help="tokens to generate (default 96)")
    ap.add_argument("--n-draft", type=int, default=None, help="tokens drafted per block (default: block size - 1)")
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                    help="speed gate (default on, as in the API): draft per step as many tokens as pays "
                         "(at most --n-draft); --no-adaptive drafts --n-draft tokens every step")
    ap.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores, at most 8)")
    ap.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers of both models to offload to "
                    "a GPU (default 0; 99: all; needs a GPU build, see README 'GPU offload')")
    ap.add_argument("--trials", type=int, default=10,
                    help="timed runs of each mode, alternating; shown: all tokens over all time (default 10)")
    ap.add_argument("--no-stream", action="store_true", help="do not print the completion as it is generated")
    ap.add_argument("--no-scale", action="store_true", help="skip the line at a realistic size (a Qwen3-0.6B-shaped "
                    "pair with this pair's acceptance replayed; written once, about 0.5 GB, then cached)")
    ap.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    return ap.parse_args(argv)


def _bar(frac: float, width: int = 24) -> str:
    n = max(0, min(width, round(frac * width)))
    return "#" * n + "." * (width - n)


def main(argv=None) -> int:
    a = _parse(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if not a.verbose:
        logging.getLogger("dflash_gguf.llama_cpp").setLevel(logging.ERROR)

    target_path, draft_path = demo_pair()
    target_path = a.model or target_path
    draft_path = a.draft or (None if a.model else draft_path)
    if draft_path is None:
        print("error: --model was given without --draft: pass the DFlash drafter made for that target", file=sys.stderr)
        return 2
    for p, what in ((target_path, "target"), (draft_path, "drafter")):
        if not Path(p).is_file():
            hint = ("the demo pair is made by `python examples/train_demo_pair.py` (about 30 min on 2 cores)"
                    if p in demo_pair() else "check the path")
            print(f"error: {what} model not found: {p}\n       {hint}", file=sys.stderr)
            return 2

    try:
        from dflash_gguf.native.engine import ContextOptions
        from dflash_gguf.native.logs import set_log_handler
        from dflash_gguf.pair import open_pair
        from dflash_gguf.decoding import GenerationStats, SpecOptions
    except Exception as e:  # noqa: BLE001 - the most likely first-run failure; say what to do
        print(f"error: the patched llama.cpp is not usable here ({e}).\n"
              "       build it first: python -m dflash_gguf.build", file=sys.stderr)
        return 2
    set_log_handler()

    threads = a.threads or min(8, os.cpu_count() or 1)
    prompt = DEFAULT_PROMPT if a.prompt is None else a.prompt.replace("\\n", "\n")

    print("DFlash speculative decoding demo")
    print("================================")
    print(f"target : {target_path}  ({Path(target_path).stat().st_size / 1e6:.1f} MB)")
    print(f"drafter: {draft_path}  ({Path(draft_path).stat().st_size / 1e6:.1f} MB)")
    t0 = time.perf_counter()
    pair = open_pair(target_path, draft_path, ContextOptions(n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=threads),
                     n_gpu_layers=a.n_gpu_layers)
    tm = pair.target
    spec = pair.decoder(SpecOptions(n_draft=a.n_draft, adaptive=a.adaptive))
    info = spec.info
    print(f"loaded in {time.perf_counter() - t0:.2f} s: {tm.arch} target ({tm.n_layer} layers, vocab {tm.n_vocab}); "
          f"{info.kind} drafter, block size {info.block_size}, drafting {spec.n_draft} tokens per step, "
          f"{threads} threads")
    print()
    print("How it works: each step the drafter guesses the next "
          f"{spec.n_draft} tokens at once from the target's hidden states;\n"
          "the target checks all of them in ONE batched pass and keeps the longest correct prefix,\n"
          "plus one token of its own. The text is exactly what plain greedy decoding produces.")
    print()

    ids = tm.tokenize(prompt.encode("utf-8"))
    n = a.max_tokens

    # 1. stream the DFlash completion (also warms up both models)
    print(f"--- completion ({n} tokens, DFlash) " + "-" * 30)
    sys.stdout.write(prompt)
    sys.stdout.flush()
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    st_stream = GenerationStats()
    spec_tokens = []
    for tok in spec.generate(ids, n, stats=st_stream):
        spec_tokens.append(tok)
        if not a.no_stream:
            sys.stdout.write(dec.decode(tm.token_bytes(tok)))
            sys.stdout.flush()
    if a.no_stream:
        sys.stdout.write(tm.detokenize(spec_tokens).decode("utf-8", "replace"))
    else:
        sys.stdout.write(dec.decode(b"", final=True))
    print("\n" + "-" * 66)

    # 2. time both modes on the same prompt, as a Llama runs them: one DFlash decoder for every call (its
    #    speed gate, warmed by the streamed run above, is kept), the caches emptied before each run
    plain = pair.plain()
    list(plain.generate(ids, min(8, n)))      # warm-up of the one-row path
    plain_runs, spec_runs = [], []
    plain_tokens = None
    for _ in range(max(1, a.trials)):
        plain.reset()
        st = GenerationStats()
        plain_tokens = list(plain.generate(ids, n, stats=st))
        plain_runs.append(st)
        spec.reset()
        st = GenerationStats()
        got = list(spec.generate(ids, n, stats=st))
        spec_runs.append(st)
        if got != plain_tokens:
            print("ERROR: DFlash output differs from plain decoding - this is a bug, please report it", file=sys.stderr)
            return 1

    # what a Llama delivers over these calls: all their tokens over all their time (a probe of the speed
    # gate lands in some calls and not others: a median would show the calls without one)
    plain_all, spec_all = GenerationStats(), GenerationStats()
    for p_st, s_st in zip(plain_runs, spec_runs):
        plain_all.merge(p_st)
        spec_all.merge(s_st)
    tps_plain, tps_spec = plain_all.tokens_per_second, spec_all.tokens_per_second
    speedup = tps_spec / tps_plain if tps_plain else float("nan")
    print()
    print(f"Results ({len(spec_runs)} runs of each, alternating, {len(plain_tokens)} tokens each, prompt {len(ids)} "
          "tokens; all tokens over all time):")
    print(f"  plain decoding   : {tps_plain:8.1f} tokens/s   (one target pass per token)")
    print(f"  DFlash decoding  : {tps_spec:8.1f} tokens/s   ({spec_all.passes} target passes for "
          f"{spec_all.n_generated} tokens, {spec_all.steps} of them verifying drafted blocks)")
    print(f"  speed-up         : {speedup:8.2f} x")
    print(f"  acceptance length: {spec_all.tau:8.2f} tokens per drafting pass "
          f"({spec_all.accepted} of {spec_all.drafted} drafted tokens accepted)")
    print("  same output as plain decoding: yes (checked token by token)")
    if a.model is None and a.draft is None:
        for name, path in OTHER_DRAFTERS.items():
            if path.is_file():
                same, line = _other_drafter(name, path, target_path, ids, n, plain_tokens, a, threads)
                print(line, file=sys.stdout if same else sys.stderr)
                if not same:
                    return 1
    rates = st_stream.acceptance_rate_per_pos
    if rates:
        print("  how often the drafter's k-th guess was accepted (the streamed completion above):")
        for k, r in enumerate(rates, 1):
            print(f"    position {k}: {_bar(r)} {r * 100:5.1f}%")
    t = {k: v for k, v in spec_all.phase_times().items() if k != "prefill"}
    tot = sum(t.values()) or 1.0
    print("  where DFlash spends its time: " + ", ".join(f"{k} {v / tot * 100:.0f}%" for k, v in t.items()))
    if speedup < 1.0:
        print("  note: a 6 M-parameter target is not bound by reading its weights, so checking a block costs"
              " several one-token passes here")
        if spec_all.steps * 4 < spec_all.passes:
            print("        and the speed gate decoded plainly; what is left is staying ready to draft: every plain step"
                  " keeps its hidden states\n        for the drafter and asks the gate (microseconds, a few percent of"
                  " a step this small), and a rare probe of the drafter")
        else:
            print("        and drafting loses: the speed gate's estimates of the two were within this machine's"
                  " noise, and it drafted")
    if not a.no_scale and a.model is None:
        print()
        print(_realistic(threads))
    print()
    print("Try: python -m dflash_gguf.demo --prompt 'class Queue:\\n    def __init__(self):\\n'")
    print("     python -m dflash_gguf.bench   (side by side with plain and upstream llama.cpp)")
    return 0


def _other_drafter(name: str, path: Path, target_path: Path, ids, n: int, plain_tokens: list[int],
                   a, threads: int) -> tuple[bool, str]:
    """One line for another shipped drafter of the demo target: its tokens/s and acceptance length over
    half as many runs as the main comparison (the demo's time stays about the same), checked against
    plain decoding like the others."""
    from dflash_gguf.native.engine import ContextOptions
    from dflash_gguf.pair import open_pair
    from dflash_gguf.decoding import GenerationStats, SpecOptions

    with open_pair(target_path, path, ContextOptions(n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=threads),
                   n_gpu_layers=a.n_gpu_layers) as pair:
        dec = pair.decoder(SpecOptions(adaptive=a.adaptive))
        list(dec.generate(ids, n))             # warms its speed gate and confidence calibration, as the stream did
        tot = GenerationStats()
        for _ in range(max(1, a.trials // 2)):
            dec.reset()
            st = GenerationStats()
            if list(dec.generate(ids, n, stats=st)) != plain_tokens:
                return False, f"ERROR: the {name} drafter's output differs from plain decoding - this is a bug, please report it"
            tot.merge(st)
        # no speed-up figure: these runs do not alternate with plain ones, so on a busy machine a ratio
        # to the plain runs above would measure the load as much as the drafter
        return True, (f"  {name + ' drafter':17s}: {tot.tokens_per_second:8.1f} tokens/s   (acceptance length "
                      f"{tot.tau:.2f}, {dec.info.kind}, up to {dec.n_draft} drafted per step, same output: yes)")


def _realistic(threads: int) -> str:
    """The labelled line at a realistic size (dflash_gguf.bench.scale.headline), or why there is none."""
    from dflash_gguf.bench.scale import headline

    print("Measuring at a realistic size: a Qwen3-0.6B-shaped Q4_0 pair (random weights, made once and cached;\n"
          "about a minute the first time) with the demo pair's per-position acceptance (19 prompts) replayed ...", flush=True)
    try:
        target, drafter = headline.prepare()
        r = headline.measure(target, drafter, tokens=64, trials=3, threads=threads)
    except (OSError, MemoryError) as e:
        return f"(no line at a realistic size: {e})"
    if not r["exact"]:
        return "ERROR: DFlash output differs from plain decoding at the realistic size - this is a bug, please report it"
    return headline.line(r)


if __name__ == "__main__":
    sys.exit(main())
