"""KleidiAI's matmul kernels called directly, as ggml's KleidiAI code calls them, on random data: for
each kernel family ggml pairs (a one-row decode kernel, a GEMM for batches), every row of an N-row
GEMM against the same row run alone through the decode kernel, and both against a float64 reference.
Run by tests/test_sme2.py and tests/test_arm64.py in the emulated aarch64 CPython, through the exported
``kai_*`` symbols of the wheel's libggml-cpu (only the kernels ggml references are linked in).

Prints one JSON object: per family, whether every batch row equals its one-row result (as float32
values; the sign of an exact zero aside), the largest difference between them, each kernel's error
against the reference (norm of the difference over norm of the reference), and a hash of each output.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
from cffi import FFI

FLT_MAX = float(np.finfo(np.float32).max)

CDEF = """
struct kai_rhs_pack_qs4cxs1s0_param { int8_t lhs_zero_point; uint8_t rhs_zero_point; };
struct kai_rhs_pack_qsi8cx_params { int32_t lhs_zero_point; float scale_multiplier; };
"""
# packers: (size function's arguments, run function's arguments)
Q4_LHS = ("size_t {0}(size_t m, size_t k, size_t bl, size_t mr, size_t kr, size_t sr);",
          "void {0}(size_t m, size_t k, size_t bl, size_t mr, size_t kr, size_t sr, size_t m_idx_start, "
          "const float* lhs, size_t lhs_stride, void* lhs_packed);")
Q8_LHS = ("size_t {0}(size_t m, size_t k, size_t mr, size_t kr, size_t sr);",
          "void {0}(size_t m, size_t k, size_t mr, size_t kr, size_t sr, size_t m_idx_start, "
          "const float* lhs, size_t lhs_stride, void* lhs_packed);")
Q4_RHS = ("size_t {0}(size_t n, size_t k, size_t nr, size_t kr, size_t bl);",
          "void {0}(size_t num_groups, size_t n, size_t k, size_t nr, size_t kr, size_t sr, size_t bl, "
          "const uint8_t* rhs, const float* bias, void* rhs_packed, size_t extra_bytes, "
          "const struct kai_rhs_pack_qs4cxs1s0_param* params);")
Q8_RHS = ("size_t {0}(size_t n, size_t k, size_t nr, size_t kr, size_t sr);",
          "void {0}(size_t num_groups, size_t n, size_t k, size_t nr, size_t kr, size_t sr, const int8_t* rhs, "
          "const float* bias, const float* scale, void* rhs_packed, size_t extra_bytes, "
          "const struct kai_rhs_pack_qsi8cx_params* params);")
Q4_RUN = ("void {0}(size_t m, size_t n, size_t k, size_t bl, const void* lhs_packed, const void* rhs_packed, "
          "float* dst, size_t dst_stride_row, size_t dst_stride_col, float scalar_min, float scalar_max);")
Q8_RUN = ("void {0}(size_t m, size_t n, size_t k, const void* lhs_packed, const void* rhs_packed, "
          "float* dst, size_t dst_stride_row, size_t dst_stride_col, float scalar_min, float scalar_max);")

# the pairs of ggml's kernel table (ggml-cpu/kleidiai/kernels.cpp with the patch series):
# (weights, decode kernel, its activation packer, GEMM, its activation packer, weight packer)
FAMILIES = {
    "q4_0-sme2": ("q4_0", "qsi8d32p1x4_qsi4c32p4vlx4_1x4vl_sme2_sdot", "qsi8d32p_f32_neon",
                  "qsi8d32p1vlx4_qsi4c32p4vlx4_1vlx4vl_sme2_mopa", "qsi8d32p_f32_neon",
                  "nxk_qsi4c32ps1s0scalef16_qsu4c32s16s0_neon"),
    "q4_0-i8mm": ("q4_0", "qsi8d32p1x8_qsi4c32p4x8_1x4x32_neon_dotprod", "qsi8d32p_f32",
                  "qsi8d32p4x8_qsi4c32p4x8_16x4_neon_i8mm", "qsi8d32p4x8sb_f32_neon",
                  "nxk_qsi4c32pscalef16_qsu4c32s16s0"),
    "q4_0-dotprod": ("q4_0", "qsi8d32p1x4_qsi4c32p4x4_1x4_neon_dotprod", "qsi8d32p_f32",
                     "qsi8d32p4x4_qsi4c32p4x4_16x4_neon_dotprod", "qsi8d32p_f32",
                     "nxk_qsi4c32pscalef16_qsu4c32s16s0"),
    "q8_0-sme2": ("q8_0", "qai8dxp1x4_qsi8cxp4vlx4_1x4vl_sme2_dot", "qai8dxp_f32",
                  "qai8dxp1vlx4_qsi8cxp4vlx4_1vlx4vl_sme2_mopa", "qai8dxp_f32", "nxk_qsi8cxp_qsi8cx_neon"),
    "q8_0-sme": ("q8_0", "qai8dxp1x4_qsi8cxp4vlx4_1x4vl_sme_dot", "qai8dxp_f32",
                 "qai8dxp1vlx4_qsi8cxp4vlx4_1vlx4vl_sme_mopa", "qai8dxp_f32", "nxk_qsi8cxp_qsi8cx_neon"),
    "q8_0-i8mm": ("q8_0", "qai8dxp1x8_qsi8cxp4x8_1x4_neon_dotprod", "qai8dxp_f32",
                  "qai8dxp4x8_qsi8cxp4x8_16x4_neon_i8mm", "qai8dxp_f32", "nxk_qsi8cxp_qsi8cx_neon"),
    "q8_0-dotprod": ("q8_0", "qai8dxp1x4_qsi8cxp4x4_1x4_neon_dotprod", "qai8dxp_f32",
                     "qai8dxp4x4_qsi8cxp4x4_16x4_neon_dotprod", "qai8dxp_f32", "nxk_qsi8cxp_qsi8cx_neon"),
}


def libggml_cpu() -> Path:
    spec = importlib.util.find_spec("llama_cpp")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return next(lib.glob("libggml-cpu.so*"))


class Kai:
    """The exported kai_* functions of libggml-cpu, declared on first use."""

    def __init__(self, path: Path):
        self.ffi = FFI()
        self.ffi.cdef(CDEF)
        self.path = path
        self.lib = None
        self.decls: list[str] = []

    def declare(self, template: str, name: str) -> None:
        self.decls.append(template.format(name))

    def load(self):
        self.ffi.cdef("\n".join(self.decls))
        self.lib = self.ffi.dlopen(str(self.path))

    def has(self, name: str) -> bool:
        try:
            getattr(self.lib, name)
            return True
        except AttributeError:
            return False


def _q4_0_weights(rng, n: int, k: int) -> tuple[bytes, np.ndarray]:
    """ggml Q4_0 rows (per 32 values an f16 scale, then 16 bytes of nibbles: value j in the low nibble
    of byte j, value j + 16 in the high one) and their float64 values."""
    nb = k // 32
    d = (rng.standard_normal((n, nb)) * 0.02).astype(np.float16)
    q = rng.integers(0, 16, size=(n, nb, 32), dtype=np.uint8)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([d.reshape(n, nb, 1).view(np.uint8).reshape(n, nb, 2), qs], axis=2)
    w = (q.astype(np.float64) - 8.0) * d.astype(np.float64)[:, :, None]
    return raw.tobytes(), w.reshape(n, k)


def _q8_weights(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row int8 weights and scales, the form ggml's KleidiAI code repacks Q8_0 into."""
    q = rng.integers(-127, 128, size=(n, k), dtype=np.int8)
    s = (rng.random(n) * 0.01 + 0.001).astype(np.float32)
    return q, s, q.astype(np.float64) * s.astype(np.float64)[:, None]


