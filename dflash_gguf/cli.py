"""``dflash-gguf`` / ``python -m dflash_gguf``: generate, chat, serve, convert, bench, demo.

    dflash-gguf generate --pair qwen3-8b-dflash "def quicksort(xs):"
    dflash-gguf chat --model target.gguf --draft drafter.gguf --no-think
    dflash-gguf serve --pair qwen3-8b-dflash --port 8000
    dflash-gguf convert Qwen3-8B Qwen3-8B-DFlash-b16 -o qwen3-8b-dflash

``generate`` and ``chat`` are defined here; the others hand their arguments to the module that
implements them (``dflash_gguf.server``, ``.convert``, ``.bench``, ``.demo``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from dflash_gguf.options import PROG, add_flag, add_model_args, load_llama, setup_logging
from dflash_gguf.requests.defaults import COMPLETION, GREEDY

EPILOG = """\
model selection (generate, chat, serve):
  --pair DIR                     a directory made by `dflash-gguf convert` (pair.json + target + drafter)
  -m TARGET.gguf -md DRAFTER.gguf
                                 a target and a DFlash/DFlash2 drafter converted against it
  -m TARGET.gguf                 no drafter: plain decoding (same output, no speed-up)

Flags follow llama.cpp's names (-m/--model, -md/--model-draft, -c/--ctx-size, -t/--threads,
-ngl/--n-gpu-layers, --draft-max, -n/--n-predict) in every command; the older names (--draft,
--n-ctx, --draft-n-max, --max-tokens) still work.

