"""ggml's AMX path on x86 (Intel AMX-INT8): detection and a MUL_MAT differential check.

ggml repacks quantized weights into an "AMX" extra buffer type of the CPU backend and multiplies
them with AMX tiles (several rows) or AVX512-VNNI (one row). This module drives that path through
ggml's own C API (ctypes over the libggml that the installed ``llama_cpp`` wheel ships, or any
other build directory) and compares it with the plain CPU path and with an exact float64 product
of the dequantized weights:

    python -m dflash_gguf.amx                       # the default grid, JSON lines, exit 1 on a mismatch
    python -m dflash_gguf.amx --types q4_0 --rows 1-17,32,100 --k 512 --n 96

The AMX buffer type is registered only when ``GGML_CPU_AMX`` allows it (see ``patches/``); the
check sets it before ggml is loaded. A crash in the AMX kernels kills the process, so callers
(tests) run this in a child process.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# enum ggml_type values (ggml/include/ggml.h of the pinned llama.cpp)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q5_k": 13,
              "q6_k": 14, "iq4_xs": 23}
# the types ggml's AMX buffer type claims for MUL_MAT (amx.cpp supports_op) and the block size of
# each along K (ne0 must be a multiple of it)
AMX_TYPES = {"q4_0": 32, "q4_1": 32, "q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256,
             "iq4_xs": 256, "f16": 16}


# types ggml's CPU_REPACK buffer repacks on x86 with AVX2/AVX-512 (ggml-cpu/repack.cpp); the timing
# mode compares AMX with it only for these (others are not placed in that buffer)
REPACKED = {"q4_0", "q4_k", "iq4_nl"}


def cpu_flags() -> set[str]:
    """The CPU feature flags of this Linux machine (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_amx_int8() -> bool:
    flags = cpu_flags()
    return {"amx_int8", "amx_tile", "avx512_vnni"} <= flags


def default_lib_dir() -> Path:
    import importlib.util
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama_cpp is not installed: run `make build`")
    return Path(spec.origin).parent / "lib"


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class Ggml:
    """The few ggml entry points the check needs, bound with ctypes."""

    def __init__(self, lib_dir: Path):
        mode = ctypes.RTLD_GLOBAL
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=mode)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=mode)
        self.ggml = ctypes.CDLL(str(lib_dir / "libggml.so"), mode=mode)
        P, S, I64, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64, ctypes.c_int  # noqa: E741 (ctypes type aliases)
        sig = {
            (self.base, "ggml_init"): (P, [_InitParams]),
            (self.base, "ggml_free"): (None, [P]),
            (self.base, "ggml_new_tensor_2d"): (P, [P, I, I64, I64]),
            (self.base, "ggml_new_tensor_3d"): (P, [P, I, I64, I64, I64]),
            (self.base, "ggml_mul_mat"): (P, [P, P, P]),
            (self.base, "ggml_new_graph"): (P, [P]),
            (self.base, "ggml_build_forward_expand"): (None, [P, P]),
            (self.base, "ggml_tensor_overhead"): (S, []),
            (self.base, "ggml_graph_overhead"): (S, []),
            (self.base, "ggml_nbytes"): (S, [P]),
            (self.base, "ggml_row_size"): (S, [I, I64]),
            (self.base, "ggml_quantize_chunk"): (S, [I, P, P, I64, I64, I64, P]),
            (self.base, "ggml_get_type_traits"): (ctypes.POINTER(_TypeTraits), [I]),
            (self.base, "ggml_backend_alloc_ctx_tensors_from_buft"): (P, [P, P]),
            (self.base, "ggml_backend_buffer_free"): (None, [P]),
            (self.base, "ggml_backend_tensor_set"): (None, [P, P, S, S]),
            (self.base, "ggml_backend_tensor_get"): (None, [P, P, S, S]),
            (self.base, "ggml_backend_graph_compute"): (I, [P, P]),
            (self.base, "ggml_backend_free"): (None, [P]),
            (self.base, "ggml_backend_buft_name"): (ctypes.c_char_p, [P]),
            (self.base, "ggml_backend_reg_get_proc_address"): (P, [P, ctypes.c_char_p]),
            (self.base, "ggml_backend_reg_dev_get"): (P, [P, S]),
            (self.cpu, "ggml_backend_cpu_init"): (P, []),
            (self.cpu, "ggml_backend_cpu_reg"): (P, []),
            (self.cpu, "ggml_backend_cpu_set_n_threads"): (None, [P, I]),
            (self.cpu, "ggml_backend_cpu_buffer_type"): (P, []),
        }
        for (lib, name), (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)

    def extra_bufts(self) -> dict[str, int]:
        reg = self.ggml_backend_cpu_reg()
        dev = self.ggml_backend_reg_dev_get(reg, 0)
        addr = self.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
        if not addr:
            return {}
        fn = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(addr)
        arr = fn(dev)
        out, i = {}, 0
        while arr[i]:
            out[self.ggml_backend_buft_name(arr[i]).decode()] = arr[i]
            i += 1
        return out

    def quantize(self, type_id: int, w: np.ndarray) -> np.ndarray:
        n, k = w.shape
        w = np.ascontiguousarray(w, dtype=np.float32)
        if type_id == GGML_TYPES["f16"]:
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        out = np.zeros(self.ggml_row_size(type_id, k) * n, dtype=np.uint8)
        self.ggml_quantize_chunk(type_id, w.ctypes.data, out.ctypes.data, 0, n, k, None)
        return out

    def dequantize(self, type_id: int, q: np.ndarray, n: int, k: int) -> np.ndarray:
        if type_id == GGML_TYPES["f16"]:
            return q.view(np.float16).astype(np.float32).reshape(n, k)
        traits = self.ggml_get_type_traits(type_id).contents
        out = np.zeros((n, k), dtype=np.float32)
        _TO_FLOAT(traits.to_float)(q.ctypes.data, out.ctypes.data, n * k)
        return out

    def mul_mat(self, backend: int, buft: int, type_id: int, wq: np.ndarray, n: int, k: int,
                x: np.ndarray) -> np.ndarray:
        """dst = x @ W.T computed by ggml with W (n x k, quantized bytes wq) in buffer type buft.

        x: (rows, k) or (batch, rows, k) float32; the result has x's leading shape with n columns.
        """
        x = np.ascontiguousarray(x, dtype=np.float32)
        wctx = self.ggml_init(_InitParams(self.ggml_tensor_overhead() * 4, None, True))
        cctx = self.ggml_init(_InitParams(self.ggml_tensor_overhead() * 8 + self.ggml_graph_overhead(), None, True))
        wbuf = cbuf = None
        try:
            w = self.ggml_new_tensor_2d(wctx, type_id, k, n)
            if x.ndim == 2:
                xt = self.ggml_new_tensor_2d(cctx, GGML_TYPES["f32"], k, x.shape[0])
            else:
                xt = self.ggml_new_tensor_3d(cctx, GGML_TYPES["f32"], k, x.shape[1], x.shape[0])
            y = self.ggml_mul_mat(cctx, w, xt)
            graph = self.ggml_new_graph(cctx)
            self.ggml_build_forward_expand(graph, y)
            wbuf = self.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
            cbuf = self.ggml_backend_alloc_ctx_tensors_from_buft(cctx, self.ggml_backend_cpu_buffer_type())
            if not wbuf or not cbuf:
                raise RuntimeError("ggml could not allocate the test buffers")
            assert self.ggml_nbytes(w) == wq.nbytes, (self.ggml_nbytes(w), wq.nbytes)
            self.ggml_backend_tensor_set(w, wq.ctypes.data, 0, wq.nbytes)
            self.ggml_backend_tensor_set(xt, x.ctypes.data, 0, x.nbytes)
            status = self.ggml_backend_graph_compute(backend, graph)
            if status != 0:
                raise RuntimeError(f"ggml_backend_graph_compute returned {status}")
            out = np.zeros(x.shape[:-1] + (n,), dtype=np.float32)
            self.ggml_backend_tensor_get(y, out.ctypes.data, 0, out.nbytes)
            return out
        finally:
            for b in (wbuf, cbuf):
                if b:
                    self.ggml_backend_buffer_free(b)
            self.ggml_free(cctx)
            self.ggml_free(wctx)


