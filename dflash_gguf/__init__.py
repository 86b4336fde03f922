"""dflash-gguf: lossless DFlash / DFlash2 block speculative decoding for GGUF models.

``import dflash_gguf`` stays light: the names below load their modules on first use.

    >>> from dflash_gguf import Llama
    >>> llm = Llama.from_pair("qwen3-4b-dflash/")                 # or Llama(target, draft_model_path=drafter)
    >>> llm("def fib(n):", max_tokens=64, temperature=0)["dflash"]["acceptance_length"]
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Llama": "dflash_gguf.api",
    "pair_files": "dflash_gguf.pair",
    "open_pair": "dflash_gguf.pair",
    "compare_with_plain": "dflash_gguf.pair",
    "DFlashDecoder": "dflash_gguf.decoding",
    "GenerationStats": "dflash_gguf.decoding",
    "SpecOptions": "dflash_gguf.decoding",
    "SamplingParams": "dflash_gguf.decoding.sampling",
    "Model": "dflash_gguf.native.engine",
    "Context": "dflash_gguf.native.engine",
    "ContextOptions": "dflash_gguf.native.engine",
    "set_log_handler": "dflash_gguf.native.logs",
    "StopOnTokens": "dflash_gguf.requests.stopping",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash_gguf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
