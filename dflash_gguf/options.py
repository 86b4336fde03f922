"""Command-line options shared by every command that loads a model (generate, chat, serve, bench)."""
from __future__ import annotations

import argparse
import logging

PROG = "dflash-gguf"
DEFAULT_N_CTX = 4096


# One definition per flag, named as llama.cpp names it (llama-cli, llama-server, llama-speculative);
# the names this project used before stay as aliases. Every command that takes a flag adds it from
# here, so ``--help`` says the same thing the same way everywhere.
FLAGS: dict[str, tuple[tuple[str, ...], dict]] = {
    "model": (("-m", "--model"), dict(metavar="TARGET.gguf", help="target model GGUF")),
    "draft": (("-md", "--model-draft", "-d", "--draft"),
              dict(dest="draft", metavar="DRAFTER.gguf", help="DFlash/DFlash2 drafter GGUF converted for that target")),
    "ctx_size": (("-c", "--ctx-size", "--n-ctx"),
                 dict(dest="n_ctx", type=int, default=None, metavar="N",
                      help=f"context window in tokens (default: {DEFAULT_N_CTX}, or the model's training context if "
                           "smaller; 0: the model's training context)")),
    "threads": (("-t", "--threads"), dict(type=int, default=None, metavar="N", help="CPU threads (default: %s)")),
    "gpu_layers": (("-ngl", "--gpu-layers", "--n-gpu-layers"),
                   dict(dest="n_gpu_layers", type=int, default=0, metavar="N",
                        help="target layers to offload to the GPU (default 0; -1: all)")),
    "gpu_layers_draft": (("-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"),
                         dict(dest="draft_n_gpu_layers", type=int, default=None, metavar="N",
                              help="drafter layers to offload to the GPU (default: as -ngl)")),
    "draft_max": (("--draft-max", "--draft-n", "--draft-n-max", "--n-draft"),
                  dict(dest="draft_n_max", type=int, default=None, metavar="N",
                       help="tokens drafted per block at most (default and maximum: the drafter's block size - 1)")),
    "draft_adaptive": (("--draft-adaptive", "--adaptive"),
                       dict(dest="draft_adaptive", action=argparse.BooleanOptionalAction, default=True,
                            help="speed gate (default on): draft per step as many tokens as currently pays, down "
                                 "to plain decoding (at most --draft-max); --no-draft-adaptive drafts --draft-max "
                                 "tokens every step")),
    "draft_window": (("--draft-window",),
                     dict(dest="draft_window", type=int, default=None, metavar="N",
                          help="context positions the drafter attends to (default: the drafter's own sliding window "
                               "when its GGUF has one, else 1024 minus the block size, a 1024-cell drafter cache; "
                               "0: the whole context). Output is exact either way")),
    "flash_attn": (("-fa", "--flash-attn"),
                   dict(dest="flash_attn", choices=("on", "off", "auto"), default="auto",
                        help="flash attention (default auto, as llama.cpp: on; its CPU kernel sums in fp32)")),
    "low_memory": (("--low-memory",),
                   dict(dest="low_memory", action="store_true",
                        help="low-memory preset: weights read rather than mapped, small batches, flash attention, "
                             "Q8_0 KV cache, a 512-cell drafter cache (README: Memory)")),
    "rollback_memory": (("--rollback-memory-mb",),
                        dict(dest="rollback_memory_mb", type=float, default=None, metavar="MB",
                             help="hybrid targets: the most memory rollback may take; recurrent-state snapshots "
                                  "(fastest) while they fit, else a host checkpoint")),
    "rpc": (("--rpc",), dict(dest="rpc", metavar="HOST:PORT,...", default=None,
                            help="the target's layers on these llama.cpp rpc-server processes (all layers unless -ngl "
                                 "says fewer; the rest stay local). rpc-server has no authentication: loopback or a "
                                 "trusted network only (README: Scaling out)")),
    "rpc_draft": (("--rpc-draft",), dict(dest="rpc_draft", metavar="HOST:PORT,...", default=None,
                                         help="the drafter's layers on rpc-servers (default: the drafter is local)")),
    "tensor_split": (("-ts", "--tensor-split"),
                     dict(dest="tensor_split", metavar="N0,N1,...", default=None,
                          help="fraction of the offloaded layers per device, in order (with --rpc: per rpc-server "
                               "device), e.g. 3,1")),
    "hf_repo": (("-hf", "-hfr", "--hf-repo"),
                dict(dest="hf_repo", metavar="USER/MODEL[:QUANT]", default=None,
                     help="the target from a Hugging Face repository, as llama.cpp's -hf: QUANT picks the GGUF by its "
                          "tag (default Q4_K_M, else the first); the drafter published beside it (dspark-*, "
                          "dflash-*) comes with it unless -hfd, -md or --no-draft says otherwise (needs the hub extra)")),
    "hf_file": (("-hff", "--hf-file"), dict(dest="hf_file", metavar="FILE", default=None,
                                           help="with -hf: this file (a name or glob) instead of the QUANT tag")),
    "hf_repo_draft": (("-hfd", "-hfrd", "--hf-repo-draft"),
                      dict(dest="hf_repo_draft", metavar="USER/MODEL[:QUANT]", default=None,
                           help="the drafter from its own repository (QUANT: its tag; default: DSpark before DFlash, "
                                "Q8_0 before BF16/F16)")),
    "hf_file_draft": (("-hffd", "--hf-file-draft"), dict(dest="hf_file_draft", metavar="FILE", default=None,
                                                        help="the drafter file (a name or glob) of -hfd's "
                                                             "repository, or of -hf's")),
    "no_draft": (("--no-draft",), dict(dest="no_draft", action="store_true",
                                       help="with -hf: no drafter (plain decoding), even where one is published")),
    "spec_type": (("--spec-type",),
                  dict(dest="spec_type", metavar="ngram-simple", default=None,
                       help="ngram-simple: also draft by prompt lookup, copying the tokens that followed the last "
                            "tokens' latest earlier occurrence in the prompt and the text so far (without a "
                            "drafter: the only proposer, any GGUF; beside one: where a copy is expected to pay "
                            "more); exact either way")),
    "spec_ngram_size_n": (("--spec-ngram-simple-size-n",),
                          dict(dest="spec_ngram_size_n", type=int, default=2, metavar="N",
                               help="prompt lookup: the longest n-gram looked up (default %(default)s)")),
    "spec_ngram_size_m": (("--spec-ngram-simple-size-m",),
                          dict(dest="spec_ngram_size_m", type=int, default=10, metavar="M",
                               help="prompt lookup: tokens copied per step at most (default %(default)s; beside a "
                                    "drafter no more than it drafts)")),
    "n_predict": (("-n", "--n-predict", "--predict", "--max-tokens"),
                  dict(dest="max_tokens", type=int, metavar="N",
                       help="tokens to generate at most (default %(default)s; generate and chat: 0 means until EOS "
                            "or the context is full)")),
}


