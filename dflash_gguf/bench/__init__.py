"""Benchmarks: plain decoding vs our DFlash vs upstream llama.cpp's C++ DFlash (``python -m dflash_gguf.bench``).

Parts: :mod:`.prompts` (prompt sets), :mod:`.results` (records, machine facts), :mod:`.ours` (our
columns, sweep, profile), :mod:`.upstream` (the C++ column), :mod:`.report` (summary, chart),
:mod:`.cli` (the command).
"""
from __future__ import annotations

from dflash_gguf.bench.cli import main

__all__ = ["main"]
