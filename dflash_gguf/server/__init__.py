"""OpenAI-compatible HTTP server with DFlash inside (``python -m dflash_gguf.server``).

Parts: :mod:`.app` (routes, serving state, errors), :mod:`.schemas` (request models),
:mod:`.metrics` (counters), :mod:`.cli` (the command).
"""
from __future__ import annotations

from dflash_gguf.server.app import create_app
from dflash_gguf.server.cli import main, parser

__all__ = ["create_app", "main", "parser"]