Output is always exactly what plain decoding of the target gives (lossless); the drafter only
changes the speed. `dflash-gguf COMMAND --help` describes each command.
"""

DELEGATED = {
    "serve": ("dflash_gguf.server", "OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
              "pip install 'dflash-gguf[server]'"),
    "convert": ("dflash_gguf.convert", "convert a Hugging Face target + DFlash drafter into a GGUF pair directory",
                "pip install 'dflash-gguf[convert]'"),
    "bench": ("dflash_gguf.bench", "benchmark DFlash against plain decoding (speed-up, acceptance)",
              "pip install 'dflash-gguf[bench]'"),
    "demo": ("dflash_gguf.demo", "offline demo: stream a completion, then compare plain and DFlash decoding",
             "reinstall dflash-gguf"),
}


def stats_line(stats, n_tokens: int, seconds: float) -> str:
    """One line for stderr: tokens, wall time, and what DFlash did."""
    rate = n_tokens / seconds if seconds > 0 else 0.0
    head = f"-- {n_tokens} tokens in {seconds:.2f} s ({rate:.1f} tok/s)"
    if stats is None:
        return head + " | plain decoding"
    return (f"{head} | dflash: acceptance length {stats.tau:.2f}, accepted {stats.accepted}/{stats.drafted} "
            f"drafted in {stats.steps} steps, {stats.tokens_per_second:.1f} tok/s after prefill")


def _sampling_args(ap: argparse.ArgumentParser, max_tokens: int) -> None:
    g = ap.add_argument_group("sampling")
    add_flag(g, "n_predict", default=max_tokens)
    g.add_argument("--temperature", "--temp", type=float, default=GREEDY,
                   help="0 (default): greedy; > 0 samples (DFlash stays lossless: same distribution)")
    g.add_argument("--top-k", type=int, default=COMPLETION["top_k"])
    g.add_argument("--top-p", type=float, default=COMPLETION["top_p"])
    g.add_argument("--min-p", type=float, default=COMPLETION["min_p"])
    g.add_argument("--repeat-penalty", type=float, default=COMPLETION["repeat_penalty"])
    g.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible output at temperature > 0)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--no-think", action="store_true",
                   help="chat templates of thinking models: pass enable_thinking=false (thinking text is much "
                        "harder to draft, so acceptance and speed drop a lot with it on)")


def _sampling_kwargs(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=args.seed, stop=args.stop or [])


# --------------------------------------------------------------------------- generate
def _generate_parser(sub) -> None:
    ap = sub.add_parser("generate", help="complete a prompt, streaming the text, then print DFlash statistics",
                        description="Complete PROMPT with the target model (DFlash-accelerated when a drafter is "
                                    "given), stream the text to stdout and print one statistics line to stderr.",
                        epilog="example:\n  dflash-gguf generate --pair qwen3-dflash -n 200 \"def fib(n):\"\n"
                               "  echo 'import os' | dflash-gguf generate --model t.gguf --draft d.gguf -",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", default="-", help="prompt text; '-' (default) reads it from stdin")
    ap.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    ap.add_argument("--system", default=None, help="system message (with --chat)")
    ap.add_argument("--json", action="store_true", help="print the statistics as JSON instead of a line")
    _sampling_args(ap, max_tokens=256)
    add_model_args(ap)
    ap.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise SystemExit(f"{PROG} generate: empty prompt")
    llm = load_llama(args)
    kw = _sampling_kwargs(args)
    t0 = time.perf_counter()
    n = 0
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        extra = {"chat_template_kwargs": {"enable_thinking": False}} if args.no_think else {}
        for chunk in llm.create_chat_completion(msgs, stream=True, **kw, **extra):
            text = chunk["choices"][0]["delta"].get("content") or ""
            n += bool(text)
            _write(text)
    else:
        for chunk in llm.create_completion(prompt, stream=True, **kw):
            text = chunk["choices"][0]["text"]
            n += bool(text)
            _write(text)
    seconds = time.perf_counter() - t0
    _write("\n")
    stats = llm.last_dflash_stats
    n_tok = stats.n_generated if stats is not None else n
    if args.json:
        print(json.dumps({"tokens": n_tok, "seconds": round(seconds, 4),
                          "dflash": stats.as_dict() if stats is not None else None}), file=sys.stderr)
    else:
        print(stats_line(stats, n_tok, seconds), file=sys.stderr)
    llm.close()
    return 0


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


# --------------------------------------------------------------------------- chat
def _chat_parser(sub) -> None:
    ap = sub.add_parser("chat", help="interactive chat in the terminal (one user message per line)",
                        description="Chat with the model through its chat template. Each line read from stdin is "
                                    "one user message; the reply streams to stdout and a statistics line goes to "
                                    "stderr. Commands: /reset (forget the conversation), /stats, /quit. "
                                    "Works with piped input too.",
                        epilog="example:\n  dflash-gguf chat --pair qwen3-dflash --no-think\n"
                               "  printf 'hi\\nwhat is 2+2?\\n' | dflash-gguf chat --pair qwen3-dflash",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", default=None, help="system message at the start of the conversation")
    ap.add_argument("--quiet-stats", action="store_true", help="do not print a statistics line after each reply")
    _sampling_args(ap, max_tokens=512)
    add_model_args(ap)
    ap.set_defaults(func=cmd_chat)


def _read_lines(interactive: bool):
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            return
        if not interactive and line == "":
            return
        yield line.rstrip("\n")


def cmd_chat(args) -> int:
    llm = load_llama(args)
    kw = _sampling_kwargs(args)
    if args.no_think:
        kw["chat_template_kwargs"] = {"enable_thinking": False}
    base = [{"role": "system", "content": args.system}] if args.system else []
    history = list(base)
    interactive = sys.stdin.isatty()
    for line in _read_lines(interactive):
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/quit", "/exit"):
            break
        if cmd == "/reset":
            history = list(base)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if cmd == "/stats":
            s = llm.last_dflash_stats
            print(json.dumps(s.as_dict() if s is not None else None, indent=2), file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        reply, n = [], 0
        t0 = time.perf_counter()
        try:
            for chunk in llm.create_chat_completion(history, stream=True, **kw):
                text = chunk["choices"][0]["delta"].get("content") or ""
                n += bool(text)
                reply.append(text)
                _write(text)
        except ValueError as e:   # e.g. the conversation no longer fits the context
            history.pop()
            print(f"\nerror: {e} (type /reset to start over)", file=sys.stderr)
            continue
        _write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
        if not args.quiet_stats:
            stats = llm.last_dflash_stats
            print(stats_line(stats, stats.n_generated if stats else n, time.perf_counter() - t0), file=sys.stderr)
    llm.close()
    return 0


# --------------------------------------------------------------------------- dispatcher
def _delegate(name: str, argv: list[str]) -> int:
    module, what, remedy = DELEGATED[name]
    try:
        mod = importlib.import_module(module)
        entry = mod.main
    except ImportError as e:
        asked_help = any(a in ("-h", "--help") for a in argv)
        why = str(e) if "pip install" in str(e) else f"{e}; {remedy}"   # the error may name the extra already
        print(f"{PROG} {name}: {what}.\n\nNot available in this installation: {why}.",
              file=sys.stdout if asked_help else sys.stderr)
        return 0 if asked_help else 2
    if name == "serve":
        return entry(argv, prog=f"{PROG} serve") or 0
    return entry(argv) or 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description="Lossless DFlash / DFlash2 speculative decoding for GGUF "
                                 "models: a small drafter proposes a block of tokens, the target checks the whole "
                                 "block in one pass.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from dflash_gguf import __version__

    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    _generate_parser(sub)
    _chat_parser(sub)
    for name, (_, what, _) in DELEGATED.items():
        sub.add_parser(name, help=what, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        return _delegate(argv[0], argv[1:])
    ap = parser()
    args = ap.parse_args(argv)
    if args.command is None:
        ap.print_help()
        return 2
    setup_logging(getattr(args, "verbose", False))
    from dflash_gguf.errors import DFlashError

    try:
        return args.func(args)
    except (DFlashError, FileNotFoundError, ValueError) as e:
        print(f"{PROG} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
