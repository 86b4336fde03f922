"""Which host threads run ggml's graphs, and for how long they live.

ggml's CPU backend is built with OpenMP (llama.cpp's default on Linux), and libgomp keeps a pool of
worker threads for every host thread that has run a parallel region, for as long as that host thread
lives. While libgomp manages more threads than the process has CPUs, it makes every pool's workers
stop spinning after a few hundred iterations and sleep on a futex at each barrier instead (GOMP_SPINCOUNT's
"throttled" rule); a ggml graph has a barrier per node, so every decode then pays a futex wake per node
and thread. Measured on 2 cores (Qwen3-0.6B-shaped Q4_0 target, 2 threads): decoding in one thread ran
at **0.56x** its speed while another thread that had once decoded was alive, and at full speed again once
it had exited. A server whose step costs were calibrated in its main thread ran its slots at 0.6x.

So graphs run on threads that end with their work, or on the one thread that does all of it:

* :func:`run_in_own_thread` runs a one-off job (the speed gate's calibration, which runs where a
  decoder is built - often a thread that never decodes again) on a thread that exits with it;
* :class:`SerialWorker` runs jobs one at a time, in order, on one thread at a time, which exits when no
  job came for ``idle_s`` seconds (the server's ``Llama``, beside the slots' engine thread: without
  it, one request served there left its pool behind and the slots' steps slowed by 40%).

``OMP_WAIT_POLICY=ACTIVE`` avoids the slowdown too, but then idle workers spin for good: a server at rest
would keep every core busy.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


def run_in_own_thread(fn: Callable[..., Any], *args, name: str = "dflash-job") -> Any:
    """``fn(*args)`` on a new thread, joined: its result, or its exception raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as e:   # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


class SerialWorker:
    """Jobs in order, one at a time, on one thread at a time (a drop-in for a one-thread
    ``ThreadPoolExecutor``'s ``submit``): the thread exits ``idle_s`` seconds after its last job, and
    the next job starts a new one."""

    def __init__(self, idle_s: float = 2.0, name: str = "llama"):
        self.idle_s, self.name = idle_s, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pending = 0                 # jobs submitted and not yet taken (under _lock)
        self.threads_started = 0

    def submit(self, fn: Callable[..., Any], *args) -> Future:
        fut: Future = Future()
        with self._lock:
            self._jobs.put((fut, fn, args))
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self.name}-{self.threads_started}",
                                                daemon=True)
                self.threads_started += 1
                self._thread.start()
        return fut

    def _run(self) -> None:
        while True:
            try:
                fut, fn, args = self._jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if self._pending == 0:        # nothing came: this thread ends (a later job starts another)
                        self._thread = None
                        return
                continue                          # a job came in between: take it
            with self._lock:
                self._pending -= 1
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)

    def alive(self) -> bool:
        with self._lock:
            return self._thread is not None
