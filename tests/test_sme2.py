"""KleidiAI's SME2 kernels, run by the aarch64 KleidiAI cross build under an SME2-capable qemu-user.

Debian 12's qemu-user-static (7.2, tests/test_arm64.py) has SME but not SME2, so ggml never selects
KleidiAI's SME2 kernels there. QEMU 10.1 and later emulate SME2 under ``-cpu max``;
``python -m dflash_gguf.build.cross --fetch-qemu-sme2`` (run by ``make test``) fetches one into the
cache. Here, at 256-bit streaming vector length (QEMU's default) and 512-bit (Apple M4's):

* the kernels that run are KleidiAI's SME2 ones, per weight type and row count, seen by breakpoints on
  KleidiAI's own entry points (gdb-multiarch on qemu's gdb stub): ``sme2_sdot`` / ``sme2_dot`` for a
  one-row decode, ``sme2_mopa`` for verify batches; ggml's log names the SME2 family too;
* each pair of those kernels (and the SME, i8mm and dotprod pairs), called directly on random data,
  gives every row of a batch the bits of that row alone (for Q4_0 since patches/0027: the GEMM takes
  int8 activations, as the one-row kernel does);
* the project's Python loop in the emulated aarch64 CPython gives greedy DFlash == plain with them on
  the demo pair quantized to Q4_0 and to Q8_0 (and the x86 engine's tokens), and with the shipped
  DFlash2 and DSpark drafters; sampled with a seed, the same tokens twice;
* upstream's ``llama-speculative-simple`` (cross-built) gives the x86 engine's tokens.

ggml's KleidiAI code runs an SME kernel on at most its SME thread cap of threads (one where the CPU does
not say how many SME units it has, as under qemu) and, for batches under 128 rows with more threads
than that, picks the non-SME fallback instead: these checks run one thread so the SME2 kernels run.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from dflash_gguf.build import cross as build_cross
from dflash_gguf.demo import DEMO_DIR
from dflash_gguf.native.engine import Model

from test_arm64 import (DEMO_PROMPT, GUEST_SCRIPT, KAI, assert_rows_agree, demo_quantized,  # noqa: F401 (a fixture)
                        kai_rows, trace_kernels, x86_tokens)

pytestmark = pytest.mark.slow

QEMU_SME2 = build_cross.find_qemu_sme2()
DFLASH2 = DEMO_DIR.parent / "demo-dflash2" / "drafter.gguf"
DSPARK = DEMO_DIR.parent / "demo-dspark" / "drafter.gguf"
N = 16


def _sme2_guest(bits: int):
    if QEMU_SME2 is None:
        pytest.skip("no qemu-user >= 10.1 (SME2): python -m dflash_gguf.build.cross --fetch-qemu-sme2 fetches "
                    "one from Debian's trixie-backports; make test does, where apt can reach Debian")
    wheel = build_cross.cross_wheel(KAI)
    if wheel is None:
        pytest.skip(f"no aarch64 wheel for {KAI} (make cross-kleidiai builds it when aarch64-linux-gnu-g++ is installed)")
    try:
        return build_cross.guest_python(wheel, cpu=build_cross.qemu_sme2_cpu(bits), qemu=QEMU_SME2)
    except build_cross.ToolMissing as e:
        pytest.skip(f"no emulated aarch64 Python: {e}")


def run_sme2(bits: int, target: Path, drafter: Path, *extra: str) -> dict:
    cmd, env = _sme2_guest(bits)
    args = [*cmd, str(GUEST_SCRIPT), "--target", str(target), "--drafter", str(drafter), "--prompt", DEMO_PROMPT,
            "-n", str(N), "--threads", "1", *extra]
    r = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    log = "\n".join(got["log"])
    assert "kleidiai: SME enabled" in log, log
    return got


def assert_sme2_selected(log: list[str], qtype: str):
    """ggml's own log: KleidiAI's SME2 family is the primary one for this weight type, and the weights
    sit in KleidiAI's buffers. Under qemu 7.2 (no SME2) the same build logs SME or I8MM here."""
    text = "\n".join(log)
    assert f"kleidiai: primary {qtype[:2]} kernel feature SME2" in text, text
    assert re.search(r"CPU_KLEIDIAI model buffer size = +[1-9]", text), text


