"""The llama-cpp-python this package runs on, and the one place that says which.

Installed from a wheel (``pip install dflash-gguf`` or ``pip install .``), the package carries its own
patched copy, ``dflash_gguf._llama_cpp`` (:mod:`dflash_gguf.build.bundle`), and runs on it whatever ``llama_cpp``
the environment also has. A development checkout has no copy: it runs on the environment's
``llama_cpp``, which ``python -m dflash_gguf.build`` (``make build``) replaces with the patched build.
Every module of the package imports llama-cpp-python from here, never by its top-level name.
"""
from __future__ import annotations

import importlib

try:
    llama_cpp = importlib.import_module("dflash_gguf._llama_cpp")
    BUNDLED = True
except ModuleNotFoundError as e:
    if e.name != "dflash_gguf._llama_cpp":
        raise
    import llama_cpp
    BUNDLED = False

# llama-cpp-python's modules the package uses, under their own names (the low-level bindings, whose module
# is also called llama_cpp, as llama_low), each loaded on first use
_MODULES = {"llama_low": "llama_cpp", "llama_chat_format": "llama_chat_format", "llama_grammar": "llama_grammar",
            "llama_speculative": "llama_speculative", "llama_types": "llama_types", "_internals": "_internals"}


def __getattr__(name: str):
    sub = _MODULES.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{llama_cpp.__name__}.{sub}")
    globals()[name] = module
    return module