def add_flag(group, name: str, default_text: str | None = None, **overrides) -> argparse.Action:
    """Add the shared flag ``name`` (a key of :data:`FLAGS`) to ``group``.

    ``default_text`` fills a ``%s`` in the help (for defaults a command computes); ``overrides``
    change argparse keywords such as ``default`` or ``dest`` (never the wording).
    """
    names, kw = FLAGS[name]
    kw = dict(kw, **overrides)
    if "%s" in kw.get("help", ""):
        kw["help"] = kw["help"] % (default_text or "half the CPU cores, as llama-cpp-python")
    return group.add_argument(*names, **kw)


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model-selection and context options shared by generate, chat and serve."""
    g = ap.add_argument_group("model")
    g.add_argument("--pair", metavar="DIR", help="converted pair directory (pair.json, target*.gguf, drafter*.gguf)")
    for name in ("model", "draft", "hf_repo", "hf_file", "hf_repo_draft", "hf_file_draft", "no_draft",
                 "ctx_size", "gpu_layers", "gpu_layers_draft", "threads", "flash_attn", "draft_max",
                 "draft_adaptive", "draft_window", "low_memory", "rollback_memory", "rpc", "rpc_draft", "tensor_split",
                 "spec_type", "spec_ngram_size_n", "spec_ngram_size_m"):
        add_flag(g, name)
    g.add_argument("--no-dflash", action="store_true", help="load the drafter but decode plainly (for comparison)")
    g.add_argument("--chat-format", default=None,
                   help="llama_cpp chat format (chatml, llama-3, ...); default: the GGUF's chat template")
    g.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log and debug messages")


def resolve_n_ctx(n_ctx: int | None, target) -> int:
    """``-c``'s value, or its default: DEFAULT_N_CTX, or the target's training context if smaller."""
    if n_ctx is None:
        return min(DEFAULT_N_CTX, _train_ctx(target) or DEFAULT_N_CTX)
    return n_ctx


def _train_ctx(path) -> int | None:
    """The model's training context from the GGUF header (None if it cannot be read)."""
    from dflash_gguf.errors import ModelFileError
    from dflash_gguf.native.gguf_check import parse_gguf

    try:
        h = parse_gguf(path, light=True)   # the header only: no vocabulary as Python objects
    except (OSError, ModelFileError):
        return None
    value = h.get(f"{h.arch}.context_length")
    return int(value) if isinstance(value, int) else None


def load_llama(args: argparse.Namespace):
    """A :class:`dflash_gguf.Llama` from parsed :func:`add_model_args` options."""
    from dflash_gguf.api import Llama, pair_files

    if getattr(args, "hf_repo", None):
        return _load_hub(args)
    if getattr(args, "hf_repo_draft", None) or getattr(args, "hf_file", None) or getattr(args, "hf_file_draft", None):
        raise SystemExit(f"{PROG}: -hfd, -hff and -hffd go with -hf (the target's repository)")
    if args.pair:
        if args.model or args.draft:
            raise SystemExit(f"{PROG}: use either --pair or --model/--draft, not both")
        target, draft = pair_files(args.pair)
    elif args.model:
        target, draft = args.model, args.draft
    else:
        raise SystemExit(f"{PROG}: no model: pass --pair DIR, --model TARGET.gguf [--draft DRAFTER.gguf] or "
                         "-hf USER/MODEL[:QUANT]")
    return Llama(str(target), draft_model_path=str(draft) if draft else None, **llama_kwargs(args, target))