def time_mul_mat(ggml: Ggml, backend: int, buft: int, type_id: int, wq: np.ndarray, n: int, k: int,
                 rows: list[int], repeats: int) -> dict[int, float]:
    """Fastest of ``repeats`` graph computes of one MUL_MAT (weights set once) per row count, seconds."""
    import time

    out = {}
    wctx = ggml.ggml_init(_InitParams(ggml.ggml_tensor_overhead() * 4, None, True))
    w = ggml.ggml_new_tensor_2d(wctx, type_id, k, n)
    wbuf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(wctx, buft)
    ggml.ggml_backend_tensor_set(w, wq.ctypes.data, 0, wq.nbytes)
    rng = np.random.default_rng(1)
    try:
        for m in rows:
            cctx = ggml.ggml_init(_InitParams(ggml.ggml_tensor_overhead() * 8 + ggml.ggml_graph_overhead(), None, True))
            xt = ggml.ggml_new_tensor_2d(cctx, GGML_TYPES["f32"], k, m)
            y = ggml.ggml_mul_mat(cctx, w, xt)
            graph = ggml.ggml_new_graph(cctx)
            ggml.ggml_build_forward_expand(graph, y)
            cbuf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(cctx, ggml.ggml_backend_cpu_buffer_type())
            x = rng.standard_normal((m, k)).astype(np.float32)
            ggml.ggml_backend_tensor_set(xt, x.ctypes.data, 0, x.nbytes)
            ts = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                ggml.ggml_backend_graph_compute(backend, graph)
                ts.append(time.perf_counter() - t0)
            out[m] = min(ts[1:])
            ggml.ggml_backend_buffer_free(cbuf)
            ggml.ggml_free(cctx)
    finally:
        ggml.ggml_backend_buffer_free(wbuf)
        ggml.ggml_free(wctx)
    return out


