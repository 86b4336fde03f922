"""Greedy plain and DFlash tokens of one pair in a child process, for the kernel tests (test_amx,
test_x86mm): ggml's kernel switches (GGML_CPU_AMX, GGML_CPU_X86MM) only take effect when ggml is
loaded, and a fault in a kernel must fail a test, not kill the test run.

    python tests/kernel_child.py TARGET DRAFTER N_TOKENS THREADS

prints one JSON line: plain and DFlash tokens, the acceptance length, the extra buffer types ggml
registered, how many model buffers llama.cpp placed in each (from its load log) and the instruction
set of the x86 kernels in the ggml it loaded.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

PROMPT = b"def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"


def python(args: list[str], env: dict[str, str | None], timeout: int = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` in a child with ``env`` (None: unset) on top of this process's environment."""
    child_env = {k: v for k, v in os.environ.items() if k not in env}
    child_env.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([sys.executable, *args], env=child_env, capture_output=True, text=True, timeout=timeout)


def died(p: subprocess.CompletedProcess) -> str:
    """How a child ended (a signal, or its exit status), with the end of its stderr."""
    sig = -p.returncode if p.returncode < 0 else None
    return (f"the child process died (signal {sig})" if sig else f"exit {p.returncode}") + f":\n{p.stderr[-3000:]}"


def run(target: Path, drafter: Path, n: int, threads: int, env: dict[str, str | None], timeout: int = 600) -> dict:
    """Run this script in a child with ``env``; its JSON line."""
    p = python([__file__, str(target), str(drafter), str(n), str(threads)], env, timeout)
    if p.returncode != 0:
        raise AssertionError(f"greedy generation with {env}: {died(p)}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def quantized_demo_pairs(dest: Path, demo: Path) -> dict[str, tuple[Path, Path]]:
    """The demo pair's target quantized by llama.cpp's quantizer (Q8_0, Q4_0, Q4_K_M: Q4_K plus Q6_K for
    attn_v, half of ffn_down and the head) with the F16 drafter, and the Q4_0 target with a Q8_0 drafter."""
    from dflash_gguf.convert.quantize import quantize_file

    out = {"f16": (demo / "target.gguf", demo / "drafter.gguf")}
    for q in ("q8_0", "q4_0", "q4_k_m"):
        t = dest / f"target-{q}.gguf"
        quantize_file(demo / "target.gguf", t, q, threads=1)
        out[q] = (t, demo / "drafter.gguf")
    dq = dest / "drafter-q8_0.gguf"
    quantize_file(demo / "drafter.gguf", dq, "q8_0", threads=1)
    out["q4_0+q8_0 drafter"] = (out["q4_0"][0], dq)
    out["q8_0+q8_0 drafter"] = (out["q8_0"][0], dq)
    return out


def quantized_tiny_pair(models, dest: Path) -> tuple[Path, Path]:
    """The tiny Qwen3 test pair, target Q4_0 and drafter Q8_0."""
    from dflash_gguf.convert.quantize import quantize_file

    p = models.pair("qwen3", "dflash", 8)
    t, d = dest / "t.gguf", dest / "d.gguf"
    quantize_file(p.target, t, "q4_0", threads=1)
    quantize_file(p.drafter, d, "q8_0", threads=1)
    return t, d


def _main(target: str, drafter: str, n: int, threads: int) -> None:
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.native.logs import set_log_handler
    from dflash_gguf.kernels.mulmat import Ggml, default_lib_dir
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats

    seen: list[str] = []

    class Grab(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger("kernel-child")
    logger.addHandler(Grab())
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    set_log_handler(logger)
    with Model(target) as tm, Model(drafter) as dm:
        prompt = tm.tokenize(PROMPT)
        opts = ContextOptions(n_ctx=512, n_batch=128, n_ubatch=128, n_threads=threads)
        with Context(tm, opts) as tctx, Context(dm, opts, other=tctx) as dctx:
            plain = list(DFlashDecoder(tctx, None).generate(prompt, n, stop_tokens=[]))
            stats = GenerationStats()
            spec = list(DFlashDecoder(tctx, dctx).generate(prompt, n, stop_tokens=[], stats=stats))
    bufts = sorted(Ggml(default_lib_dir()).extra_bufts())
    placed = {b: sum(f"{b} model buffer size" in m for m in seen) for b in bufts}
    print(json.dumps({"plain": plain, "dflash": spec, "tau": stats.tau, "bufts": bufts, "placed": placed,
                      "isa": _loaded_x86mm_isa()}))


def _loaded_x86mm_isa() -> str | None:
    """The x86 kernels' instruction set in the libggml-cpu this process loaded (the wheel's, or a build
    variant's through LD_LIBRARY_PATH); None where it has no x86 kernels."""
    import ctypes

    try:
        f = ctypes.CDLL("libggml-cpu.so.0").ggml_backend_cpu_x86mm_isa
    except (OSError, AttributeError):
        return None
    f.restype = ctypes.c_char_p
    r = f()
    return r.decode() if r else None


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
