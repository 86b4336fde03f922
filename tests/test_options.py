"""One set of model flags (llama.cpp's names, the older names as aliases) across generate, chat,
serve and bench, with the same help everywhere."""
from __future__ import annotations

import argparse

import pytest

from dflash_gguf import cli
from dflash_gguf.bench.cli import parser as bench_parser
from dflash_gguf.options import FLAGS
from dflash_gguf.server.cli import parser as server_parser


def _sub(name: str) -> argparse.ArgumentParser:
    ap = cli.parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


PARSERS = {"generate": lambda: _sub("generate"), "chat": lambda: _sub("chat"), "serve": server_parser,
           "bench": bench_parser}
SHARED = {  # flag -> the commands that take it
    "model": ("generate", "chat", "serve", "bench"),
    "draft": ("generate", "chat", "serve", "bench"),
    "threads": ("generate", "chat", "serve", "bench"),
    "draft_max": ("generate", "chat", "serve", "bench"),
    "draft_adaptive": ("generate", "chat", "serve", "bench"),
    "ctx_size": ("generate", "chat", "serve"),
    "gpu_layers": ("generate", "chat", "serve"),
    "n_predict": ("generate", "chat", "bench"),
    "draft_window": ("generate", "chat", "serve"),
    "low_memory": ("generate", "chat", "serve"),
    "rollback_memory": ("generate", "chat", "serve"),
    "spec_type": ("generate", "chat", "serve"),
    "spec_ngram_size_n": ("generate", "chat", "serve"),
    "spec_ngram_size_m": ("generate", "chat", "serve"),
}


def _action(ap: argparse.ArgumentParser, option: str) -> argparse.Action:
    return next(a for a in ap._actions if option in a.option_strings)


@pytest.mark.parametrize("flag", sorted(SHARED))
def test_flag_is_the_same_in_every_command(flag):
    names = FLAGS[flag][0]
    seen = {}
    for cmd in SHARED[flag]:
        act = _action(PARSERS[cmd](), names[0])
        given = tuple(o for o in act.option_strings if not o.startswith("--no-"))   # on/off flags add --no-X
        assert given == names, (cmd, act.option_strings)
        seen[cmd] = act.help.split("(default")[0]   # the defaults may differ, the wording may not
    assert len(set(seen.values())) == 1, seen


LLAMA_CPP = ["-m", "t.gguf", "-md", "d.gguf", "-c", "1024", "-t", "3", "--draft-max", "5", "-ngl", "2"]
OLD = ["--model", "t.gguf", "--draft", "d.gguf", "--n-ctx", "1024", "--threads", "3", "--draft-n-max", "5",
       "--n-gpu-layers", "2"]


@pytest.mark.parametrize("cmd", ["generate", "serve"])
def test_llama_cpp_names_and_old_names_parse_alike(cmd):
    extra = ["x"] if cmd == "generate" else []
    a = PARSERS[cmd]().parse_args(LLAMA_CPP + extra)
    b = PARSERS[cmd]().parse_args(OLD + extra)
    assert vars(a) == vars(b)
    assert (a.model, a.draft, a.n_ctx, a.threads, a.draft_n_max, a.n_gpu_layers) == ("t.gguf", "d.gguf", 1024, 3, 5, 2)


def test_bench_takes_the_same_names():
    a = bench_parser().parse_args(["-m", "t.gguf", "-md", "d.gguf", "--draft-max", "3", "--draft-adaptive", "-n", "9"])
    b = bench_parser().parse_args(["--model", "t.gguf", "--draft", "d.gguf", "--n-draft", "3", "--adaptive",
                                   "--max-tokens", "9"])
    assert vars(a) == vars(b)
    assert (str(a.model), str(a.draft), a.n_draft, a.adaptive, a.max_tokens) == ("t.gguf", "d.gguf", 3, True, 9)


def test_draft_gpu_layers_flag():
    a = PARSERS["serve"]().parse_args(["-m", "t.gguf", "-ngld", "3"])
    b = PARSERS["serve"]().parse_args(["-m", "t.gguf", "--n-gpu-layers-draft", "3"])
    assert a.draft_n_gpu_layers == b.draft_n_gpu_layers == 3


def test_server_limits_and_alias_flags():
    a = server_parser().parse_args(["-m", "t.gguf", "-a", "my-model", "--max-queue", "4", "--request-timeout", "2.5"])
    assert (a.model_alias, a.max_queue, a.request_timeout) == ("my-model", 4, 2.5)


def test_speed_gate_is_on_by_default_and_can_be_turned_off():
    for cmd in SHARED["draft_adaptive"]:
        ap = PARSERS[cmd]()
        dest = _action(ap, "--draft-adaptive").dest
        base = ["-m", "t.gguf"] + (["x"] if cmd == "generate" else [])
        assert getattr(ap.parse_args(base), dest) is True, cmd
        assert getattr(ap.parse_args(base + ["--no-draft-adaptive"]), dest) is False, cmd


def test_memory_flags_reach_the_llama(models):
    """--draft-window, --low-memory and --rollback-memory-mb parse in every command and load_llama
    hands them to dflash_gguf.Llama."""
    from dflash_gguf.options import load_llama

    pair = models.pair("qwen3", "dflash", 8)
    a = PARSERS["serve"]().parse_args(["-m", str(pair.target), "-md", str(pair.drafter), "-c", "512", "-t", "1",
                                       "--draft-window", "40", "--low-memory", "--rollback-memory-mb", "64"])
    assert (a.draft_window, a.low_memory, a.rollback_memory_mb) == (40, True, 64.0)
    llm = load_llama(a)
    try:
        assert (llm.draft_window, llm.low_memory, llm.rollback_memory_mb) == (40, True, 64.0)
        assert llm.decoder.drafter.window == 40 and llm.context_params.flash_attn_type == 1
    finally:
        llm.close()
    d = PARSERS["generate"]().parse_args(["-m", "t.gguf", "x"])
    assert (d.draft_window, d.low_memory, d.rollback_memory_mb) == (None, False, None)