@dataclass
class CaseResult:
    type: str
    k: int
    n: int
    rows: int
    batch: int
    err_amx: float     # max |AMX - exact| / max |exact|
    err_cpu: float     # max |CPU - exact| / max |exact|
    diff: float        # max |AMX - CPU| / max |exact|
    ok: bool


def tolerance(err_cpu: float) -> float:
    """How far AMX may be from the exact product (relative to max |exact|), given the CPU path's error.

    For the quantized types both paths quantize the activations to the same 8-bit block type (Q8_0,
    Q8_1 or Q8_K) and sum the same integer products; they differ only in the order of the float32
    sums of the block results (measured: |AMX - CPU| <= 5e-7 at K = 512, while each is 7e-3 to 1.2e-2
    from the exact product of the dequantized weights). F16: the CPU path rounds the activations to
    F16 (2.8e-4 from exact), the AMX path keeps them in F32 (2e-7). So AMX must be no further from the
    exact product than the CPU path, plus 1e-4 for float32 summation order at K up to a few
    thousand. A wrong block, row, column or tile shape is off by the size of the values (order 1).
    """
    return err_cpu + 1e-4


def parse_rows(spec: str) -> list[int]:
    rows: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            rows += range(int(a), int(b) + 1)
        elif part:
            rows.append(int(part))
    return rows


