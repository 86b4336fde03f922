"""Bytes and time per DFlash step with the target split across two local rpc-servers, vs local.

    python -m dflash_gguf.bench.rpc                      # the cached 0.6b q4_0 scale pair
    python -m dflash_gguf.bench.rpc --pair DIR --tokens 64 --trials 3

Two ``rpc-server`` processes on 127.0.0.1 hold the target's layers half and half (``tensor_split``
1,1); the drafter is local. Each trial runs, alternately, the same greedy request locally and over
RPC, DFlash with a fixed draft length (no speed gate) and plain. Bytes are the servers' TCP traffic,
read from the kernel's counters for their connections (``ss -ti``: bytes_received, client to
server; bytes_sent, server to client), divided by the target passes (verify steps) of the request.
Loopback has no network latency: over a real link add one round trip per server crossing per pass.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

from dflash_gguf import paths

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _traffic(endpoint: str) -> tuple[int, int]:
    """(bytes received, bytes sent) by the server side of the connections to ``endpoint``."""
    port = endpoint.rpartition(":")[2]
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    rx = sum(int(v) for v in re.findall(r"bytes_received:(\d+)", out))
    tx = sum(int(v) for v in re.findall(r"bytes_sent:(\d+)", out))
    return rx, tx


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(n: int, threads: int) -> tuple[list[subprocess.Popen], list[str]]:
    from dflash_gguf.native import rpc
    from dflash_gguf.errors import RpcConnectError

    exe = rpc.server_binary()
    if exe is None:
        raise SystemExit("rpc-server (ggml-rpc-server) is not built: python -m dflash_gguf.build --with-tools")
    procs, eps = [], []
    for _ in range(n):
        port = _free_port()
        procs.append(subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        eps.append(f"127.0.0.1:{port}")
    for ep in eps:
        for _ in range(300):
            try:
                rpc.probe(ep, timeout=2)
                break
            except RpcConnectError:
                time.sleep(0.1)
    return procs, eps


def measure(llm, eps, tokens: int, dflash: bool) -> dict:
    before = [_traffic(ep) for ep in eps]
    t0 = time.perf_counter()
    out = llm.create_completion(PROMPT, max_tokens=tokens, temperature=0.0, dflash=dflash)
    wall = time.perf_counter() - t0
    after = [_traffic(ep) for ep in eps]
    n = out["usage"]["completion_tokens"]
    st = llm.last_dflash_stats
    passes = st.passes if (dflash and st is not None) else n
    to_srv = sum(a[0] - b[0] for a, b in zip(after, before))
    from_srv = sum(a[1] - b[1] for a, b in zip(after, before))
    return dict(tokens=n, passes=passes, wall_s=wall, ms_per_pass=1e3 * wall / max(passes, 1),
                tok_s=n / wall, kib_to_servers_per_pass=to_srv / 1024 / max(passes, 1),
                kib_from_servers_per_pass=from_srv / 1024 / max(passes, 1),
                tau=(st.tau if (dflash and st is not None) else 1.0), text=out["choices"][0]["text"])


def _range(rows: list[dict], key: str, fmt: str = "{:.1f}") -> str:
    vals = [r[key] for r in rows]
    return fmt.format(min(vals)) + ("" if len(vals) == 1 else "-" + fmt.format(max(vals)))


def main(argv=None) -> None:
    from dflash_gguf import Llama

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.rpc", description=__doc__.split("\n")[0])
    ap.add_argument("--pair", default=str(paths.cache_dir() / "scale-pairs" / "qwen3-0.6b-q4_0-s0-v1"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="threads of the client and of each rpc-server")
    ap.add_argument("--draft-max", type=int, default=None, help="tokens drafted per step (default: block - 1)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    args = ap.parse_args(argv)
    pair = Path(args.pair)
    target, drafter = str(pair / "target.gguf"), str(pair / "drafter.gguf")
    kw = dict(n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, seed=0, verbose=False,
              draft_model_path=drafter, draft_adaptive=False, draft_n_max=args.draft_max)
    procs, eps = start_servers(2, args.threads)
    rows = []
    try:
        local = Llama(target, **kw)
        remote = Llama(target, rpc_servers=eps, tensor_split=[1, 1], **kw)
        for llm in (local, remote):   # warm-up (first-use allocations, page-in)
            measure(llm, eps, 8, True)
        for trial in range(args.trials):
            order = (("local", local), ("rpc", remote)) if trial % 2 == 0 else (("rpc", remote), ("local", local))
            for name, llm in order:
                for dflash in (True, False):
                    r = measure(llm, eps, args.tokens, dflash)
                    r.update(where=name, mode="dflash" if dflash else "plain", trial=trial)
                    rows.append(r)
                    print(f"trial {trial} {name:5s} {r['mode']:6s} {r['tokens']:3d} tok {r['passes']:3d} passes "
                          f"{r['ms_per_pass']:7.1f} ms/pass {r['tok_s']:6.2f} tok/s tau {r['tau']:.2f} "
                          f"to servers {r['kib_to_servers_per_pass']:8.1f} KiB/pass "
                          f"from servers {r['kib_from_servers_per_pass']:8.1f} KiB/pass", flush=True)
        same = {r["text"] for r in rows}
        print(f"greedy texts identical across local/rpc/dflash/plain: {len(same) == 1}")
        local.close()
        remote.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    summary: dict = {}
    for r in rows:
        summary.setdefault((r["where"], r["mode"]), []).append(r)
    print("\n| where | mode | ms per target pass | tok/s | KiB to servers per pass | KiB from servers per pass |")
    print("|---|---|---|---|---|---|")
    for (where, mode), rs in sorted(summary.items()):
        print(f"| {where} | {mode} | {_range(rs, 'ms_per_pass')} | {_range(rs, 'tok_s', '{:.2f}')} | "
              f"{_range(rs, 'kib_to_servers_per_pass')} | {_range(rs, 'kib_from_servers_per_pass')} |")
    print(f"\nCPU: {os.cpu_count()} cores; pair {pair.name}; {args.tokens} tokens; servers -t {args.threads}")


if __name__ == "__main__":
    main()
