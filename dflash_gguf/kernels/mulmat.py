"""MUL_MAT through one of ggml's CPU buffer types, checked against the plain CPU path and the exact product.

ggml repacks weights into "extra" buffer types of its CPU backend (AMX, CPU_X86MM, CPU_REPACK) and
multiplies them with their own kernels. This module drives one such path through ggml's C API
(ctypes over the libggml that the installed ``llama_cpp`` wheel ships, or any build directory) and
compares each result with the plain CPU path (ggml's reference kernels for the same quantized
weights) and with an exact float64 product of the dequantized weights:

    python -m dflash_gguf.kernels.mulmat --buft CPU_X86MM                 # default grid, JSON lines, exit 1 on a mismatch
    python -m dflash_gguf.kernels.mulmat --buft CPU_X86MM --types q4_0 --rows 1-33 --k 2048 --n 96
    python -m dflash_gguf.kernels.mulmat --buft CPU_X86MM --time 20 --k 2048 --n 6144 --rows 1,2,4,8,16
    python -m dflash_gguf.kernels.mulmat --buft CPU_X86MM --extreme      # the largest integer sums a kernel can meet

``--extreme`` writes every weight at its type's largest quant (and largest scales) and makes every
activation row one constant, positive or negative, so that each int8 activation is +-127: the
kernels' int16 and int32 partial sums reach their bounds (an overflow there gives a wrong result, where
random data, with its sums near zero, would pass).

Exit codes: 0 all cases match, 1 a case differs, 3 the buffer type is not registered in that ggml.
A crash in a kernel kills the process, so callers (tests) run this in a child process.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# enum ggml_type values (ggml/include/ggml.h of the pinned llama.cpp)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q5_k": 13,
              "q6_k": 14, "iq4_xs": 23}
# block size of each type along K (ne0 must be a multiple of it)
BLOCK_K = {"f16": 16, "q4_0": 32, "q4_1": 32, "q8_0": 32, "q4_k": 256, "q5_k": 256, "q6_k": 256,
           "iq4_xs": 256}
# the weight types each extra buffer type claims for MUL_MAT
BUFT_TYPES = {
    "AMX": ("q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "f16"),     # amx.cpp supports_op
    "CPU_X86MM": ("q4_0", "q8_0", "q4_k", "q6_k"),                                 # patches/0014
    "CPU_REPACK": ("q4_0", "q4_k"),                                                 # repack.cpp on x86
}
# buffer types whose rows do not depend on the batch: a row computed alone gives the same bits
# (CPU_X86MM: the same integer sums and float order for every row count). AMX does not have this
# property (one row: AVX512-VNNI; several: AMX tiles).
ROW_EXACT_BUFTS = {"CPU_X86MM"}


def claimed_types(ggml: "Ggml", buft: str) -> list[str]:
    """The weight types ``buft`` takes with this ggml on this CPU: BUFT_TYPES, less Q8_0 for CPU_X86MM on
    its AVX2 path without VNNI (Q8_0's u8 = q + 128 would saturate VPMADDUBSW's int16 pairs: ggml keeps it)."""
    types = list(BUFT_TYPES.get(buft, ()))
    if buft == "CPU_X86MM":
        f = getattr(ggml.cpu, "ggml_backend_cpu_x86mm_isa", None)
        if f is not None:
            f.restype = ctypes.c_char_p
            isa = f()
            if isa is not None and isa.decode() == "AVX2":
                types.remove("q8_0")
    return types


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
    """The few ggml entry points the checks need (MUL_MAT here, FLASH_ATTN_EXT in
    :mod:`dflash_gguf.kernels.fattn`), bound with ctypes."""

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
            (self.base, "ggml_new_tensor_4d"): (P, [P, I, I64, I64, I64, I64]),
            (self.base, "ggml_mul_mat"): (P, [P, P, P]),
            (self.base, "ggml_flash_attn_ext"): (P, [P, P, P, P, P, ctypes.c_float, ctypes.c_float, ctypes.c_float]),
            (self.base, "ggml_flash_attn_ext_set_prec"): (None, [P, I]),
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
    buft: str
    type: str
    k: int
    n: int
    rows: int
    batch: int
    err: float         # max |buffer type's result - exact| / max |exact|
    err_cpu: float     # max |plain CPU path - exact| / max |exact|
    diff: float        # max |buffer type's result - CPU| / max |exact|
    diff_ok: bool      # CPU_X86MM Q4_0/Q8_0: |x - CPU| within q0_scale_bound everywhere (else True)
    rows_exact: bool   # each row equals that row computed alone (a row does not depend on the batch)
    ok: bool


def tolerance(buft: str, type_name: str, err_cpu: float) -> float:
    """Bound on err (relative to max |exact|) for one case.

    A wrong block, row, column, tile shape or offset is off by the size of the values (order 1), so
    the bound only has to sit above each path's rounding. AMX and the K-quants of CPU_X86MM quantize
    the activations exactly as ggml's plain path does (Q8_1 / Q8_K, float scales) and sum the same
    integer products; only the float32 order of the block sums differs (measured |x - CPU| <= 5e-7
    at K = 512, while each is 5e-3 to 1.2e-2 from the exact product). F16 on AMX keeps F32
    activations where the CPU path rounds them to F16. So: as close to exact as the CPU path plus
    1e-4. Q4_0 and Q8_0 on CPU_X86MM are bounded against the CPU path block by block instead
    (:func:`q0_scale_bound`), and may be no further from exact than 1.1x the CPU path plus 1e-4.
    """
    if buft == "CPU_X86MM" and type_name in ("q4_0", "q8_0"):
        return err_cpu * 1.1 + 1e-4
    return err_cpu + 1e-4


def q0_scale_bound(x: np.ndarray, wd: np.ndarray, block: int = 32) -> np.ndarray:
    """Per output, how far CPU_X86MM's Q4_0/Q8_0 result may be from ggml's plain path.

    Both quantize each activation block to the same int8 values with the same scale d; ggml's Q8_0
    activations then store d as float16 (relative error <= 2^-11) while CPU_X86MM keeps it in float32.
    Each output is a sum over blocks b of d_b * (integer block dot); rounding d_b moves it by at most
    2^-11 * |block b's term|. Bound: 2^-10 * sum_b |sum_{k in b} x_k w_k| (twice that, for the
    float32 sums of both paths), computed exactly from the dequantized weights.
    """
    xb = x.reshape(-1, x.shape[-1] // block, block).astype(np.float64)
    wb = wd.reshape(wd.shape[0], -1, block)
    terms = np.abs(np.einsum("mbk,nbk->mnb", xb, wb)).sum(axis=-1)
    return (2.0 ** -10) * terms.reshape(x.shape[:-1] + (wd.shape[0],))


def parse_rows(spec: str) -> list[int]:
    rows: list[int] = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            rows += range(int(a), int(b) + 1)
        elif part:
            rows.append(int(part))
    return rows


@contextlib.contextmanager
def cpu_backend(ggml: Ggml, threads: int):
    """ggml's CPU backend with ``threads`` threads, freed on exit."""
    backend = ggml.ggml_backend_cpu_init()
    ggml.ggml_backend_cpu_set_n_threads(backend, threads)
    try:
        yield backend
    finally:
        ggml.ggml_backend_free(backend)


