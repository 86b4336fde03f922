"""``python -m dflash_gguf.server``: load a model (or pair) and serve it with uvicorn."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os

from dflash_gguf.server.app import create_app

API_KEY_ENV = "DFLASH_GGUF_API_KEY"
log = logging.getLogger("dflash_gguf.server")


def parser(prog: str = "python -m dflash_gguf.server") -> argparse.ArgumentParser:
    from dflash_gguf.options import add_model_args

    ap = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI-compatible server (/v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/metrics) with lossless DFlash speculative decoding. One model; requests are decoded together, "
                    "up to -np (default 4) per step in one batched engine sharing one KV cache of -c cells.",
        epilog="example:\n  python -m dflash_gguf.server --pair qwen3-8b-dflash --port 8000\n"
               "  curl localhost:8000/v1/chat/completions -H 'content-type: application/json' \\\n"
               "       -d '{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
               "\"chat_template_kwargs\": {\"enable_thinking\": false}}'\n\n"
               "Thinking models: chat_template_kwargs {\"enable_thinking\": false} raises DFlash acceptance a lot.")
    g = ap.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0: all)")
    g.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    g.add_argument("-a", "--alias", "--model-alias", dest="model_alias", default=None,
                   help="model id shown by /v1/models (default: the target's name)")
    g.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests allowed to wait while the model (with -np: every slot) is busy; more get 503 at "
                        "once (default: no limit)")
    g.add_argument("--request-timeout", type=float, default=None, metavar="S",
                   help="seconds from a request's arrival to its end; then it is stopped and gets 408 "
                        "(default: no limit)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every request but /health (401 otherwise); "
                        f"also from the environment variable {API_KEY_ENV}, which keeps it out of process "
                        f"listings (default: no key)")
    g.add_argument("-np", "--parallel", type=int, default=-1, metavar="N",
                   help="server slots: requests decoded together, up to N sequences per step in one batched engine "
                        "(llama.cpp's flag). They share the model's own context: one KV cache of -c cells, any "
                        "request up to all of it as the others leave room (memory is what one context costs); a "
                        "request waits for room, and one that would overflow it gives its cells back and resumes "
                        "unseen. Requests the slots do not serve (an echoed prompt's logprobs, a chat format "
                        "without a known formatter) run one at a time with the cache to themselves (default: -1, "
                        "auto: 4 slots, as llama-server; 0: no slots, every request one at a time)")
    g.add_argument("--logits-all", action="store_true",
                   help="keep every position's logits, as llama_cpp's logits_all: completions' logprobs and chats' "
                        "top_logprobs then work (with DFlash), at n_ctx x vocabulary x 4 bytes of memory "
                        "(default: off; such requests get 400)")
    add_model_args(ap)
    return ap


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def io_stack() -> tuple[str, str]:
    """uvicorn's event loop and HTTP parser: uvloop and httptools where installed (the ``server`` extra
    has them: a streamed token costs the event loop about a third less CPU than on asyncio's loop with
    h11, time it takes from ggml's threads on the same cores; BENCHMARKS.md section 20), else the pure
    Python ones."""
    import importlib.util

    have = lambda name: importlib.util.find_spec(name) is not None  # noqa: E731
    return ("uvloop" if have("uvloop") else "asyncio"), ("httptools" if have("httptools") else "h11")


def build(args: argparse.Namespace):
    """The app (and its Llama) that ``args`` (from :func:`parser`) describe."""
    from dflash_gguf.options import load_llama

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not api_key and not loopback(args.host):
        log.warning("serving on %s without an API key: anyone who can reach port %d can use the model "
                    "(--api-key KEY or %s)", args.host, args.port, API_KEY_ENV)
    from dflash_gguf.server.app import AUTO_SLOTS

    # the slots' sequences in the model's own context from the start (one KV cache of -c cells), so that the
    # engine on it opens once
    args.n_seq_max = AUTO_SLOTS if args.parallel == -1 else max(args.parallel, 1)
    llm = load_llama(args)
    return create_app(llm, args.model_alias, max_queue=args.max_queue, request_timeout=args.request_timeout,
                      parallel=args.parallel, api_key=api_key), llm


def serve(app, args: argparse.Namespace) -> None:
    """Serve ``app`` with uvicorn on ``args``' host and port (until interrupted)."""
    try:
        import uvicorn
    except ModuleNotFoundError as e:
        raise SystemExit("the server needs uvicorn, which the 'server' extra brings: "
                         "pip install 'dflash-gguf[server]'") from e

    loop, http = io_stack()
    if (loop, http) != ("uvloop", "httptools"):
        log.info("event loop %s, HTTP parser %s (pip install uvloop httptools: less CPU per streamed token)",
                 loop, http)
    uvicorn.run(app, host=args.host, port=args.port, loop=loop, http=http,
                log_level="debug" if args.verbose else "info")


def main(argv: list[str] | None = None, prog: str = "python -m dflash_gguf.server") -> int:
    from dflash_gguf.options import setup_logging

    args = parser(prog).parse_args(argv)
    setup_logging(args.verbose, logging.INFO)
    app, _ = build(args)
    serve(app, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
