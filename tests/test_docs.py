"""The docs match the code: every command README.md, BENCHMARKS.md and bench/README.md show runs a
module that exists, with flags that module's --help lists, and the defaults the README states are the
code's."""
from __future__ import annotations

import inspect
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "BENCHMARKS.md", "bench/README.md")
# `python -m dflash_gguf.X ...` up to the end of a code span / line / comment; `python -m dflash_gguf SUB`
CMD = re.compile(r"python -m (dflash_gguf(?:\.[a-z_]+)*)((?:[^`#\n|]|\\\n)*)")
SUBCOMMANDS = ("demo", "generate", "chat", "serve", "bench", "convert", "complete")


def commands() -> list[tuple[str, int, str, list[str]]]:
    """(doc, line, module or 'dflash_gguf SUB', flags) of every documented command."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in CMD.finditer(text):
            module, rest = m.group(1), m.group(2).replace("\\\n", " ")
            line = text.count("\n", 0, m.start()) + 1
            try:
                words = shlex.split(rest, comments=False)
            except ValueError:
                words = rest.split()
            if module == "dflash_gguf" and words and words[0] in SUBCOMMANDS:
                module, words = f"dflash_gguf {words[0]}", words[1:]
            flags = sorted({w.split("=")[0] for w in words if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", w)})
            out.append((doc, line, module, flags))
    return out


@lru_cache(maxsize=None)
def help_text(module: str) -> str:
    args = [sys.executable, "-m", *module.split(), "--help"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"{' '.join(args)} failed:\n{r.stderr[-1500:]}"
    return r.stdout


DOCUMENTED = commands()


def test_the_docs_show_commands():
    assert len(DOCUMENTED) > 40 and {m for _, _, m, _ in DOCUMENTED} >= {
        "dflash_gguf.bench", "dflash_gguf.bench.scale", "dflash_gguf.convert", "dflash_gguf demo"}


@pytest.mark.parametrize("module", sorted({m for _, _, m, _ in DOCUMENTED}))
def test_every_documented_flag_exists(module):
    text = help_text(module)
    listed = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", text))
    wrong = [(doc, line, f) for doc, line, m, flags in DOCUMENTED if m == module for f in flags
             if f not in listed]
    assert not wrong, f"flags the docs give {module} that its --help does not list: {wrong}"


def test_documented_defaults_are_the_codes():
    from dflash_gguf import Llama, memory
    from dflash_gguf.gate import DraftLength  # noqa: F401  (the gate the README describes)

    readme = (ROOT / "README.md").read_text()
    sig = inspect.signature(Llama.__init__).parameters
    # "else 1024 minus the block size": the window the engine derives when draft_window is None and the
    # drafter GGUF has no sliding window of its own (tests/test_drafter_attention.py: one that has)
    assert "else 1024 minus the block size" in " ".join(readme.split())
    from dflash_gguf.engine import DEFAULT_DRAFT_CACHE
    assert DEFAULT_DRAFT_CACHE == 1024 and sig["draft_window"].default is None
    # the low-memory preset's "512-cell drafter cache" (window 512 - block: tests/test_api.py checks it)
    assert "512-cell drafter cache" in readme and memory.LOW_MEMORY_DRAFT_CACHE == 512
    assert memory.LOW_MEMORY["n_batch"] == 256 and memory.LOW_MEMORY["n_ubatch"] == 64
    assert "`n_batch` 256 / `n_ubatch` 64" in readme
