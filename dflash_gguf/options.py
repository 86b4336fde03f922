"""Command-line options shared by every command that loads a model (generate, chat, serve, bench)."""
from __future__ import annotations

import argparse
import logging

PROG = "dflash-gguf"
DEFAULT_N_CTX = 4096


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model-selection and context options shared by generate, chat and serve."""
    g = ap.add_argument_group("model")
    g.add_argument("--pair", metavar="DIR", help="converted pair directory (pair.json, target*.gguf, drafter*.gguf)")
    g.add_argument("-m", "--model", metavar="TARGET.gguf", help="target model GGUF")
    g.add_argument("-d", "--draft", metavar="DRAFTER.gguf", help="DFlash/DFlash2 drafter GGUF for that target")
    g.add_argument("--n-ctx", type=int, default=None,
                   help=f"context window in tokens (default: {DEFAULT_N_CTX}, or the model's training context if "
                        "smaller; 0: the model's training context)")
    g.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers to offload to the GPU (-1: all)")
    g.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: llama_cpp's choice)")
    g.add_argument("--draft-n-max", type=int, default=None,
                   help="tokens drafted per block (default and maximum: the drafter's block size - 1)")
    g.add_argument("--draft-adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="speed gate (default on): draft per step as many tokens as currently pays, down to plain "
                        "decoding (at most --draft-n-max); --no-draft-adaptive drafts --draft-n-max tokens every step")
    g.add_argument("--no-dflash", action="store_true", help="load the drafter but decode plainly (for comparison)")
    g.add_argument("--chat-format", default=None,
                   help="llama_cpp chat format (chatml, llama-3, ...); default: the GGUF's chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log and debug messages")


def _train_ctx(path) -> int | None:
    """The model's training context from the GGUF header (None if gguf-py is not installed)."""
    try:
        import gguf
    except ImportError:
        return None
    try:
        fields = gguf.GGUFReader(str(path)).fields
        key = next((k for k in fields if k.endswith(".context_length")), None)
        return int(fields[key].contents()) if key else None
    except Exception:
        return None


def load_llama(args: argparse.Namespace):
    """A :class:`dflash_gguf.Llama` from parsed :func:`add_model_args` options."""
    from dflash_gguf.api import Llama, pair_files

    if args.pair:
        if args.model or args.draft:
            raise SystemExit(f"{PROG}: use either --pair or --model/--draft, not both")
        target, draft = pair_files(args.pair)
    elif args.model:
        target, draft = args.model, args.draft
    else:
        raise SystemExit(f"{PROG}: no model: pass --pair DIR, or --model TARGET.gguf [--draft DRAFTER.gguf]")
    n_ctx = args.n_ctx
    if n_ctx is None:
        n_ctx = min(DEFAULT_N_CTX, _train_ctx(target) or DEFAULT_N_CTX)
    kw = dict(n_ctx=n_ctx, n_gpu_layers=args.n_gpu_layers, draft_n_max=args.draft_n_max,
              draft_adaptive=args.draft_adaptive,
              dflash=not args.no_dflash, chat_format=args.chat_format, verbose=args.verbose)
    if args.threads:
        kw.update(n_threads=args.threads, n_threads_batch=args.threads)
    return Llama(str(target), draft_model_path=str(draft) if draft else None, **kw)


def setup_logging(verbose: bool, level: int = logging.WARNING) -> None:
    """Python logging on stderr; llama.cpp's own log joins it (its info lines only with -v)."""
    from dflash_gguf.logs import set_log_handler

    logging.basicConfig(level=logging.DEBUG if verbose else level, format="%(levelname)s %(name)s: %(message)s")
    set_log_handler()
