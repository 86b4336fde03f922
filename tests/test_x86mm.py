"""The x86 small-batch MUL_MAT kernels (patches/0014, buffer type CPU_X86MM) against ggml's own paths.

MUL_MAT through CPU_X86MM is compared with ggml's plain CPU path (its reference kernels for the same
quantized weights) and with the exact float64 product of the dequantized weights, for every weight
type the kernels take, every row count a DFlash step verifies (1..17), tile edges (24, 31-33) and
prompt batches, on one and two threads, with src1 batches; a row computed alone must give the same
bits as inside any batch. The extreme grid (``mulmat --extreme``: every quant and scale at its
largest, activations at +-127) drives the kernels' int16 and int32 sums to their bounds, where an
overflow shows (random data keeps them near zero). The same grids run on the AVX2 build variant (no
AVX-512: the 256-bit VPMADDUBSW path with int16 sums, patches/0025) and, on a CPU with AVX-VNNI, on
the AVX-VNNI variant (256-bit VPDPBUSD, Q8_0 included). End to end, greedy DFlash equals plain
decoding with the kernels on and off, and with the AVX-VNNI variant's libraries.

Everything runs in child processes: a fault in a kernel must fail a test, not kill the run, and
``GGML_CPU_X86MM`` only takes effect when ggml is loaded. Skipped, with the reason, on a CPU without
AVX2/FMA/F16C; on a CPU with them, an installed ggml without the buffer type fails. On a CPU with AVX2
and no VNNI (AVX-512 VNNI or AVX-VNNI) the native build's kernels claim Q8_0 no more than the AVX2 variant
does: the native grid leaves it out there and the Q8_0 pair must place none of its weights in them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernel_child

from dflash_gguf import paths
from dflash_gguf.kernels.cpu import cpu_flags
from dflash_gguf.kernels.mulmat import BUFT_TYPES, default_lib_dir

FLAGS = cpu_flags()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= FLAGS,
                                 reason="this CPU has no AVX2+FMA+F16C (/proc/cpuinfo): the x86 kernels are not built")]

ROOT = Path(__file__).resolve().parents[1]
DEMO = paths.DEMO_DIR
TYPES = BUFT_TYPES["CPU_X86MM"]
# 1..17: every verify of a block of 16 plus the pending token; 24, 31-33: tile and group edges; 64, 100: prompts
ROWS = "1-17,24,31,32,33,64,100"
N_ROWS = 17 + 6
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS
AVX_VNNI = "avx_vnni" in FLAGS


# the grid drives CPU_X86MM directly; the plain CPU path it is checked against is ggml's without AMX
GRID_ENV = {"GGML_CPU_AMX": "0", "GGML_CPU_X86MM": None}


def _grid(extra: list[str], lib_dir: Path | None = None) -> list[dict]:
    args = ["-m", "dflash_gguf.kernels.mulmat", "--buft", "CPU_X86MM", *extra]
    if lib_dir is not None:
        args += ["--lib-dir", str(lib_dir)]
    p = kernel_child.python(args, GRID_ENV)
    if p.returncode == 3:
        pytest.fail("this CPU has AVX2+FMA+F16C but ggml registers no CPU_X86MM buffer type: the build lost "
                    f"patches/0014 (rebuild with `make build FORCE=1`)\n{p.stderr[-2000:]}")
    cases = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode not in (0, 1):
        pytest.fail(f"MUL_MAT through CPU_X86MM: {kernel_child.died(p)}\nlast case that finished: {cases[-1] if cases else None}")
    return cases


def _bad(cases: list[dict]) -> list[str]:
    return [f"{c['type']} k={c['k']} n={c['n']} rows={c['rows']} batch={c['batch']}: error {c['err']:.3g} "
            f"(CPU path {c['err_cpu']:.3g}), |x86mm - CPU| {c['diff']:.3g}, row alone == row in batch: "
            f"{c['rows_exact']}" for c in cases if not c["ok"]]


@pytest.fixture(scope="module")
def native_types() -> list[str]:
    """The types the installed build's kernels claim on this CPU (``mulmat.claimed_types``, asked in a
    child): all four, except on AVX2 without VNNI, where Q8_0 stays on ggml's kernels."""
    code = ("from dflash_gguf.kernels.mulmat import Ggml, claimed_types, default_lib_dir; "
            "print(','.join(claimed_types(Ggml(default_lib_dir()), 'CPU_X86MM')))")
    p = kernel_child.python(["-c", code], {}, timeout=60)
    assert p.returncode == 0, p.stderr
    types = p.stdout.strip().splitlines()[-1].split(",")
    assert types == (["q4_0", "q4_k", "q6_k"] if _isa(default_lib_dir()) == "AVX2" else list(TYPES)), types
    return types


