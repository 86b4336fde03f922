"""``python -m dflash_gguf.bench.memory`` at N slots: each configuration in its own process, and the
prediction for N slots counts what grows with the slots (KV buffers and the drafter features each slot
keeps on the host), measured on the shipped demo pair."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_gguf.bench import memory


def test_slots_predicted_from_one_slot_with_its_kv_and_host_features(tmp_path):
    out = tmp_path / "memory.json"
    p = subprocess.run([sys.executable, "-m", "dflash_gguf.bench.memory", "--n-ctx", "256", "--prompt-tokens", "100",
                        "--tokens", "8", "--threads", "1", "--configs", "batch n_parallel=1,batch n_parallel=2",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    one, two = res["batch n_parallel=1"], res["batch n_parallel=2"]
    # each slot kept its 100-token prompt's rows on the host (a buffer for at least that many rows)
    host = one["host_features_bytes"]
    assert host >= 100 * 4 * 256 and two["host_features_bytes"] == 2 * host     # 4-byte floats, n_embd 256
    assert sum(memory.summarize(two)["kv"]) == 2 * sum(memory.summarize(one)["kv"])
    (line,) = memory._batch_lines(res)
    kv1 = sum(memory.summarize(one)["kv"])
    pred = one["after"]["VmHWM"] + kv1 + host / 2**20
    assert f"predicted {pred:.0f}" in line and "host features" in line, line
    assert 0.8 < two["after"]["VmHWM"] / pred < 1.25, line


def test_a_llama_with_a_drafter_holds_no_gguf_py():
    """Loading and running a DFlash Llama imports no part of gguf-py (the whole package comes with any of
    its modules: memory plain llama_cpp.Llama does not hold)."""
    code = ("import sys, dflash_gguf\n"
            "from dflash_gguf.demo import demo_pair\n"
            "t, d = demo_pair()\n"
            "llm = dflash_gguf.Llama(str(t), draft_model_path=str(d), n_ctx=256, n_threads=1, verbose=False)\n"
            "llm('Hello', max_tokens=4, temperature=0)\n"
            "print(sorted(m for m in sys.modules if m == 'gguf' or m.startswith('gguf.')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "[]"


SCALE_PAIR = "1.7b"   # the Q4_0 scale pair with the converter's default reduced head


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DFLASH_GGUF_MEMORY_BOUND"),
                    reason="writes the 1.7B-shaped Q4_0 scale pair (1.2 GB) and decodes a 2000-token prompt four "
                           "times; set DFLASH_GGUF_MEMORY_BOUND=1 (BENCHMARKS-LOG.md, memory at short prompts)")
@pytest.mark.parametrize("prompt_tokens", [8, 2000])
def test_dflash_extra_peak_within_the_drafter_weights_and_a_quarter(prompt_tokens):
    """DFlash's peak RSS over plain llama_cpp.Llama's (each in its own process, n_ctx 4096, defaults) stays
    within the drafter file + 25%, at a prompt shorter than a block and at one past the drafter's window."""
    from dflash_gguf.bench.scale import synth

    pair = synth.reduced_pair(synth.make_pair(SCALE_PAIR, "q4_0"), 32768)
    target, drafter = str(pair / "target.gguf"), str(pair / "drafter.gguf")
    peak = {name: memory.measure(name, target, drafter, 4096, prompt_tokens, 32, 2)["after"]["VmHWM"]
            for name in ("plain", "dflash")}
    budget = os.path.getsize(drafter) / 2**20 * 1.25
    assert peak["dflash"] - peak["plain"] <= budget, (peak, budget)