def run_grid(ggml: Ggml, types: list[str], rows: list[int], k: int, n: int,
             batch: int, threads: int, seed: int = 0):
    bufts = ggml.extra_bufts()
    if "AMX" not in bufts:
        raise RuntimeError(f"no AMX buffer type in this ggml (extra buffer types: {sorted(bufts)}); "
                           "is GGML_CPU_AMX=1 and the CPU AMX-capable?")
    amx = bufts["AMX"]
    cpu = ggml.ggml_backend_cpu_buffer_type()
    backend = ggml.ggml_backend_cpu_init()
    ggml.ggml_backend_cpu_set_n_threads(backend, threads)
    rng = np.random.default_rng(seed)
    try:
        for name in types:
            t = GGML_TYPES[name]
            w = rng.standard_normal((n, k)).astype(np.float32)
            wq = ggml.quantize(t, w)
            wd = ggml.dequantize(t, wq, n, k).astype(np.float64)
            for m in rows:
                shape = (m, k) if batch == 1 else (batch, m, k)
                x = rng.standard_normal(shape).astype(np.float32)
                exact = x.astype(np.float64) @ wd.T
                y_cpu = ggml.mul_mat(backend, cpu, t, wq, n, k, x)
                y_amx = ggml.mul_mat(backend, amx, t, wq, n, k, x)
                scale = float(np.abs(exact).max()) or 1.0
                err_amx = float(np.abs(y_amx - exact).max()) / scale
                err_cpu = float(np.abs(y_cpu - exact).max()) / scale
                diff = float(np.abs(y_amx - y_cpu).max()) / scale
                ok = bool(np.isfinite(y_amx).all()) and err_amx <= tolerance(err_cpu)
                yield CaseResult(name, k, n, m, batch, err_amx, err_cpu, diff, ok)
    finally:
        ggml.ggml_backend_free(backend)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib-dir", type=Path, default=None, help="directory with libggml*.so (default: the llama_cpp wheel's)")
    ap.add_argument("--types", default=",".join(AMX_TYPES), help="comma-separated ggml types")
    ap.add_argument("--rows", default="1-17,31,32,33,64,100", help="row counts (src1 ne1), e.g. 1-17,32,100")
    ap.add_argument("--k", type=int, default=512, help="inner size, a multiple of 256 for the K-quants (default 512)")
    ap.add_argument("--n", type=int, default=160, help="output columns (a multiple of 32)")
    ap.add_argument("--batch", type=int, default=1, help="src1 ne2 (weights broadcast over it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", type=int, default=0, metavar="REPEATS",
                    help="instead of checking, time one MUL_MAT per row count on each buffer type (fastest of REPEATS)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    os.environ.setdefault("GGML_CPU_AMX", "1")
    if not cpu_has_amx_int8():
        log.error("this CPU has no AMX-INT8 (amx_int8, amx_tile, avx512_vnni in /proc/cpuinfo)")
        return 2
    ggml = Ggml(args.lib_dir or default_lib_dir())
    if "AMX" not in ggml.extra_bufts():
        log.error("this ggml registers no AMX buffer type (built without AMX-INT8, or GGML_CPU_AMX=0)")
        return 3
    types = [t.strip().lower() for t in args.types.split(",") if t.strip()]
    if args.time:
        bufts = {"AMX": ggml.extra_bufts()["AMX"], "CPU": ggml.ggml_backend_cpu_buffer_type()}
        if "CPU_REPACK" in ggml.extra_bufts():
            bufts["CPU_REPACK"] = ggml.extra_bufts()["CPU_REPACK"]
        backend = ggml.ggml_backend_cpu_init()
        ggml.ggml_backend_cpu_set_n_threads(backend, args.threads)
        rng = np.random.default_rng(args.seed)
        for name in types:
            t = GGML_TYPES[name]
            wq = ggml.quantize(t, rng.standard_normal((args.n, args.k)).astype(np.float32))
            for bname, buft in bufts.items():
                if bname == "CPU_REPACK" and name not in REPACKED:
                    continue
                ts = time_mul_mat(ggml, backend, buft, t, wq, args.n, args.k, parse_rows(args.rows), args.time)
                print(json.dumps({"type": name, "k": args.k, "n": args.n, "threads": args.threads, "buft": bname,
                                  "ms": {m: round(v * 1e3, 4) for m, v in ts.items()}}), flush=True)
        ggml.ggml_backend_free(backend)
        return 0
    failed = 0
    for res in run_grid(ggml, types, parse_rows(args.rows), args.k, args.n, args.batch, args.threads, args.seed):
        failed += not res.ok
        print(json.dumps(asdict(res)), flush=True)
    log.info("%s", "all cases match" if not failed else f"{failed} case(s) differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