def _native_grid(types: list[str], extra: list[str]) -> list[dict]:
    return _grid(["--types", ",".join(types), *extra])


def test_every_type_and_row_count(native_types):
    cases = _native_grid(native_types, ["--rows", ROWS, "--k", "512", "--n", "160", "--threads", "2"])
    assert len(cases) == len(native_types) * N_ROWS
    assert not _bad(cases), "\n".join(_bad(cases))
    assert all(c["rows_exact"] for c in cases)


def test_one_thread_wide_k_and_many_groups(native_types):
    """K = 2048 (the 1.7B shape's hidden size), 1008 output rows (63 groups of 16, 126 of 8), one thread."""
    cases = _native_grid(native_types, ["--rows", "1,2,3,8,16,17", "--k", "2048", "--n", "1008", "--threads", "1"])
    assert len(cases) == len(native_types) * 6 and not _bad(cases), "\n".join(_bad(cases))


def test_the_largest_sums_do_not_overflow(native_types):
    """Every weight at its largest quant and scales, activation rows of one constant each (+-127 after
    quantization): the AVX2 path's int16 block sums (patches/0025) and every path's int32 sums at their
    bounds, row counts across the tile sizes (8 with AVX2, 16 with AVX-512)."""
    cases = _native_grid(native_types, ["--extreme", "--rows", "1,2,7,8,9,16,17,33", "--k", "1024", "--n", "64"])
    assert len(cases) == len(native_types) * 8 and not _bad(cases), "\n".join(_bad(cases))


def test_src1_batches_broadcast_over_one_weight(native_types):
    cases = _native_grid(native_types, ["--rows", "1,2,9,17", "--batch", "3", "--n", "64"])
    assert len(cases) == len(native_types) * 4 and not _bad(cases), "\n".join(_bad(cases))


