"""ggml's AMX path on x86 (Intel AMX-INT8): detection and a MUL_MAT differential check.

ggml repacks quantized weights into an "AMX" extra buffer type of the CPU backend and multiplies
them with AMX tiles (several rows) or AVX512-VNNI (one row). The check itself is
:mod:`dflash_gguf.kernels.mulmat` with ``--buft AMX``; this module sets ``GGML_CPU_AMX=1`` before ggml is
loaded (the buffer type is registered only when it allows it, see ``patches/``):

    python -m dflash_gguf.kernels.amx                       # the default grid, JSON lines, exit 1 on a mismatch
    python -m dflash_gguf.kernels.amx --types q4_0 --rows 1-17,32,100 --k 512 --n 96

A crash in the AMX kernels kills the process, so callers (tests) run this in a child process.
"""
from __future__ import annotations

import logging
import os
import sys

from dflash_gguf.kernels.cpu import cpu_flags
from dflash_gguf.kernels.mulmat import BUFT_TYPES

log = logging.getLogger(__name__)

# the types ggml's AMX buffer type claims for MUL_MAT (amx.cpp supports_op)
AMX_TYPES = BUFT_TYPES["AMX"]


def cpu_has_amx_int8() -> bool:
    return {"amx_int8", "amx_tile", "avx512_vnni"} <= cpu_flags()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = sys.argv[1:] if argv is None else argv
    if not cpu_has_amx_int8() and not {"-h", "--help"} & set(args):
        log.error("this CPU has no AMX-INT8 (amx_int8, amx_tile, avx512_vnni in /proc/cpuinfo)")
        return 2
    os.environ.setdefault("GGML_CPU_AMX", "1")
    from dflash_gguf.kernels import mulmat
    return mulmat.main(["--buft", "AMX", *args])


if __name__ == "__main__":
    sys.exit(main())
