"""Host threads that run ggml's graphs end with their work (dflash_gguf.native.threads): with ggml's OpenMP build,
a live thread that once ran a graph keeps a pool of workers, and while libgomp manages more threads than
CPUs every decode sleeps at its barriers (measured on 2 cores: 0.56x; BENCHMARKS.md section 21)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dflash_gguf.native.threads import SerialWorker, run_in_own_thread


def test_building_a_gated_decoder_leaves_no_thread_pool_behind(tmp_path):
    """The calibration runs on a thread of its own: after a decoder is built (and has measured its
    costs), the process has the threads it had before; measured in the building thread, its OpenMP pool
    (a worker per thread past the first) stayed for the life of that thread (a server's main thread)."""
    code = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from dflash_gguf.native.engine import ContextOptions
        from dflash_gguf.paths import DEMO_DIR as DEMO
        from dflash_gguf.pair import OpenPair
        from dflash_gguf.decoding import SpecOptions, calibration
        calibration.cache_file = lambda key: Path({str(tmp_path)!r}) / f"{{key}}.json"
        calibration.steady = lambda seen: True
        n = lambda: len(os.listdir("/proc/self/task"))
        with OpenPair(DEMO / "target.gguf", DEMO / "drafter.gguf", ContextOptions(n_ctx=1024, n_threads=2)) as p:
            before = n()
            p.decoder(SpecOptions(adaptive=True))
            for _ in range(100):
                if n() == before:
                    break
                time.sleep(0.05)
            print("THREADS", before, n())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert list(tmp_path.glob("*.json")), "the decoder measured its costs"
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("THREADS"))
    before, after = map(int, line.split()[1:])
    assert after == before, f"{after - before} thread(s) left behind by the calibration"


def test_run_in_own_thread_returns_and_raises_from_a_thread_that_ends():
    seen = []

    def job(x):
        seen.append(threading.current_thread())
        return x * 2

    assert run_in_own_thread(job, 21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="boom"):
        run_in_own_thread(lambda: {}["boom"])


def test_serial_worker_runs_jobs_in_order_one_at_a_time_and_its_thread_ends_when_idle():
    w = SerialWorker(idle_s=0.2)
    running, order, threads = [0], [], set()
    lock = threading.Lock()

    def job(i):
        with lock:
            running[0] += 1
            assert running[0] == 1, "two jobs at once"
        threads.add(threading.current_thread())
        time.sleep(0.002)
        order.append(i)
        with lock:
            running[0] -= 1
        return i

    futs = [w.submit(job, i) for i in range(50)]
    assert [f.result(10) for f in futs] == list(range(50)) and order == list(range(50))
    assert len(threads) == 1
    deadline = time.time() + 5
    while w.alive() and time.time() < deadline:
        time.sleep(0.02)
    assert not w.alive() and not next(iter(threads)).is_alive(), "the idle thread ended"
    assert w.submit(job, 50).result(10) == 50 and w.threads_started == 2, "the next job started a new thread"
    with pytest.raises(ZeroDivisionError):
        w.submit(lambda: 1 / 0).result(10)


def test_serial_worker_never_loses_a_job_submitted_as_its_thread_ends():
    """Jobs that come just as the idle thread gives up run (on it, or on the next), none twice."""
    w = SerialWorker(idle_s=0.001)
    done = []
    for i in range(300):
        assert w.submit(done.append, i).result(10) is None
        time.sleep(0.001 * (i % 3))
    assert done == list(range(300))


def test_bench_threads_runs_its_phases_with_the_other_thread_alive_then_gone():
    """``bench.threads``: the middle phase decodes while a second thread that ran graphs is alive (its
    OpenMP pool with it), the last after it exited; measured on the demo target in a child process."""
    code = textwrap.dedent("""
        import json
        from dflash_gguf.bench import threads
        from dflash_gguf.paths import DEMO_DIR
        r = threads.measure(DEMO_DIR / "target.gguf", n_tokens=8, rounds=2, threads=2)
        print("RESULT", json.dumps(r))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    r = __import__("json").loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT"))[7:])
    n = r["process_threads"]
    assert all(o > a for o, a in zip(n["other"], n["alone"])), n     # the other thread and its pool were there
    assert n["after"] == n["alone"], n                                # and gone with it
    for p in ("alone", "other", "after"):
        assert len(r["tokens_per_second"][p]["runs"]) == 2 and r["tokens_per_second"][p]["median"] > 0
    assert r["other_over_alone"] == r["tokens_per_second"]["other"]["median"] / r["tokens_per_second"]["alone"]["median"]