def _load_hub(args: argparse.Namespace):
    """-hf and its companions: the target (and its drafter) fetched as ``Llama.from_pretrained`` fetches
    them, so the drafter found beside the target is the same one Python users get."""
    from dflash_gguf.api import Llama
    from dflash_gguf.hub import HubFileNotFound, model_for_tag, split_hf_spec

    if args.pair or args.model:
        raise SystemExit(f"{PROG}: use either -hf or --pair/--model, not both")
    try:
        repo, quant = split_hf_spec(args.hf_repo)
        filename = args.hf_file or model_for_tag(repo, quant)
        draft = dict(draft_filename=False) if args.no_draft else {}
        if args.hf_repo_draft:
            d_repo, d_quant = split_hf_spec(args.hf_repo_draft)
            draft = dict(draft_repo_id=d_repo, draft_filename=args.hf_file_draft
                         or (model_for_tag(d_repo, d_quant) if d_quant else None))
        elif args.hf_file_draft:
            draft = dict(draft_filename=args.hf_file_draft)
        if args.draft:       # a local drafter beside the fetched target
            draft = dict(draft_filename=False)
        target, drafter = Llama.pretrained_files(repo, filename, **draft)
        drafter = args.draft or drafter
        return Llama(str(target), draft_model_path=str(drafter) if drafter else None, **llama_kwargs(args, target))
    except (ValueError, HubFileNotFound) as e:
        raise SystemExit(f"{PROG}: {e}") from None


def llama_kwargs(args: argparse.Namespace, target) -> dict:
    """The :class:`dflash_gguf.Llama` keyword arguments of parsed :func:`add_model_args` options."""
    kw = dict(n_ctx=resolve_n_ctx(args.n_ctx, target), n_gpu_layers=args.n_gpu_layers, draft_n_max=args.draft_n_max,
              draft_adaptive=args.draft_adaptive, draft_n_gpu_layers=args.draft_n_gpu_layers,
              dflash=not args.no_dflash, chat_format=args.chat_format, verbose=args.verbose,
              draft_window=args.draft_window, low_memory=args.low_memory, rollback_memory_mb=args.rollback_memory_mb,
              flash_attn=getattr(args, "flash_attn", "auto") != "off", logits_all=getattr(args, "logits_all", False))
    if args.threads:
        kw.update(n_threads=args.threads, n_threads_batch=args.threads)
    if getattr(args, "n_seq_max", 1) > 1:     # the server's slots share the context (server.cli.build)
        kw["n_seq_max"] = args.n_seq_max
    kw.update(spec_kwargs(args))
    kw.update(rpc_kwargs(args, kw))
    return kw


SPEC_TYPES = ("ngram-simple",)


def spec_kwargs(args: argparse.Namespace) -> dict:
    """--spec-type and its n-gram sizes as Llama arguments (prompt lookup)."""
    kinds = [k.strip() for k in (getattr(args, "spec_type", None) or "").split(",") if k.strip()]
    bad = [k for k in kinds if k not in SPEC_TYPES]
    if bad:
        raise SystemExit(f"{PROG}: --spec-type {bad[0]!r} is not served here (served: {', '.join(SPEC_TYPES)}; "
                         "a DFlash/DSpark drafter comes with -md)")
    if not kinds:
        return {}
    n, m = getattr(args, "spec_ngram_size_n", 2), getattr(args, "spec_ngram_size_m", 10)
    if n < 1 or m < 1:
        raise SystemExit(f"{PROG}: --spec-ngram-simple-size-n and -size-m must be >= 1, got {n} and {m}")
    return dict(prompt_lookup=True, prompt_lookup_max_ngram_size=n, prompt_lookup_num_pred_tokens=m)


def rpc_kwargs(args: argparse.Namespace, kw: dict) -> dict:
    """--rpc, --rpc-draft and -ts as Llama arguments (with --rpc an -ngl left at 0 means all layers)."""
    out = {}
    if getattr(args, "rpc", None):
        out["rpc_servers"] = args.rpc.split(",")
        if kw.get("n_gpu_layers") == 0:
            out["n_gpu_layers"] = -1
    if getattr(args, "rpc_draft", None):
        out["draft_rpc_servers"] = args.rpc_draft.split(",")
    if getattr(args, "tensor_split", None):
        try:
            out["tensor_split"] = [float(x) for x in args.tensor_split.replace("/", ",").split(",")]
        except ValueError:
            raise SystemExit(f"{PROG}: -ts/--tensor-split takes numbers separated by commas, "
                             f"got {args.tensor_split!r}") from None
    return out


def setup_logging(verbose: bool, level: int = logging.WARNING) -> None:
    """Python logging on stderr; llama.cpp's own log joins it (its info lines only with -v)."""
    from dflash_gguf.native.logs import set_log_handler

    logging.basicConfig(level=logging.DEBUG if verbose else level, format="%(levelname)s %(name)s: %(message)s")
    set_log_handler()
