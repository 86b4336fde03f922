"""Server soak at CI size: concurrent mixed traffic on loopback against a DFlash server (the demo
pair), then every good request replayed alone on a fresh server, and every greedy one on a server
decoding plainly; once one request at a time, once with ``--parallel 4`` (the batched engine's slots).
``--full`` (500 requests, max_tokens up to 256) in RELIABILITY.md.
"""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server needs fastapi and uvicorn (pip install dflash-gguf[server])")
pytest.importorskip("uvicorn", reason="the server needs fastapi and uvicorn (pip install dflash-gguf[server])")

from dflash_gguf.reliability import server_soak  # noqa: E402

pytestmark = [pytest.mark.reliability, pytest.mark.slow]


@pytest.mark.parametrize("parallel", [None, 4], ids=["serial", "parallel4"])
def test_server_soak(tmp_path, parallel):
    rep = server_soak.run(server_soak.DEMO_DIR, 72, 8, 48, seed=5, warmup=12, work=tmp_path, parallel=parallel)
    print(server_soak.summary(rep))
    assert rep["status_5xx"] == 0
    assert not rep["wrong_status"], rep["wrong_status"][:3]
    assert rep["health"]["failures"] == 0 and rep["health"]["polls"] >= 5   # polled all along; the count follows the run's length
    assert not rep["mismatches"], rep["mismatches"][:2]
    # what DFlash returned under load is plain decoding's text, not only DFlash-alone's
    assert rep["replayed_plain"] > 15 and not rep["plain_mismatches"], rep["plain_mismatches"][:2]
    assert rep["replayed"] >= rep["replayed_plain"]
    assert rep["metrics_ok"], rep["metrics"]
    assert abs(rep["rss_change_pct"]) <= 5.0
    k = rep["kinds"]
    assert k["good"] > 30 and k["bad"] > 5 and k["drop_stream"] > 0 and k["drop_request"] > 0
