"""``python -m dflash_gguf.bench.memory`` at N slots: each configuration in its own process, and the
prediction for N slots counts what grows with the slots (KV buffers and the drafter features each slot
keeps on the host), measured on the shipped demo pair."""
from __future__ import annotations

import json
import subprocess
import sys

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