def extreme_weights(ggml: Ggml, name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Quantized bytes of an n x k weight with every quant at its type's largest value (Q4_0 / Q4_K
    nibbles 15, Q6_K 63, Q8_0 127) and the K-quants' sub-block scales and mins at their largest (Q4_K
    63, Q6_K 127), with small random positive fp16 block scales (so results stay finite)."""
    layout = {  # one block: (its bytes, byte fills (offset, length, byte) of quants and scales, fp16 scale offsets)
        "q4_0": (18, [(2, 16, 0xFF)], [0]),
        "q8_0": (34, [(2, 32, 0x7F)], [0]),
        "q4_k": (144, [(4, 12, 0xFF), (16, 128, 0xFF)], [0, 2]),        # d, dmin, 6-bit scales/mins, nibbles
        "q6_k": (210, [(0, 192, 0xFF), (192, 16, 0x7F)], [208]),        # ql, qh, int8 scales, d
    }
    if name not in layout:
        raise ValueError(f"no extreme pattern for {name} (have: {', '.join(layout)})")
    size, fills, halves = layout[name]
    nblocks = n * k // BLOCK_K[name]
    assert ggml.ggml_row_size(GGML_TYPES[name], k) * n == nblocks * size
    blocks = np.zeros((nblocks, size), dtype=np.uint8)
    for off, length, byte in fills:
        blocks[:, off:off + length] = byte
    for off in halves:
        d = rng.uniform(2**-12, 2**-10, nblocks).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def run_grid(ggml: Ggml, buft_name: str, types: list[str], rows: list[int], k: int, n: int,
             batch: int, threads: int, seed: int = 0, extreme: bool = False):
    """One CaseResult per (type, row count); raises if the buffer type is not registered. ``extreme``:
    the weights of extreme_weights and activation rows that are each one constant of alternating sign."""
    bufts = ggml.extra_bufts()
    if buft_name not in bufts:
        raise RuntimeError(f"no {buft_name} buffer type in this ggml (extra buffer types: {sorted(bufts)})")
    buft = bufts[buft_name]
    cpu = ggml.ggml_backend_cpu_buffer_type()
    rng = np.random.default_rng(seed)
    with cpu_backend(ggml, threads) as backend:
        for name in types:
            t = GGML_TYPES[name]
            if extreme:
                wq = extreme_weights(ggml, name, n, k, rng)
            else:
                wq = ggml.quantize(t, rng.standard_normal((n, k)).astype(np.float32))
            wd = ggml.dequantize(t, wq, n, k).astype(np.float64)
            for m in rows:
                shape = (m, k) if batch == 1 else (batch, m, k)
                if extreme:
                    sign = np.where(np.arange(batch * m) % 2 == 0, 1.0, -1.0).reshape(shape[:-1] + (1,))
                    x = np.broadcast_to(sign * 0.75, shape).astype(np.float32)
                else:
                    x = rng.standard_normal(shape).astype(np.float32)
                exact = x.astype(np.float64) @ wd.T
                y_cpu = ggml.mul_mat(backend, cpu, t, wq, n, k, x)
                y = ggml.mul_mat(backend, buft, t, wq, n, k, x)
                flat_x, flat_y = x.reshape(-1, k), y.reshape(-1, n)
                # a row alone (first, middle, last) gives the same bits as inside the batch
                probe = sorted({0, len(flat_x) // 2, len(flat_x) - 1})
                rows_exact = all(np.array_equal(ggml.mul_mat(backend, buft, t, wq, n, k, flat_x[i:i + 1])[0],
                                                flat_y[i]) for i in probe)
                scale = float(np.abs(exact).max()) or 1.0
                err = float(np.abs(y - exact).max()) / scale
                err_cpu = float(np.abs(y_cpu - exact).max()) / scale
                diff = float(np.abs(y - y_cpu).max()) / scale
                diff_ok = True
                if buft_name == "CPU_X86MM" and name in ("q4_0", "q8_0"):
                    diff_ok = bool((np.abs(y.astype(np.float64) - y_cpu) <= q0_scale_bound(x, wd) + 1e-6 * scale).all())
                ok = (bool(np.isfinite(y).all()) and err <= tolerance(buft_name, name, err_cpu) and diff_ok
                      and (rows_exact or buft_name not in ROW_EXACT_BUFTS))
                yield CaseResult(buft_name, name, k, n, m, batch, err, err_cpu, diff, diff_ok, rows_exact, ok)


def time_bufts(ggml: Ggml, bufts: dict[str, int], types: list[str], k: int, n: int, rows: list[int],
               repeats: int, threads: int, seed: int = 0):
    """Yield one timing record per (type, buffer type that claims it): fastest MUL_MAT per row count, ms."""
    rng = np.random.default_rng(seed)
    with cpu_backend(ggml, threads) as backend:
        for name in types:
            t = GGML_TYPES[name]
            wq = ggml.quantize(t, rng.standard_normal((n, k)).astype(np.float32))
            for bname, buft in bufts.items():
                if bname != "CPU" and name not in BUFT_TYPES.get(bname, ()):
                    continue
                ts = time_mul_mat(ggml, backend, buft, t, wq, n, k, rows, repeats)
                yield {"type": name, "k": k, "n": n, "threads": threads, "buft": bname,
                       "ms": {m: round(v * 1e3, 4) for m, v in ts.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buft", default="CPU_X86MM", help="the extra buffer type to check (CPU_X86MM, AMX, CPU_REPACK)")
    ap.add_argument("--lib-dir", type=Path, default=None, help="directory with libggml*.so (default: the llama_cpp wheel's)")
    ap.add_argument("--types", default=None, help="comma-separated ggml types (default: every type the buffer type claims)")
    ap.add_argument("--rows", default="1-17,31,32,33,64,100", help="row counts (src1 ne1), e.g. 1-17,32,100")
    ap.add_argument("--k", type=int, default=512, help="inner size, a multiple of 256 for the K-quants (default 512)")
    ap.add_argument("--n", type=int, default=160, help="output columns (a multiple of 32)")
    ap.add_argument("--batch", type=int, default=1, help="src1 ne2 (weights broadcast over it)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extreme", action="store_true",
                    help="weights at their largest quants and scales, activation rows of one constant each "
                         "(the kernels' partial sums at their bounds) instead of random data")
    ap.add_argument("--time", type=int, default=0, metavar="REPEATS",
                    help="instead of checking, time one MUL_MAT per row count on this buffer type, every other "
                         "extra one that claims the type (AMX, CPU_REPACK) and the plain CPU path (fastest of REPEATS)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ggml = Ggml(args.lib_dir or default_lib_dir())
    extra = ggml.extra_bufts()
    if args.buft not in extra:
        log.error("this ggml registers no %s buffer type (it has: %s)", args.buft, ", ".join(sorted(extra)) or "none")
        return 3
    claimed = claimed_types(ggml, args.buft)
    types = ([t.strip().lower() for t in args.types.split(",") if t.strip()] if args.types else claimed)
    unclaimed = [t for t in types if t not in claimed and args.buft in BUFT_TYPES]
    if unclaimed and not args.time:
        log.error("%s takes no %s weights with this ggml on this CPU (it takes: %s)", args.buft,
                  ", ".join(unclaimed), ", ".join(claimed))
        return 2
    if args.time:
        # this buffer type, then every other extra one that claims a type (AMX beside CPU_X86MM on a
        # CPU with AMX), then the plain CPU path
        bufts = {args.buft: extra[args.buft], **{b: extra[b] for b in BUFT_TYPES if b in extra and b != args.buft},
                 "CPU": ggml.ggml_backend_cpu_buffer_type()}
        for rec in time_bufts(ggml, bufts, types, args.k, args.n, parse_rows(args.rows), args.time, args.threads, args.seed):
            print(json.dumps(rec), flush=True)
        return 0
    return report(run_grid(ggml, args.buft, types, parse_rows(args.rows), args.k, args.n, args.batch, args.threads,
                           args.seed, extreme=args.extreme))


def report(cases) -> int:
    """Print each case (a dataclass with ``ok``) as a JSON line as it finishes; the exit code: 1 if one
    differs, else 0."""
    failed = 0
    for res in cases:
        failed += not res.ok
        print(json.dumps(asdict(res)), flush=True)
    log.info("%s", "all cases match" if not failed else f"{failed} case(s) differ")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
