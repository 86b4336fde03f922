"""ggml's AMX path (Intel AMX-INT8): MUL_MAT against the plain CPU path, and DFlash end to end.

Everything runs in child processes: a fault in the AMX kernels (the tile-config segfault that
patches/0006 fixes) must fail a test, not kill the test run, and ``GGML_CPU_AMX`` only takes effect
when ggml is loaded. Skipped, with the reason, where the CPU has no AMX-INT8; on a CPU that has it, a build without
the AMX buffer type fails (a skip there would hide a broken build).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernel_child

from dflash_gguf import paths

from dflash_gguf.kernels.amx import AMX_TYPES, cpu_has_amx_int8

pytestmark = pytest.mark.skipif(not cpu_has_amx_int8(),
                                reason="this CPU has no AMX-INT8 (amx_int8/amx_tile/avx512_vnni in /proc/cpuinfo)")

NO_AMX_BUFT = ("this CPU has AMX-INT8 but the installed ggml registers no AMX buffer type: the native build lost "
               "its AMX kernels (patches/0004, ggml-cpu/amx) - rebuild with `make build FORCE=1`")
ROOT = Path(__file__).resolve().parents[1]
DEMO = paths.DEMO_DIR
# every row count a DFlash step verifies (1..17: block 16 plus the pending token) and prompt batches
ROWS = "1-17,32,33,100"


def _grid(extra: list[str]) -> list[dict]:
    p = kernel_child.python(["-m", "dflash_gguf.kernels.amx", *extra], {"GGML_CPU_AMX": "1"}, timeout=300)
    if p.returncode == 3:
        pytest.fail(NO_AMX_BUFT)
    cases = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode not in (0, 1):
        last = cases[-1] if cases else None
        pytest.fail(f"MUL_MAT through the AMX buffer type: {kernel_child.died(p)}\nlast case that finished: {last}")
    return cases


def _bad(cases: list[dict]) -> list[str]:
    return [f"{c['type']} k={c['k']} n={c['n']} rows={c['rows']} batch={c['batch']}: AMX error {c['err']:.3g}, "
            f"CPU error {c['err_cpu']:.3g} (relative to the exact product)" for c in cases if not c["ok"]]


def test_mul_mat_every_amx_type_and_row_count():
    """Each AMX type x rows 1..17 and prompt batches: AMX as close to the exact product as the CPU path."""
    cases = _grid(["--types", ",".join(AMX_TYPES), "--rows", ROWS, "--k", "512", "--n", "160", "--threads", "2"])
    assert len(cases) == len(AMX_TYPES) * (17 + 3)
    assert not _bad(cases), "\n".join(_bad(cases))


def test_mul_mat_one_thread_and_wide_k():
    cases = _grid(["--types", "q4_0,q8_0,q6_k", "--rows", "1,2,16,17", "--k", "2048", "--n", "96", "--threads", "1"])
    assert len(cases) == 12 and not _bad(cases), "\n".join(_bad(cases))


def test_mul_mat_broadcast_over_batches():
    """src1 with ne[2] > 1 against one 2-D weight (the batch offsets patches/0006 fixes)."""
    cases = _grid(["--types", "q4_0,q4_k,f16", "--rows", "1,2,17", "--batch", "3", "--n", "64"])
    assert len(cases) == 9 and not _bad(cases), "\n".join(_bad(cases))


# ---------------------------------------------------------------- end to end
def _generate(target: Path, drafter: Path, amx: str | None, n: int = 48, x86mm: str | None = "0") -> dict:
    """Greedy tokens with GGML_CPU_AMX=amx (None: unset, i.e. the default of patches/0004) and
    GGML_CPU_X86MM=x86mm: off unless asked, since patches/0014's buffer type takes Q4_0, Q8_0, Q4_K and
    Q6_K weights ahead of AMX. "amx": some weight was placed in the AMX buffer type."""
    got = kernel_child.run(target, drafter, n, 1, {"GGML_CPU_AMX": amx, "GGML_CPU_X86MM": x86mm})
    got["amx"] = got["placed"].get("AMX", 0) > 0
    return got


@pytest.fixture(scope="module")
def demo_pairs(tmp_path_factory):
    return kernel_child.quantized_demo_pairs(tmp_path_factory.mktemp("amx-demo"), DEMO)


@pytest.mark.parametrize("kind", ["f16", "q8_0", "q4_0", "q4_k_m", "q8_0+q8_0 drafter"])
def test_dflash_amx_on_equals_off_and_plain(demo_pairs, kind):
    target, drafter = demo_pairs[kind]
    on = _generate(target, drafter, "1")
    if not on["amx"]:
        pytest.fail(NO_AMX_BUFT)
    off = _generate(target, drafter, "0")
    assert not off["amx"]
    assert on["dflash"] == on["plain"], "AMX on: DFlash differs from plain decoding"
    assert off["dflash"] == off["plain"]
    assert on["plain"] == off["plain"], "plain decoding with AMX on differs from AMX off"
    assert on["tau"] > 1.5, on      # the demo drafter is right often: several rows per verify


def test_tiny_quantized_pair_amx_on_equals_off(models, tmp_path):
    t, d = kernel_child.quantized_tiny_pair(models, tmp_path)
    on, off = _generate(t, d, "1", 32), _generate(t, d, "0", 32)
    assert on["amx"] and not off["amx"]
    assert on["dflash"] == on["plain"] == off["plain"] == off["dflash"]


def test_amx_is_the_default_for_quantized_weights(demo_pairs):
    """patches/0004: unset GGML_CPU_AMX means AMX on (the same tokens as GGML_CPU_AMX=1)."""
    target, drafter = demo_pairs["q4_0"]
    default, on = _generate(target, drafter, None, 24), _generate(target, drafter, "1", 24)
    if not on["amx"]:
        pytest.fail(NO_AMX_BUFT)
    assert default["amx"] and default["dflash"] == on["dflash"] == default["plain"]


@pytest.mark.parametrize("kind", ["q4_0", "q8_0"])
def test_x86mm_takes_its_types_ahead_of_amx(demo_pairs, kind):
    """patches/0014: with both on (the default), Q4_0/Q8_0 weights go to CPU_X86MM, none to AMX (whose
    kernels take 1.2-3.9x longer at 2..512 rows on a Sapphire Rapids-generation Xeon: BENCHMARKS.md 16), with AMX's tokens."""
    target, drafter = demo_pairs[kind]
    both, amx = _generate(target, drafter, None, 24, x86mm=None), _generate(target, drafter, None, 24)
    assert both["placed"].get("CPU_X86MM", 0) > 0 and not both["amx"], both["placed"]
    assert amx["amx"], amx["placed"]
    assert both["dflash"] == both["plain"] == amx["plain"]
