"""``python -m dflash_gguf.bench.serve``: servers under concurrent clients, ours beside upstream's llama-server.

For each pair and each client count C, every server is started on its own (one process, the same
threads, ``-np C`` slots), warmed up with one request, then C clients send ``--requests`` greedy
streamed ``/v1/completions`` of ``--tokens`` tokens between them. Reported per server: aggregate
completion tokens per second (all tokens over the wall time of the run), and p50 / p95 of the time to
first token and of the whole request. Servers:

* ``ours``            - ``python -m dflash_gguf.server -np C`` with the drafter (the speed gate on)
* ``ours-plain``      - the same with ``--no-dflash`` (our batched engine decoding plainly)
* ``ours-serial``     - ``python -m dflash_gguf.server -np 0`` (no slots): one request at a time through the
                        ``Llama`` (not in the default set)
* ``upstream``        - upstream ``llama-server -np C`` (plain)
* ``upstream-dflash`` - upstream ``llama-server -np C -md DRAFTER --spec-type draft-dflash``
* ``--engine``: also the batched engine alone in this process (no HTTP): C sequences of 2 x ``--tokens``
  tokens in one ``DFlashDecoder.generate_batch``, with the drafter (``engine``) and without

``--defaults``: every server as its own defaults start it - no ``-np`` (ours: 4 slots, upstream: ``-np -1``, 4
slots; both one KV cache of ``-c`` cells shared by the slots), ``-c`` the whole cache, not a slot's; the
client counts then only set the load, and each server is started once and measured at every count in turn.
Every run records the server's resident memory after it
(``rss_mib``) and its peak since start (``peak_rss_mib``, the kernel's VmHWM), from /proc.

Pairs: ``demo`` (the shipped trained pair), or ``bench.scale`` pairs by shape and type (e.g. ``0.6b:q4_0``;
random weights: a drafter that is never right, so the gate must decode plainly). ``--replay PROFILE``
(``demo``, ``strong``, ... as ``bench.scale`` takes them): ``ours`` runs as
``python -m dflash_gguf.bench.replay_server``, whose slots replay that acceptance over the benchmark's
prompts (the drafter still runs every step); the acceptance length each run got is read from its
``/metrics``. Upstream's servers have no such replay: ``upstream-dflash`` drafts with the drafter as it is. Upstream's server is
the one ``python -m dflash_gguf.build --with-tools`` built from the same patched tree.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

log = logging.getLogger("dflash_gguf.bench.serve")

SERVERS = ("ours", "ours-plain", "ours-serial", "upstream", "upstream-dflash")
DEFAULT_SERVERS = ("ours", "ours-plain", "upstream", "upstream-dflash")
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import json\n\ndef load(path):\n",
           "for i in range(10):\n", "def add(a, b):\n    return", "# sort a list\n", "while True:\n",
           "def parse(text):\n    tokens = []\n"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair_files(spec: str) -> tuple[Path, Path]:
    if spec == "demo":
        from dflash_gguf.demo import DEMO_DIR
        return DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
    from dflash_gguf.bench.scale import synth
    shape, _, rest = spec.partition(":")
    wtype, _, head = rest.partition(":")
    # SHAPE:TYPE:dvN - the drafter with a reduced head of N rows, as the converter writes by default
    if head and not (head.startswith("dv") and head[2:].isdigit()):
        raise SystemExit(f"pair {spec!r}: the third part is the drafter's head, dvN (e.g. dv32768)")
    d = synth.make_pair(shape, wtype or "q4_0")
    if head:
        d = synth.reduced_pair(d, int(head[2:]))
    return d / "target.gguf", d / "drafter.gguf"


def command(server: str, target: Path, drafter: Path, n_par: int, threads: int, ctx: int, port: int,
            replay: list[str] | None = None, defaults: bool = False) -> list[str]:
    """``replay``: the replay server's own flags (``--replay P --replay-prompts F --replay-tokens N``),
    taken by ``ours`` only. ``defaults``: no ``-np`` (each server's own default slots) and ``ctx`` the whole
    cache."""
    if server.startswith("ours"):
        module = "dflash_gguf.bench.replay_server" if replay and server == "ours" else "dflash_gguf.server"
        cmd = [sys.executable, "-m", module, "-m", str(target), "-md", str(drafter),
               "-t", str(threads), "-c", str(ctx), "--port", str(port), "--chat-format", "chatml"]
        if module != "dflash_gguf.server":
            cmd += replay
        if server == "ours-serial":
            cmd += ["-np", "0"]          # no slots: one request at a time through the Llama
        elif not defaults:
            cmd += ["-np", str(n_par)]
        return cmd + (["--no-dflash"] if server == "ours-plain" else [])
    from dflash_gguf import paths
    exe = Path(paths.tools_dir() or "") / "llama-server"
    if not exe.is_file():
        raise SystemExit(f"{exe} is missing: python -m dflash_gguf.build --with-tools builds it")
    cmd = [str(exe), "-m", str(target), "-t", str(threads), "-tb", str(threads),
           "--port", str(port), "--host", "127.0.0.1", "--no-webui"]
    cmd += ["-c", str(ctx)] if defaults else ["-np", str(n_par), "-c", str(ctx * n_par)]
    if server != "upstream-dflash":
        return cmd
    from dflash_gguf.bench.upstream import spec_type

    return cmd + ["-md", str(drafter), "--spec-type", spec_type(Path(drafter))]


def start(cmd: list[str], port: int, timeout: float = 900) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not answer /health within {timeout:.0f} s: {' '.join(cmd)}")


def one_request(url: str, prompt: str, n_tokens: int) -> tuple[float, float, int]:
    """(time to first token, whole request, completion tokens) of one greedy streamed completion."""
    t0 = time.perf_counter()
    first, n = None, 0
    body = {"prompt": prompt, "max_tokens": n_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                n = int(chunk["usage"]["completion_tokens"])
    total = time.perf_counter() - t0
    return (first if first is not None else total), total, n


def main_thread_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) the process's main thread has used, or None where /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def memory(pid: int) -> dict:
    """The process's resident memory now and its peak since start (MiB; empty where /proc cannot say)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    got = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            got["rss_mib" if key == "VmRSS" else "peak_rss_mib"] = int(value.split()[0]) / 1024
    return got


def run_clients(url: str, n_clients: int, n_requests: int, n_tokens: int) -> dict:
    jobs = list(range(n_requests))
    lock = threading.Lock()
    out: list[tuple[float, float, int]] = []

    def client():
        while True:
            with lock:
                if not jobs:
                    return
                i = jobs.pop(0)
            res = one_request(url, PROMPTS[i % len(PROMPTS)], n_tokens)
            with lock:
                out.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft, lat, toks = zip(*out)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    return {"tok_s": sum(toks) / wall, "tokens": sum(toks), "wall_s": wall,
            "ttft_p50": statistics.median(ttft), "ttft_p95": pct(ttft, 0.95),
            "lat_p50": statistics.median(lat), "lat_p95": pct(lat, 0.95)}


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def drafting_counts(url: str) -> tuple[float, float] | None:
    """(DFlash steps, accepted tokens) so far from our server's ``/metrics``; None from one without them."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    got = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("dflash_steps_total", "dflash_accepted_tokens_total"):
            got[name] = float(value)
    return (got["dflash_steps_total"], got["dflash_accepted_tokens_total"]) if len(got) == 2 else None


def _measure(proc: subprocess.Popen, url: str, n_clients: int, n_requests: int, n_tokens: int,
             ours: bool = False) -> dict:
    """One run of ``n_clients`` clients against a warm server, with its main thread's CPU per token
    (``ours``: and the acceptance length of the run's drafting steps)."""
    cpu0 = main_thread_cpu(proc.pid)
    d0 = drafting_counts(url) if ours else None
    r = run_clients(url, n_clients, max(n_requests, n_clients), n_tokens)
    cpu1 = main_thread_cpu(proc.pid)
    d1 = drafting_counts(url) if d0 is not None else None
    if cpu0 is not None and cpu1 is not None and r["tokens"]:
        # ours: the event loop's CPU per streamed token (taken from ggml's threads on these cores)
        r["main_ms_per_token"] = 1e3 * (cpu1 - cpu0) / r["tokens"]
    r.update(memory(proc.pid))
    if d0 is not None and d1 is not None:
        steps = d1[0] - d0[0]
        r["drafting_steps"] = steps
        if steps:
            r["acceptance_length"] = 1 + (d1[1] - d0[1]) / steps
    return r


def rotated(servers: list[str], rep: int) -> list[str]:
    """The order of repeat ``rep``: the list started ``rep`` places on (a server measured right after
    another one ran may run slower or faster for it: on this project's VMs the first of three servers
    up at once, always the one after the third, ran 3-7% below the second with the same engine)."""
    k = rep % len(servers) if servers else 0
    return list(servers[k:]) + list(servers[:k])


def bench(pair: str, servers: list[str], clients: list[int], n_requests: int, n_tokens: int, threads: int,
          ctx: int, repeats: int = 1, all_up: bool = False, replay: str | None = None,
          defaults: bool = False) -> list[dict]:
    """Every server at every client count, ``repeats`` times over in turn (the servers alternate, so a
    slow spell of the machine falls on all of them, and each repeat starts one server further down the
    list, so no server always runs right after the same one); one row per run (``run``: 0..repeats-1).

    ``all_up``: at each client count every server is started (and warmed up) once and stays up while the
    others run, so that the runs alternate within seconds, not a server start apart (on a VM whose speed
    swings within minutes, that is what makes a few percent visible); otherwise each run has a fresh
    server, started after the last one stopped. ``replay``: the acceptance profile ``ours`` replays."""
    target, drafter = pair_files(pair)
    rows = []
    flags = None
    if replay:                 # the replay server's flags: the profile, this tool's prompts, the tokens
        import tempfile

        book = Path(tempfile.mkdtemp(prefix="dflash-serve-")) / "prompts.json"
        book.write_text(json.dumps(PROMPTS))
        flags = ["--replay", replay, "--replay-prompts", str(book), "--replay-tokens", str(n_tokens)]

    def up(server: str, c: int) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        log.info("%s, %d client(s): starting %s", pair, c, server)
        proc = start(command(server, target, drafter, c, threads, ctx, port, flags, defaults), port)
        url = f"http://127.0.0.1:{port}"
        try:
            one_request(url, PROMPTS[0], 4)   # warm-up (and the gate's calibration, ours)
        except BaseException:
            _stop(proc)
            raise
        return proc, url

    def record(c: int, rep: int, server: str, r: dict) -> None:
        rows.append({"pair": pair + (f" (ours replaying {replay})" if replay else ""), "clients": c,
                     "server": server, "run": rep, **{k: round(v, 4) for k, v in r.items()}})
        log.info("  %s: %.1f tok/s, ttft p50 %.0f ms, request p50 %.0f ms, main thread %.3f ms CPU a token%s", server,
                 r["tok_s"], 1e3 * r["ttft_p50"], 1e3 * r["lat_p50"], r.get("main_ms_per_token", float("nan")),
                 f", acceptance length {r['acceptance_length']:.2f} over {r['drafting_steps']:.0f} drafting steps"
                 if "acceptance_length" in r else "")
        if "peak_rss_mib" in r:
            log.info("  %s: resident %.0f MiB, peak %.0f MiB", server, r["rss_mib"], r["peak_rss_mib"])

    try:
        if defaults:
            # every server's command is the same at every client count: each started once, measured at every count
            # in turn (its peak memory is then the peak so far)
            for rep in range(repeats):
                for server in rotated(servers, rep):
                    proc, url = up(server, clients[0])
                    try:
                        for c in clients:
                            record(c, rep, server, _measure(proc, url, c, n_requests, n_tokens, server == "ours"))
                    finally:
                        _stop(proc)
            return rows
        for c in clients:
            if all_up:
                procs: dict[str, tuple[subprocess.Popen, str]] = {}
                try:
                    for server in servers:
                        procs[server] = up(server, c)
                    for rep in range(repeats):
                        for server in rotated(servers, rep):
                            proc, url = procs[server]
                            record(c, rep, server, _measure(proc, url, c, n_requests, n_tokens, server == "ours"))
                finally:
                    for proc, _ in procs.values():
                        _stop(proc)
                continue
            for rep in range(repeats):
                for server in rotated(servers, rep):
                    proc, url = up(server, c)
                    try:
                        r = _measure(proc, url, c, n_requests, n_tokens, server == "ours")
                    finally:
                        _stop(proc)
                    record(c, rep, server, r)
    finally:
        if flags:
            shutil.rmtree(Path(flags[3]).parent, ignore_errors=True)
    return rows


def engine_only(pair: str, clients: list[int], n_tokens: int, threads: int, ctx: int) -> list[dict]:
    """The batched engine in this process, no HTTP: C sequences of ``n_tokens`` greedy tokens each in one
    ``generate_batch`` (plain and with the drafter), after a warm-up batch."""
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, Request, SpecOptions

    target, drafter = pair_files(pair)
    tm, dm = Model(target), Model(drafter)
    rows = []
    try:
        for c in clients:
            opts = ContextOptions(n_ctx=ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_seq=c)
            for mode in ("engine", "engine-plain"):
                tc = Context(tm, opts)
                dc = Context(dm, opts, other=tc) if mode == "engine" else None
                try:
                    dec = DFlashDecoder(tc, dc, SpecOptions(adaptive=True))
                    reqs = lambda c=c: [Request(tm.tokenize(PROMPTS[i % len(PROMPTS)].encode()), n_tokens,  # noqa: E731
                                                stop_tokens=[]) for i in range(c)]
                    dec.generate_batch(reqs())
                    rs = reqs()
                    t0 = time.perf_counter()
                    n = sum(map(len, dec.generate_batch(rs)))
                    wall = time.perf_counter() - t0
                finally:
                    for x in (dc, tc):
                        if x is not None:
                            x.close()
                rows.append({"pair": pair, "clients": c, "server": mode, "tok_s": round(n / wall, 2),
                             "tokens": n, "wall_s": round(wall, 3)})
                log.info("%s, %d sequence(s), %s: %.1f tok/s", pair, c, mode, n / wall)
    finally:
        dm.close()
        tm.close()
    return rows


def cpu_name() -> str:
    """The CPU's model name (for every figure's label)."""
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def medians(rows: list[dict]) -> list[dict]:
    """One row per pair, client count and server: the median of its runs, figure by figure."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["pair"], r["clients"], r["server"]), []).append(r)
    out = []
    for (pair, c, server), rs in groups.items():
        m = {"pair": pair, "clients": c, "server": server, "runs": len(rs)}
        for k in rs[0]:
            if k not in m and k != "run" and all(isinstance(x.get(k), (int, float)) for x in rs):
                m[k] = statistics.median(x[k] for x in rs)
        out.append(m)
    return out


def table(rows: list[dict], servers: list[str]) -> str:
    head = "| pair | clients | " + " | ".join(f"{s} tok/s" + ("" if s.startswith("engine") else " (ttft / request p50, ms)")
                                             for s in servers)
    ratio = "ours / upstream" if "ours" in servers and "upstream" in servers else None
    lines = [head + (f" | {ratio} |" if ratio else " |"), "|---" * (2 + len(servers) + (1 if ratio else 0)) + "|"]
    keys = sorted({(r["pair"], r["clients"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for pair, c in keys:
        by = {r["server"]: r for r in rows if r["pair"] == pair and r["clients"] == c}
        cells = []
        for s in servers:
            r = by.get(s)
            tau = f", acceptance {r['acceptance_length']:.2f}" if r is not None and "acceptance_length" in r else ""
            cells.append("-" if r is None else f"{r['tok_s']:.1f}" if "ttft_p50" not in r else
                         f"{r['tok_s']:.1f} ({1e3 * r['ttft_p50']:.0f} / {1e3 * r['lat_p50']:.0f}{tau})")
        line = f"| {pair} | {c} | " + " | ".join(cells)
        if ratio:
            best = max((by[s]["tok_s"] for s in ("upstream", "upstream-dflash") if s in by), default=None)
            line += f" | {by['ours']['tok_s'] / by['upstream']['tok_s']:.2f}x (vs best {by['ours']['tok_s'] / best:.2f}x)" \
                if "ours" in by and "upstream" in by and best else " | -"
        lines.append(line + " |")
    return "\n".join(lines)


def memory_table(rows: list[dict], servers: list[str]) -> str:
    """Each server's resident memory after its runs and its peak since start (MiB), per client count."""
    if not any("peak_rss_mib" in r for r in rows):
        return ""
    lines = ["| pair | clients | " + " | ".join(f"{s} RSS / peak MiB" for s in servers) + " |",
             "|---" * (2 + len(servers)) + "|"]
    for pair, c in sorted({(r["pair"], r["clients"]) for r in rows}):
        by = {r["server"]: r for r in rows if r["pair"] == pair and r["clients"] == c}
        cells = [f"{by[s]['rss_mib']:.0f} / {by[s]['peak_rss_mib']:.0f}" if s in by and "peak_rss_mib" in by[s] else "-"
                 for s in servers]
        lines.append(f"| {pair} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", nargs="+", default=["demo"],
                    help="demo and/or scale pairs SHAPE:TYPE[:dvN] (e.g. 0.6b:q4_0; 1.7b:q4_0:dv32768 for the "
                         "drafter with a reduced head of 32,768 rows)")
    ap.add_argument("--servers", nargs="+", default=list(DEFAULT_SERVERS), choices=SERVERS)
    ap.add_argument("--clients", default="1,2,4,8", help="concurrent client counts (each server runs -np C)")
    ap.add_argument("--requests", type=int, default=8, help="requests per run (at least one per client)")
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per request")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024, help="context per slot (--defaults: the whole cache)")
    ap.add_argument("--out", type=Path, default=None, help="write TAG.json and TAG.md here")
    ap.add_argument("--tag", default="serve")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every server per client count, alternating; the table shows their medians")
    ap.add_argument("--all-up", action="store_true",
                    help="keep every server of a client count up at once, warmed once, and alternate the runs "
                         "between them (default: a fresh server per run)")
    ap.add_argument("--replay", default=None, metavar="PROFILE",
                    help="ours replays this acceptance profile (demo, demo-dspark, strong, none, p1,p2,...) over this tool's "
                         "prompts in its slots (python -m dflash_gguf.bench.replay_server); default: the drafter's own")
    ap.add_argument("--defaults", action="store_true",
                    help="start every server with its own default slots (no -np: 4 sharing one cache, ours and "
                         "upstream's) and -c as the whole cache; the client counts set only the load")
    ap.add_argument("--engine", action="store_true",
                    help="also time the batched engine in this process (no HTTP): C sequences in one generate_batch")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    clients = [int(x) for x in a.clients.split(",")]
    rows = []
    servers = list(a.servers)
    for pair in a.pairs:
        rows += bench(pair, a.servers, clients, a.requests, a.tokens, a.threads, a.ctx_size, a.repeats, a.all_up,
                      a.replay, a.defaults)
        if a.engine:
            rows += engine_only(pair, clients, 2 * a.tokens, a.threads, a.ctx_size)
    if a.engine:
        servers += ["engine", "engine-plain"]
    cpu = cpu_name()
    cmd = "python -m dflash_gguf.bench.serve " + " ".join(argv if argv is not None else sys.argv[1:])
    md = (f"Server benchmark. {cmd}\n\nMachine: {cpu}, {os.cpu_count()} cores; {a.threads} threads per server; "
          f"{a.requests} greedy streamed requests of {a.tokens} tokens per run"
          f"{f'; medians of {a.repeats} alternating runs' if a.repeats > 1 else ''}"
          f"{' (all servers up at once)' if a.all_up else ''}"
          f"{'; every server with its default slots, -c the whole cache' if a.defaults else ''}."
          f"\n\n{table(medians(rows), servers)}\n")
    mem = memory_table(medians(rows), [s for s in servers if not s.startswith("engine")])
    if mem:
        md += f"\nResident memory after each server's runs / its peak since start (MiB, /proc VmRSS / VmHWM):\n\n{mem}\n"
    print(md)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / f"{a.tag}.json").write_text(json.dumps(rows, indent=1))
        (a.out / f"{a.tag}.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
