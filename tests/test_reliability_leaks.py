"""No leaks at CI size: RSS, file descriptors and gc objects stay flat over Llama generations with
close/reopen cycles and over Model/Context open/close cycles (measured in a child process, so
that nothing of the test run itself is counted). ``--full`` (1,000 generations) in RELIABILITY.md.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


def test_no_leaks(tmp_path):
    out = tmp_path / "leaks.json"
    r = subprocess.run([sys.executable, "-m", "dflash_gguf.reliability.leaks", "--generations", "150", "--reopen",
                        "30", "--cycles", "40", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), f"exit {r.returncode}: {r.stderr[-3000:]}"
    rep = json.loads(out.read_text())
    print(r.stdout)
    for phase in ("llama", "engine"):
        g = rep[phase]["growth"]
        assert g["fds"] == 0, (phase, g)
        assert g["rss_peak_mib"] <= rep["tolerance"]["rss_mib"], (phase, g)
        assert g["gc_objects"] <= rep["tolerance"]["gc_objects"], (phase, g)
    assert rep["ok"] and r.returncode == 0