def test_the_sme2_emulator_is_new_enough_and_not_the_system_one():
    if QEMU_SME2 is None:
        pytest.skip("no qemu-user >= 10.1 (SME2): python -m dflash_gguf.build.cross --fetch-qemu-sme2")
    assert build_cross.qemu_version(QEMU_SME2) >= (10, 1)
    old = build_cross.find_qemu()
    if old is not None and build_cross.qemu_version(old) < (10, 1):
        assert Path(old).resolve() != Path(QEMU_SME2).resolve()


# ---------------------------------------------------------------------------------------------
# Which kernel runs (test_arm64.trace_kernels: a gdb breakpoint on every KleidiAI matmul entry point)
# ---------------------------------------------------------------------------------------------

def kernel_trace(bits: int, target: Path, qtype: str, rows: str = "1,2,16") -> dict[int, set[str]]:
    """{rows of the decoded batch: names of the KleidiAI matmul kernels that ran with m == rows}."""
    cmd, env = _sme2_guest(bits)
    seen, log = trace_kernels(cmd, env, target, rows)
    assert_sme2_selected(log, qtype)
    return seen


@pytest.mark.parametrize("qtype,bits,decode,verify", [
    ("q4_0", 256, {"qsi8d32p1x4_qsi4c32p4vlx4_1x4vl_sme2_sdot"}, {"qsi8d32p1vlx4_qsi4c32p4vlx4_1vlx4vl_sme2_mopa"}),
    ("q8_0", 512, {"qai8dxp1x4_qsi8cxp4vlx4_1x4vl_sme2_dot"}, {"qai8dxp1vlx4_qsi8cxp4vlx4_1vlx4vl_sme2_mopa"}),
])
def test_sme2_kernels_run_for_decode_and_verify_rows(demo_quantized, qtype, bits, decode, verify):
    """One-row decodes run KleidiAI's SME2 GEMV (sdot/dot), verify batches of 2-16 rows its SME2 GEMM
    (mopa), and nothing else: no SME1, i8mm, dotprod or NEON kernel. For Q4_0 the GEMM is the one with
    int8 activations (patches/0027), not upstream's f16 one."""
    seen = kernel_trace(bits, demo_quantized[qtype][0], qtype)
    print(f"{qtype} at {bits}-bit SVL: {seen}")
    assert seen.get(1) == decode, seen
    assert seen.get(2) == verify and seen.get(16) == verify, seen
    assert set(seen) == {1, 2, 16}, seen


# ---------------------------------------------------------------------------------------------
# The kernels themselves: a batch row against the same row alone (tests/arm_kai_rows.py)
# ---------------------------------------------------------------------------------------------

ALL_PAIRS = "q4_0-sme2,q8_0-sme2,q8_0-sme,q4_0-i8mm,q4_0-dotprod,q8_0-i8mm,q8_0-dotprod"


@pytest.mark.parametrize("bits", [256, 512])
def test_kernel_pairs_give_one_row_bits_for_every_batch_row(bits):
    """Every kernel pair of ggml's KleidiAI table this CPU can run (SME2, SME, i8mm, dotprod; Q4_0 and
    Q8_0), called on random data: each row of a 16-row GEMM has the bits of that row through the
    one-row kernel, and both are the matmul. Before patches/0027 the Q4_0 SME2 GEMM took f16
    activations and its rows differed from the one-row kernel's."""
    cmd, env = _sme2_guest(bits)
    got = kai_rows(cmd, env, ALL_PAIRS)
    print(f"{bits}-bit SVL: {got}")
    assert_rows_agree(got)
    assert got["q4_0-sme2"]["gemm"] == "qsi8d32p1vlx4_qsi4c32p4vlx4_1vlx4vl_sme2_mopa"


def test_sme1_q8_0_gemm_is_wrong_only_under_qemu_7_2():
    """Why tests/test_arm64.py's SME1 Q8_0 run is an expected failure: the same library's SME1 Q8_0
    kernels on the same data (a fixed seed) under qemu 7.2 and under QEMU 11.1. Under 11.1 the GEMM
    (sme_mopa) gives the one-row kernel's (sme_dot) bits and the reference; under 7.2 sme_dot gives
    those same bits but sme_mopa is far off: 7.2's emulation of the SME GEMM is wrong, not the kernels."""
    old = build_cross.find_qemu()
    if old is None or (build_cross.qemu_version(old) or (0, 0)) >= build_cross.QEMU_SME2_MIN:
        pytest.skip("needs the system's qemu-user before 10.1 (Debian 12's 7.2) beside the SME2 emulator")
    cmd, env = _sme2_guest(256)
    new = kai_rows(cmd, env, "q8_0-sme")["q8_0-sme"]
    cmd_old, env_old = build_cross.guest_python(build_cross.cross_wheel(KAI), qemu=old)
    was = kai_rows(cmd_old, env_old, "q8_0-sme")["q8_0-sme"]
    print(f"QEMU 11.1: {new}\n{old}: {was}")
    assert new["rows_equal"] and new["gemm_err"] < 0.02, new
    assert was["decode_sha"] == new["decode_sha"], (was, new)
    if was["gemm_sha"] == new["gemm_sha"]:
        pytest.skip(f"{old} emulates the SME1 GEMM right: tests/test_arm64.py's SME1 Q8_0 run should pass there")
    assert was["gemm_err"] > 0.5, was


