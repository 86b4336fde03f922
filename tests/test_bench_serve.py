"""bench.serve's per-thread CPU reading (the servers themselves are run by the benchmark, not here)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

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
    monkeypatch.setattr(serve, "command", lambda server, *a: [server, str(a[5])])

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


def test_replay_runs_ours_through_the_replay_server_with_this_tools_prompts(monkeypatch):
    """--replay: ``ours`` (only) starts as the replay server, given the benchmark's own prompts and
    tokens; each of its runs reports the acceptance length its drafting steps got (from /metrics)."""
    cmd = serve.command("ours", "t.gguf", "d.gguf", 2, 2, 256, 9000, ["--replay", "demo"])
    assert cmd[1:3] == ["-m", "dflash_gguf.bench.replay_server"] and cmd[-4:] == ["--replay", "demo", "-np", "2"]
    for other in ("ours-plain", "ours-serial"):
        c = serve.command(other, "t.gguf", "d.gguf", 2, 2, 256, 9000, ["--replay", "demo"])
        assert c[2] == "dflash_gguf.server" and "--replay" not in c
    assert serve.command("ours", "t.gguf", "d.gguf", 2, 2, 256, 9000)[2] == "dflash_gguf.server"

    events, procs = _fake_servers(monkeypatch)
    flags = []
    monkeypatch.setattr(serve, "command", lambda server, *a: flags.append((a[6], json.loads(Path(a[6][3]).read_text())))
                        or [server, str(a[5])])
    counts = iter([(10.0, 40.0), (14.0, 52.0)])       # (steps, accepted) before and after ours' run
    monkeypatch.setattr(serve, "drafting_counts", lambda url: next(counts))
    rows = serve.bench("p", ["ours", "upstream"], [1], 8, 24, 2, 256, all_up=True, replay="demo")
    f, prompts = flags[0]
    assert f[:2] == ["--replay", "demo"] and f[4:] == ["--replay-tokens", "24"] and flags[1][0] == f
    assert prompts == serve.PROMPTS and not Path(f[3]).exists()       # the prompts' file is gone after the run
    by = {r["server"]: r for r in rows}
    assert by["ours"]["acceptance_length"] == 4.0 and by["ours"]["drafting_steps"] == 4
    assert "acceptance_length" not in by["upstream"] and by["ours"]["pair"] == "p (ours replaying demo)"
    assert "acceptance 4.00" in serve.table(serve.medians(rows), ["ours", "upstream"])


def test_the_replay_server_drafts_its_prompts_continuations_at_the_profile(models, monkeypatch, tmp_path):
    """The replay server's slots draft each listed prompt's own continuation, right as often as the
    profile says: every token (all accepted) or none (none accepted); the text is plain decoding's."""
    from fastapi.testclient import TestClient

    from dflash_gguf.bench import replay_server
    from dflash_gguf.server import cli

    pair = models.pair()
    prompts = ["def add(a, b):\n", "import os\n"]
    book = tmp_path / "prompts.json"
    book.write_text(json.dumps(prompts))
    for profile, right in (("1,1,1,1,1,1,1", True), ("none", False)):
        got = {}

        def fake_serve(app, args, got=got):
            with TestClient(app) as c:
                for p in prompts:
                    body = {"prompt": p, "max_tokens": 16, "temperature": 0}
                    got[p] = [c.post("/v1/completions", json={**body, "dflash": d}).json() for d in (True, False)]

        monkeypatch.setattr(cli, "serve", fake_serve)
        argv = ["-m", str(pair.target), "-md", str(pair.drafter), "-np", "2", "-c", "256", "-t", "1",
                "--no-draft-adaptive", "--replay", profile, "--replay-prompts", str(book), "--replay-tokens", "16"]
        assert replay_server.main(argv) == 0
        for p, (spec, plain) in got.items():
            assert spec["choices"][0]["text"] == plain["choices"][0]["text"], (profile, p)
            d = spec["dflash"]
            assert d["drafted"] > 0 and d["accepted"] == (d["drafted"] if right else 0), (profile, p, d)


def test_the_replay_server_replays_recorded_steps_with_their_confidences(models, monkeypatch, tmp_path):
    """``--replay traces:FILE``: each block is right for its recorded step's accepted count and carries the
    step's confidences, which the slots then calibrate against what the target kept, although the drafter
    itself has no confidence head; the text is plain decoding's."""
    from fastapi.testclient import TestClient

    from dflash_gguf.bench import replay_server
    from dflash_gguf.server import cli

    pair = models.pair()
    prompts = ["def add(a, b):\n", "import os\n"]
    book = tmp_path / "prompts.json"
    book.write_text(json.dumps(prompts))
    for accepted in (5, 0):
        traces = tmp_path / f"traces-{accepted}.json"
        traces.write_text(json.dumps([{"accepted": accepted, "confidence": [0.9] * accepted + [0.1] * (5 - accepted)}]))
        got, seen = {}, {}

        def fake_serve(app, args, got=got, seen=seen):
            with TestClient(app) as c:
                for p in prompts:
                    body = {"prompt": p, "max_tokens": 16, "temperature": 0}
                    got[p] = [c.post("/v1/completions", json={**body, "dflash": d}).json() for d in (True, False)]
            dec = app.state.server.slots.decoder
            seen["n_draft"], seen["scored"] = dec.n_draft, dec.confidence[True].tries.sum()

        monkeypatch.setattr(cli, "serve", fake_serve)
        argv = ["-m", str(pair.target), "-md", str(pair.drafter), "-np", "2", "-c", "256", "-t", "1",
                "--no-draft-adaptive", "--replay", f"traces:{traces}", "--replay-prompts", str(book),
                "--replay-tokens", "16"]
        assert replay_server.main(argv) == 0
        assert seen["n_draft"] == 5 and seen["scored"] > 0      # the trace's block; its scores calibrated
        for p, (spec, plain) in got.items():
            assert spec["choices"][0]["text"] == plain["choices"][0]["text"], (accepted, p)
            d = spec["dflash"]
            assert d["drafted"] > 0 and d["accepted"] == d["drafted"] * accepted // 5, (accepted, p, d)


def test_a_scale_pair_with_a_reduced_head_is_named_by_its_rows(monkeypatch, tmp_path):
    """``--pairs 1.7b:q4_0:dv32768``: the scale pair whose drafter has a reduced head of 32,768 rows; a third
    part that is not ``dvN`` is refused before any pair is made."""
    from dflash_gguf.bench.scale import synth

    made = []
    monkeypatch.setattr(synth, "make_pair", lambda shape, wtype: made.append((shape, wtype)) or tmp_path / "p")
    monkeypatch.setattr(synth, "reduced_pair", lambda pair, n: pair.with_name(f"{pair.name}-dv{n}"))
    with pytest.raises(SystemExit, match="dvN"):
        serve.pair_files("1.7b:q4_0:32768")
    assert made == []
    assert serve.pair_files("1.7b:q4_0:dv32768") == (tmp_path / "p-dv32768" / "target.gguf",
                                                     tmp_path / "p-dv32768" / "drafter.gguf")
    assert serve.pair_files("0.6b:q8_0")[1] == tmp_path / "p" / "drafter.gguf" and made[-1] == ("0.6b", "q8_0")
