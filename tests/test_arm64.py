"""The aarch64 cross-build (``python -m dflash_gguf.build --cross aarch64-linux-gnu``) runs.

Under qemu-user, the cross-built patched library and upstream's DFlash loop decode a tiny GGUF
pair and must give the tokens that our engine gives on x86-64. qemu 7.2 emulates NEON/SVE but
not SME2, so this checks the generic Arm CPU path only; SME2 and KleidiAI are not exercised here.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest

from dflash_gguf import paths
from dflash_gguf.engine import Context, ContextOptions, Model
from dflash_gguf.spec import DFlashDecoder, GenerationStats, SpecOptions

TRIPLE = "aarch64-linux-gnu"
BIN = paths.tools_dir(TRIPLE)
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
pytestmark = pytest.mark.skipif(
    BIN is None or not (BIN / "llama-speculative-simple").exists() or QEMU is None,
    reason="no aarch64 cross-build or no qemu-user (apt-get install g++-aarch64-linux-gnu qemu-user-static; "
           "make test builds it when both are present)")

PROMPT = "def main(argv):\n    parser = argparse.ArgumentParser("


def test_cross_built_library_is_arm64():
    lib = next(BIN.glob("libllama.so*"))
    out = subprocess.run(["file", "-L", str(lib)], capture_output=True, text=True).stdout \
        if shutil.which("file") else open(lib, "rb").read(20)
    if isinstance(out, bytes):
        assert out[:4] == b"\x7fELF" and int.from_bytes(out[18:20], "little") == 183   # EM_AARCH64
    else:
        assert "aarch64" in out or "ARM aarch64" in out


def test_dflash_under_qemu_matches_x86_engine(models):
    pair = models.pair("qwen3", "dflash", 8)
    cmd = [QEMU, "-L", f"/usr/{TRIPLE}", str(BIN / "llama-speculative-simple"), "-m", str(pair.target),
           "-md", str(pair.drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", "7", "-p", PROMPT,
           "-n", "24", "--temp", "0", "--top-k", "1", "--seed", "42", "-c", "256", "-t", "2", "-lv", "4"]
    r = subprocess.run(cmd, capture_output=True, timeout=600, env={"LD_LIBRARY_PATH": str(BIN)})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, err[-2000:]
    assert "n_accept" in err

    tm, dm = Model(pair.target), Model(pair.drafter)
    tc = Context(tm, ContextOptions(n_ctx=256))
    dc = Context(dm, ContextOptions(n_ctx=256), other=tc)
    st = GenerationStats()
    out = list(DFlashDecoder(tc, dc, SpecOptions(n_draft=7)).generate(tm.tokenize(PROMPT.encode()), 20, stats=st))
    text = tm.detokenize(out)
    dc.close(), tc.close(), dm.close(), tm.close()
    assert text in r.stdout, f"x86 engine {text!r} not in the arm64 output {r.stdout!r}"