# ---------------------------------------------------------------------------------------------
# The whole loop under SME2
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype,bits", [("q4_0", 256), ("q4_0", 512), ("q8_0", 512)])
def test_python_loop_on_sme2_kernels_matches_x86(demo_quantized, qtype, bits):
    """The demo pair quantized: greedy DFlash == plain decoding == the x86 engine, with the SME2
    kernels selected for every quantized weight. Q4_0 left plain decoding at the 16th token before
    patches/0027 (verify rows in f16, decodes in int8)."""
    target, drafter = demo_quantized[qtype]
    got = run_sme2(bits, target, drafter, "--plain")
    print(f"{qtype} at {bits}-bit SVL: tau {got['tau']:.2f}, {got['seconds']}")
    assert_sme2_selected(got["log"], qtype)
    assert got["dflash"] == got["plain"], "lossless on SME2: DFlash must equal plain decoding"
    assert got["dflash"] == x86_tokens(target, drafter, n=N)
    assert got["tau"] > 1.5, f"the quantized demo drafter should still be accepted often (tau {got['tau']})"


@pytest.mark.parametrize("name,drafter,qtype,bits", [("DFlash2", DFLASH2, "q8_0", 512), ("DSpark", DSPARK, "q8_0", 256)])
def test_shipped_drafters_on_sme2_kernels(demo_quantized, name, drafter, qtype, bits):
    """The shipped DFlash2 and DSpark demo drafters on the quantized demo target: greedy, the x86
    engine's tokens; sampled with a seed, the same tokens in both runs."""
    target = demo_quantized[qtype][0]
    got = run_sme2(bits, target, drafter, "--sample-seed", "1234")
    print(f"{name} on {qtype} at {bits}-bit SVL: tau {got['tau']:.2f}, {got['seconds']}, sampled {got['sampled']}")
    assert_sme2_selected(got["log"], qtype)
    assert got["dflash"] == x86_tokens(target, drafter, n=N)
    a, b = got["sampled"]
    assert len(a) == N and a == b, got["sampled"]


def test_upstream_speculative_simple_on_sme2_kernels(demo_quantized):
    """Upstream's own loop (the cross-built llama-speculative-simple) with the SME2 kernels: the x86
    engine's greedy tokens on the Q8_0 demo pair."""
    target, drafter = demo_quantized["q8_0"]
    bindir = build_cross.paths.tools_dir(KAI)
    if bindir is None or not (bindir / "llama-speculative-simple").exists():
        pytest.skip(f"no {KAI} cross build of the tools (make cross-kleidiai)")
    cmd, _ = _sme2_guest(256)
    root = cmd[cmd.index("-L") + 1]
    args = [QEMU_SME2, "-cpu", build_cross.qemu_sme2_cpu(256), "-L", root, str(bindir / "llama-speculative-simple"),
            "-m", str(target), "-md", str(drafter), "--spec-type", "draft-dflash", "-p", DEMO_PROMPT, "-n", str(N + 4),
            "--temp", "0", "--top-k", "1", "--seed", "42", "-c", "256", "-t", "1", "-lv", "4"]
    r = subprocess.run(args, capture_output=True, timeout=600, env={"LD_LIBRARY_PATH": str(bindir)})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err[-2000:]
    # the tool sets its log callback after ggml's KleidiAI set-up has logged; its memory breakdown shows
    # the weights in KleidiAI's buffers (the kernels these take under this emulator: traced above)
    assert re.search(r"CPU_KLEIDIAI +\| +[1-9]", err), err[-3000:]
    assert "n_accept" in err
    tm = Model(target)
    text = tm.detokenize(x86_tokens(target, drafter, n=N))
    tm.close()
    assert text in r.stdout, f"x86 engine {text!r} not in the arm64 output {r.stdout!r}"
