"""A/B of two checkouts' servers (`-np 1`, a scale pair's never-right drafter): slots' tokens/s cold, then
after one request the slots do not serve (an echoed prompt's logprobs, run on the server's Llama; the
servers run with --logits-all), 3 s later.

    python bench/fallback_ab.py OLD_CHECKOUT [PAIR [REPEATS]]     # e.g. a git worktree of an older commit

BENCHMARKS.md section 21."""
import os
import statistics
import subprocess
import sys
import time

import httpx

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from dflash_gguf.bench import serve as S  # noqa: E402

old_root = sys.argv[1]
pair = sys.argv[2] if len(sys.argv) > 2 else "0.6b:q4_0"
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
target, drafter = S.pair_files(pair)
res = {}
for rep in range(reps):
    for code, root in (("old", old_root), ("new", HERE)):
        port = S._free_port()
        env = dict(os.environ, PYTHONPATH=root)
        cmd = S.command("ours", target, drafter, 1, 2, 1024, port) + ["--logits-all"]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
        deadline = time.time() + 240
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.time() < deadline
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        S.one_request(url, S.PROMPTS[0], 4)
        cold = S._measure(proc, url, 1, 8, 32)["tok_s"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 8, "echo": True, "logprobs": 1,
                                                     "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        time.sleep(3)
        nthreads = len(os.listdir(f"/proc/{proc.pid}/task"))
        after = S._measure(proc, url, 1, 8, 32)["tok_s"]
        S._stop(proc)
        res.setdefault(code, []).append((cold, after, nthreads))
        print(rep, code, f"cold {cold:.1f} after-fallback {after:.1f} threads {nthreads}", flush=True)
for code, v in res.items():
    print(code, "median cold %.1f after %.1f" % (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)))
