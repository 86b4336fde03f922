"""bench.serve's per-thread CPU reading (the servers themselves are run by the benchmark, not here)."""
from __future__ import annotations

import os
import sys
import time

import pytest

from dflash_gguf.bench import serve


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_main_thread_cpu_counts_this_threads_work():
    before = serve.main_thread_cpu(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.3:        # busy on the main thread
        pass
    after = serve.main_thread_cpu(os.getpid())
    assert before is not None and after - before >= 0.2
    assert serve.main_thread_cpu(2 ** 22 + 12345) is None      # no such process


class _Proc:
    def __init__(self, name):
        self.name, self.pid, self.stopped = name, 2 ** 22 + 1, False

    def terminate(self):
        self.stopped = True

    def wait(self, timeout=None):
        return 0


def _fake_servers(monkeypatch):
    """bench() against stand-in servers: which server each start and each run went to, in order."""
    events = []
    procs = {}
    monkeypatch.setattr(serve, "pair_files", lambda pair: ("t.gguf", "d.gguf"))
    monkeypatch.setattr(serve, "command", lambda server, *a: [server, str(a[-1])])

    def start(cmd, port):
        procs[cmd[1]] = p = _Proc(cmd[0])
        assert all(q.stopped for q in procs.values() if q is not p and q.name == p.name), "one server of a kind up"
        events.append(("start", cmd[0]))
        return p

    def run_clients(url, c, n, t):
        port = url.rsplit(":", 1)[1]
        assert not procs[port].stopped
        events.append(("run", procs[port].name))
        return {"tok_s": 10.0, "tokens": 8, "wall_s": 0.8, "ttft_p50": 0.01, "ttft_p95": 0.01,
                "lat_p50": 0.1, "lat_p95": 0.1}

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "one_request", lambda *a: (0.0, 0.0, 4))
    monkeypatch.setattr(serve, "run_clients", run_clients)
    return events, procs


def test_all_up_starts_each_server_once_per_client_count_and_alternates_runs(monkeypatch):
    """... each repeat one server further down the list (no server always runs after the same one)."""
    events, procs = _fake_servers(monkeypatch)
    rows = serve.bench("p", ["a", "b", "c"], [1, 4], 8, 32, 2, 256, repeats=4, all_up=True)
    order = ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    per_count = [("start", "a"), ("start", "b"), ("start", "c")] + [("run", s) for s in order]
    assert events == per_count * 2
    assert all(p.stopped for p in procs.values())
    assert [(r["clients"], r["server"], r["run"]) for r in rows] == \
        [(c, s, k // 3) for c in (1, 4) for k, s in enumerate(order)]


def test_without_all_up_every_run_has_a_fresh_server(monkeypatch):
    events, procs = _fake_servers(monkeypatch)
    serve.bench("p", ["a", "b"], [2], 8, 32, 2, 256, repeats=2)
    assert events == [("start", "a"), ("run", "a"), ("start", "b"), ("run", "b"),
                      ("start", "b"), ("run", "b"), ("start", "a"), ("run", "a")]
    assert len(procs) == 4 and all(p.stopped for p in procs.values())