def _isa(lib_dir: Path) -> str:
    """The instruction set a libggml-cpu.so's kernels were built for, asked in a child process."""
    code = ("import ctypes,sys; base=ctypes.CDLL(sys.argv[1]+'/libggml-base.so', mode=ctypes.RTLD_GLOBAL); "
            "cpu=ctypes.CDLL(sys.argv[1]+'/libggml-cpu.so'); f=cpu.ggml_backend_cpu_x86mm_isa; "
            "f.restype=ctypes.c_char_p; r=f(); print(r.decode() if r else '')")
    p = kernel_child.python(["-c", code, str(lib_dir)], {}, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_the_native_build_takes_the_widest_path():
    isa = _isa(default_lib_dir())
    assert isa == ("AVX512-VNNI" if AVX512 else isa) and isa in ("AVX512-VNNI", "AVX512VL-VNNI", "AVX-VNNI", "AVX2")


def _variant(name: str, where: str = "") -> Path:
    """A ggml build variant's library folder, or a skip saying how to build it."""
    d = paths.ggml_variant_dir(name)
    if d is None:
        pytest.skip(f"no {name} build variant in the build cache (`make test` builds it{where}: "
                    f"python -m dflash_gguf.build --ggml-variant {name})")
    return d


@pytest.fixture(scope="module")
def avx2_lib() -> Path:
    return _variant("avx2")


def test_avx2_variant_every_type_and_row_count(avx2_lib):
    """The 256-bit path (8-row groups and tiles, VPMADDUBSW sums added in int16). Q8_0 is not claimed
    there (its u8 = q + 128 would saturate VPMADDUBSW's int16 pairs), so ggml keeps it."""
    assert _isa(avx2_lib) == "AVX2"
    cases = _grid(["--types", "q4_0,q4_k,q6_k", "--rows", "1-9,16,17,33", "--k", "512", "--n", "136"], avx2_lib)
    assert len(cases) == 3 * 12 and not _bad(cases), "\n".join(_bad(cases))
    assert all(c["rows_exact"] for c in cases)
    extreme = _grid(["--extreme", "--types", "q4_0,q4_k,q6_k", "--rows", "1,8,9,17", "--k", "1024", "--n", "64"],
                    avx2_lib)
    assert len(extreme) == 3 * 4 and not _bad(extreme), "\n".join(_bad(extreme))


@pytest.fixture(scope="module")
def avxvnni_lib() -> Path:
    if not AVX_VNNI:
        pytest.skip("this CPU has no AVX-VNNI (no avx_vnni in /proc/cpuinfo; Intel Alder Lake and later and AMD "
                    "Zen 5 have it): the kernels' AVX-VNNI path cannot run here")
    return _variant("avxvnni", " on a CPU with AVX-VNNI")


def test_avx_vnni_variant_every_type_and_row_count(avxvnni_lib):
    """The 256-bit VPDPBUSD path (VEX-encoded AVX-VNNI; 8-row groups, 4-row tiles, 2 for the K-quants):
    exact for Q8_0's u8 = q + 128 too, so all four types are claimed, on one and two threads."""
    assert _isa(avxvnni_lib) == "AVX-VNNI"
    cases = _grid(["--rows", "1-9,16,17,33", "--k", "512", "--n", "136", "--threads", "2"], avxvnni_lib)
    cases += _grid(["--rows", "1,5,16", "--k", "2048", "--n", "264", "--threads", "1", "--batch", "2"], avxvnni_lib)
    assert len(cases) == len(TYPES) * (12 + 3) and not _bad(cases), "\n".join(_bad(cases))
    assert all(c["rows_exact"] for c in cases)


# ---------------------------------------------------------------- end to end
def _generate(target: Path, drafter: Path, x86mm: str, n: int = 48, env: dict[str, str] | None = None) -> dict:
    got = kernel_child.run(target, drafter, n, 2, {"GGML_CPU_X86MM": x86mm, "GGML_CPU_AMX": "0", **(env or {})})
    got["x86mm_weights"] = got["placed"].get("CPU_X86MM", 0)
    return got


@pytest.fixture(scope="module")
def demo_pairs(tmp_path_factory):
    return kernel_child.quantized_demo_pairs(tmp_path_factory.mktemp("x86mm-demo"), DEMO)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_k_m", "q4_0+q8_0 drafter"])
def test_dflash_equals_plain_with_the_kernels_on_and_off(demo_pairs, native_types, kind):
    target, drafter = demo_pairs[kind]
    on = _generate(target, drafter, "1")
    off = _generate(target, drafter, "0")
    if kind == "q8_0" and "q8_0" not in native_types:
        # AVX2 without VNNI: the kernels leave Q8_0 to ggml's, so none of this pair's weights go to them
        assert on["x86mm_weights"] == 0, f"{on['x86mm_weights']} Q8_0 weights went to CPU_X86MM on {on['isa']}"
    else:
        assert on["x86mm_weights"] > 0, f"no weight of the {kind} pair went to CPU_X86MM"
    assert off["x86mm_weights"] == 0
    assert on["isa"] == _isa(default_lib_dir())
    assert on["dflash"] == on["plain"], "kernels on: DFlash differs from plain decoding"
    assert off["dflash"] == off["plain"]
    assert on["tau"] > 1.5, on      # the demo drafter is right often: several rows per verify


def test_tiny_quantized_pair_with_the_kernels(models, tmp_path):
    t, d = kernel_child.quantized_tiny_pair(models, tmp_path)
    on, off = _generate(t, d, "1", 32), _generate(t, d, "0", 32)
    assert on["x86mm_weights"] > 0
    assert on["dflash"] == on["plain"] and off["dflash"] == off["plain"]


@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_dflash_equals_plain_on_the_avx_vnni_variant(avxvnni_lib, demo_pairs, kind):
    """The installed libllama over the AVX-VNNI variant's ggml (LD_LIBRARY_PATH goes before the wheel's
    RUNPATH): Q8_0 and Q4_K / Q6_K weights on the 256-bit VPDPBUSD kernels, greedy DFlash == plain."""
    target, drafter = demo_pairs[kind]
    got = _generate(target, drafter, "1", env={"LD_LIBRARY_PATH": str(avxvnni_lib)})
    assert got["isa"] == "AVX-VNNI", f"the child did not load the variant's ggml: {got['isa']}"
    assert got["x86mm_weights"] > 0, f"no weight of the {kind} pair went to CPU_X86MM"
    assert got["dflash"] == got["plain"]
    assert got["tau"] > 1.5, got
