"""OpenAI-compatible HTTP server with DFlash inside (``python -m dflash_gguf.server``).

Parts: :mod:`.app` (routes, serving state, errors), :mod:`.schemas` (request models),
:mod:`.metrics` (counters), :mod:`.cli` (the command).
"""
from __future__ import annotations

try:
    from dflash_gguf.server.app import create_app
    from dflash_gguf.server.cli import main, parser
except ModuleNotFoundError as e:   # the server's packages are an extra: say which
    if e.name not in ("fastapi", "starlette", "pydantic", "uvicorn"):
        raise
    raise ModuleNotFoundError(f"the server needs {e.name}, which the 'server' extra brings: "
                              "pip install 'dflash-gguf[server]'", name=e.name) from e

__all__ = ["create_app", "main", "parser"]
