"""Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``), in process.

Q4_0, Q8_0 and F16 come first: Arm's SME2 (KleidiAI) kernels serve exactly those. Tensors
whose rows do not fit a type's block size fall back to a compatible type inside llama.cpp.
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from dflash_gguf.convert.errors import ConvertError

log = logging.getLogger("dflash_gguf.convert")

# name -> llama_cpp constant name (resolved lazily: importing llama_cpp loads libllama)
QTYPES = {
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
    "f16": "LLAMA_FTYPE_MOSTLY_F16",
    "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
}


def quantize_file(src: Path, dst: Path, qtype: str, threads: int | None = None) -> None:
    """Write ``src`` quantized to ``qtype`` as ``dst``; raise :class:`ConvertError` on failure."""
    if qtype not in QTYPES:
        raise ValueError(f"quantization type must be one of {sorted(QTYPES)}, got {qtype!r}")
    from dflash_gguf.native.llama import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QTYPES[qtype])
    params.nthread = threads or (os.cpu_count() or 1)
    log.debug("llama_model_quantize %s -> %s (%s, %d threads)", src.name, dst.name, qtype, params.nthread)
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0 or not dst.is_file():
        raise ConvertError(f"llama.cpp could not quantize {src.name} to {qtype} (status {rc}); the llama.cpp "
                           "log above (at DEBUG, or on stderr) says why")
