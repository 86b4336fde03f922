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