def run_family(kai: Kai, fam: str, m: int, n: int, k: int, seed: int) -> dict:
    wtype, gemv, gemv_lhs, gemm, gemm_lhs, rhs_pack = FAMILIES[fam]
    q4 = wtype == "q4_0"
    lib, ffi = kai.lib, kai.ffi
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bl = 32

    def geom(kernel: str) -> tuple[int, int, int, int]:
        return tuple(int(getattr(lib, f"kai_get_{p}_matmul_clamp_f32_{kernel}")()) for p in ("mr", "nr", "kr", "sr"))

    mr_v, nr, kr, sr = geom(gemv)
    mr_m, nr_m, kr_m, sr_m = geom(gemm)
    assert (nr, kr, sr) == (nr_m, kr_m, sr_m), f"{fam}: the two kernels want other weight layouts"

    size_rhs = getattr(lib, f"kai_get_rhs_packed_size_rhs_pack_{rhs_pack}")
    pack_rhs = getattr(lib, f"kai_run_rhs_pack_{rhs_pack}")
    if q4:
        raw, w = _q4_0_weights(rng, n, k)
        rhs = ffi.new("uint8_t[]", size_rhs(n, k, nr, kr, bl))
        params = ffi.new("struct kai_rhs_pack_qs4cxs1s0_param *", {"lhs_zero_point": 1, "rhs_zero_point": 8})
        pack_rhs(1, n, k, nr, kr, sr, bl, ffi.from_buffer("uint8_t[]", raw), ffi.NULL, rhs, 0, params)
    else:
        q, s, w = _q8_weights(rng, n, k)
        rhs = ffi.new("uint8_t[]", size_rhs(n, k, nr, kr, sr))
        params = ffi.new("struct kai_rhs_pack_qsi8cx_params *", {"lhs_zero_point": 1, "scale_multiplier": 1.0})
        pack_rhs(1, n, k, nr, kr, sr, ffi.from_buffer("int8_t[]", q), ffi.NULL, ffi.from_buffer("float[]", s),
                 rhs, 0, params)

    def run(kernel: str, packer: str, mr: int, rows: np.ndarray) -> np.ndarray:
        mm = rows.shape[0]
        size = getattr(lib, f"kai_get_lhs_packed_size_lhs_quant_pack_{packer}")
        pack = getattr(lib, f"kai_run_lhs_quant_pack_{packer}")
        src = ffi.from_buffer("float[]", np.ascontiguousarray(rows))
        if q4:
            lhs = ffi.new("uint8_t[]", size(mm, k, bl, mr, kr, sr))
            pack(mm, k, bl, mr, kr, sr, 0, src, k * 4, lhs)
        else:
            lhs = ffi.new("uint8_t[]", size(mm, k, mr, kr, sr))
            pack(mm, k, mr, kr, sr, 0, src, k * 4, lhs)
        out = np.zeros((mm, n), dtype=np.float32)
        dst = ffi.from_buffer("float[]", out)
        fn = getattr(lib, f"kai_run_matmul_clamp_f32_{kernel}")
        if q4:
            fn(mm, n, k, bl, lhs, rhs, dst, n * 4, 4, -FLT_MAX, FLT_MAX)
        else:
            fn(mm, n, k, lhs, rhs, dst, n * 4, 4, -FLT_MAX, FLT_MAX)
        return out

    one = np.concatenate([run(gemv, gemv_lhs, mr_v, x[i:i + 1]) for i in range(m)])
    batch = run(gemm, gemm_lhs, mr_m, x)
    ref = x.astype(np.float64) @ w.T

    def err(a):
        return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))

    rows_equal = [bool(np.array_equal(one[i], batch[i])) for i in range(m)]
    return {"decode": gemv, "gemm": gemm, "rows_equal": all(rows_equal), "rows_differing": rows_equal.count(False),
            "max_abs_diff": float(np.max(np.abs(one - batch))), "decode_err": err(one), "gemm_err": err(batch),
            "decode_sha": hashlib.sha256(one.tobytes()).hexdigest()[:16],
            "gemm_sha": hashlib.sha256(batch.tobytes()).hexdigest()[:16]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated: " + ", ".join(FAMILIES))
    ap.add_argument("--m", type=int, default=16, help="rows of the batch")
    ap.add_argument("--n", type=int, default=200, help="output columns (not a multiple of the kernels' step)")
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    fams = [f for f in a.families.split(",") if f]
    kai = Kai(libggml_cpu())
    for f in fams:
        wtype, gemv, gemv_lhs, gemm, gemm_lhs, rhs_pack = FAMILIES[f]
        q4 = wtype == "q4_0"
        for kern in (gemv, gemm):
            kai.declare(Q4_RUN if q4 else Q8_RUN, f"kai_run_matmul_clamp_f32_{kern}")
            for p in ("mr", "nr", "kr", "sr"):
                kai.declare("size_t {0}(void);", f"kai_get_{p}_matmul_clamp_f32_{kern}")
        for packer in {gemv_lhs, gemm_lhs}:
            size, run = Q4_LHS if q4 else Q8_LHS
            kai.declare(size, f"kai_get_lhs_packed_size_lhs_quant_pack_{packer}")
            kai.declare(run, f"kai_run_lhs_quant_pack_{packer}")
        size, run = Q4_RHS if q4 else Q8_RHS
        kai.declare(size, f"kai_get_rhs_packed_size_rhs_pack_{rhs_pack}")
        kai.declare(run, f"kai_run_rhs_pack_{rhs_pack}")
    kai.decls = sorted(set(kai.decls))
    kai.load()
    out = {}
    for f in fams:
        _, gemv, _, gemm, _, _ = FAMILIES[f]
        missing = [kern for kern in (gemv, gemm) if not kai.has(f"kai_run_matmul_clamp_f32_{kern}")]
        out[f] = {"missing": missing} if missing else run_family(kai, f, a.m, a.n, a.k, a.seed)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
