"""Server soak: mixed concurrent traffic against a loopback server with a DFlash pair.

    python -m dflash_gguf.reliability.server_soak            # CI size: 96 requests, max_tokens <= 64
    python -m dflash_gguf.reliability.server_soak --full     # 500 requests, max_tokens 1..256

``--clients`` (default 8) threads send a seeded mix to ``python -m dflash_gguf.server`` on
127.0.0.1 (a child process): completions and chat, streamed and not, stop strings, max_tokens,
greedy and seeded sampling, unicode and byte-fallback text, and hostile traffic - malformed JSON,
wrong types, unknown fields, prompts longer than the context, clients that disconnect mid-stream
and clients that send half a body and hang up. Meanwhile a monitor polls ``/health``.

Checks:

* no response with a 5xx status; every bad request gets a 400;
* ``/health`` answered (200) every time it was polled, during the whole run;
* every good request's text (and finish reason) equals what the same request gives on a fresh
  server, replayed one at a time in another order (no cross-talk, no state carried over);
* the server's RSS after the run is within 5% of its RSS after warm-up;
* ``/metrics`` adds up: per-status request counts and completion tokens match what the clients saw.
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import queue
import random
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_gguf import paths
from dflash_gguf.reliability.soak import gen_text

log = logging.getLogger("dflash_gguf.reliability.server_soak")

DEMO_DIR = paths.DEMO_DIR
HOST = "127.0.0.1"
N_CTX = 512


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Server:
    """``python -m dflash_gguf.server`` in a child process on a free loopback port."""

    def __init__(self, pair: Path, log_path: Path, *, plain: bool = False, parallel: int | None = None):
        self.port = free_port()
        self.log = open(log_path, "ab")
        cmd = [sys.executable, "-m", "dflash_gguf.server", "--pair", str(pair), "--host", HOST, "--port",
               str(self.port), "-t", "1", "--n-ctx", str(N_CTX)] + (["--no-dflash"] if plain else []) \
            + ([] if parallel is None else ["--parallel", str(parallel)])
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} (log: {log_path})")
            try:
                if request(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server did not answer /health within 120 s (log: {log_path})")

    def rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


def request(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 300.0):
    """(status, parsed JSON or text) of one plain request."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request(method, path, body=body, headers={"Content-Type": "application/json"} if body is not None else {})
        r = c.getresponse()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, data.decode("utf-8", "replace")
    finally:
        c.close()


def stream(port: int, path: str, body: bytes, timeout: float = 300.0, disconnect_after: int | None = None):
    """(status, chunks) of an SSE request; ``disconnect_after``: hang up after that many events."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            data = r.read()
            try:
                return r.status, json.loads(data)
            except ValueError:
                return r.status, data.decode("utf-8", "replace")
        chunks = []
        while True:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            payload = line[6:]
            if payload == b"[DONE]":
                chunks.append("[DONE]")
                break
            chunks.append(json.loads(payload))
            if disconnect_after is not None and len(chunks) >= disconnect_after:
                c.sock.shutdown(socket.SHUT_RDWR)
                break
        return 200, chunks
    finally:
        c.close()


def half_body(port: int, body: bytes) -> None:
    """Send the headers and half of the body, then hang up."""
    with socket.create_connection((HOST, port), timeout=10) as s:
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        s.sendall(head + body[: len(body) // 2])
        time.sleep(0.05)


# --------------------------------------------------------------------------- traffic
@dataclass
class Req:
    id: int
    kind: str              # good | bad | drop_stream | drop_request
    endpoint: str
    body: dict | None
    raw: bytes | None = None
    stream: bool = False
    expect: int = 200


@dataclass
class Result:
    req: Req
    status: int
    text: str | None = None
    finish: str | None = None
    tokens: int = 0
    error: str | None = None
    seconds: float = 0.0
    counted: bool = False  # the client saw the final chunk (the server counts the request's tokens then)


_ODD = ["é", "ß", "→", "日本語", "😀", "\u200b", "Ω", "\u0800", "🧪🧬", "\ufffd", "Ⅻ", "ﬁ"]


def _text(rng: random.Random) -> str:
    t = gen_text(rng, rng.randint(2, 40))
    if rng.random() < 0.35:   # characters the tiny vocabulary only has as byte-fallback pieces
        t += "".join(rng.choice(_ODD) for _ in range(rng.randint(1, 4)))
    return t


def make_requests(n: int, seed: int, max_tokens: int) -> list[Req]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        r = rng.random()
        chat = rng.random() < 0.4
        ep = "/v1/chat/completions" if chat else "/v1/completions"
        mt = rng.choice([1, 2, rng.randint(1, max_tokens), rng.randint(1, max_tokens), rng.randint(1, max(1, max_tokens // 4))])
        body: dict = {"max_tokens": mt}
        if chat:
            msgs = [{"role": "user", "content": _text(rng)}]
            if rng.random() < 0.3:
                msgs = [{"role": "system", "content": _text(rng)}] + msgs
            body["messages"] = msgs
        else:
            body["prompt"] = _text(rng)
        if rng.random() < 0.25:
            body.update(temperature=0.8, seed=rng.randrange(10_000))
        else:
            body["temperature"] = 0
        if rng.random() < 0.3:
            body["stop"] = rng.choice(["\n", ")", [":", "def"], "  ", ["(", "]"]])
        st = rng.random() < 0.5
        body["stream"] = st
        if r < 0.72:
            out.append(Req(i, "good", ep, body, stream=st))
        elif r < 0.77:
            out.append(Req(i, "bad", ep, None, raw=json.dumps(body).encode()[:-3] + b"}{", expect=400))
        elif r < 0.82:
            bad = dict(body)
            bad.update(rng.choice([{"max_tokens": "ten"}, {"temperature": "hot"}, {"stop": 5}, {"stream": [1]},
                                   {"max_tokens": 0}, {"frobnicate": 1}, {"n": 3}]))
            out.append(Req(i, "bad", ep, bad, stream=False, expect=400))
        elif r < 0.86:
            big = dict(body, stream=False)
            long = " ".join(rng.choice(["alpha", "beta", "gamma"]) for _ in range(3 * N_CTX))
            if chat:
                big["messages"] = [{"role": "user", "content": long}]
            else:
                big["prompt"] = long
            out.append(Req(i, "bad", ep, big, expect=400))
        elif r < 0.95:
            body.update(stream=True, max_tokens=max(8, mt))
            out.append(Req(i, "drop_stream", ep, body, stream=True))
        else:
            out.append(Req(i, "drop_request", "/v1/completions", body, expect=0))
    return out


def send(port: int, q: Req, rng: random.Random) -> Result:
    t0 = time.monotonic()
    raw = q.raw if q.raw is not None else json.dumps(q.body).encode()
    try:
        if q.kind == "drop_request":
            half_body(port, raw)
            return Result(q, 0, seconds=time.monotonic() - t0)
        if q.stream:
            drop = rng.randint(1, 3) if q.kind == "drop_stream" else None
            status, chunks = stream(port, q.endpoint, raw, disconnect_after=drop)
            if status != 200:
                return Result(q, status, error=str(chunks)[:300], seconds=time.monotonic() - t0)
            text, finish, tokens = [], None, 0
            for c in chunks:
                if c == "[DONE]":
                    continue
                ch = c["choices"][0] if c.get("choices") else {}
                text.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                if ch.get("finish_reason") is not None:
                    finish = ch["finish_reason"]
                    tokens = (c.get("usage") or {}).get("completion_tokens") or (c.get("dflash") or {}).get("n_generated", 0)
            done = bool(chunks) and chunks[-1] == "[DONE]"
            return Result(q, 200, "".join(text), finish if done else None, tokens, seconds=time.monotonic() - t0,
                          counted=finish is not None)
        status, data = request(port, "POST", q.endpoint, raw)
        if status != 200:
            return Result(q, status, error=str(data)[:300], seconds=time.monotonic() - t0)
        ch = data["choices"][0]
        text = ch.get("text") if "text" in ch else (ch.get("message") or {}).get("content")
        usage = data.get("usage") or {}
        tokens = usage.get("completion_tokens") if usage else (data.get("dflash") or {}).get("n_generated", 0)
        return Result(q, status, text, ch.get("finish_reason"), tokens or 0, seconds=time.monotonic() - t0, counted=True)
    except (OSError, http.client.HTTPException) as e:
        return Result(q, -1, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0)
    except (KeyError, IndexError, TypeError, ValueError) as e:   # a 200 whose body is not what the API promises
        return Result(q, -2, error=f"malformed response: {type(e).__name__}: {e}", seconds=time.monotonic() - t0)


class Monitor(threading.Thread):
    """Polls /health every ``every`` seconds; records failures and the slowest answer."""

    def __init__(self, port: int, every: float = 0.25):
        super().__init__(daemon=True)
        self.port, self.every = port, every
        self.polls = self.failures = 0
        self.slowest = 0.0
        self.halt = threading.Event()

    def run(self):
        while not self.halt.is_set():
            t0 = time.monotonic()
            try:
                ok = request(self.port, "GET", "/health", timeout=10)[0] == 200
            except OSError:
                ok = False
            self.slowest = max(self.slowest, time.monotonic() - t0)
            self.polls += 1
            self.failures += not ok
            self.halt.wait(self.every)


def run_traffic(port: int, reqs: list[Req], clients: int, seed: int) -> list[Result]:
    q: queue.Queue = queue.Queue()
    for r in reqs:
        q.put(r)
    results: list[Result] = []
    lock = threading.Lock()

    def client(k: int):
        rng = random.Random(seed * 100 + k)
        while True:
            try:
                r = q.get_nowait()
            except queue.Empty:
                return
            res = send(port, r, rng)
            with lock:
                results.append(res)
    ts = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sorted(results, key=lambda r: r.req.id)


def metrics(port: int) -> dict:
    status, data = request(port, "GET", "/metrics?format=json")
    if status != 200 or not isinstance(data, dict):
        raise RuntimeError(f"/metrics answered {status}: {str(data)[:200]}")
    return data


def replay(pair: Path, results: list[Result], log_path: Path, label: str, *, plain: bool = False) -> list[dict]:
    """Send each of ``results``' requests, one at a time in that order, to a fresh server (``plain``:
    decoding plainly); the ones whose text or finish reason differ from what the soak got."""
    srv = Server(pair, log_path, plain=plain)
    try:
        again = {r.req.id: send(srv.port, r.req, random.Random(0)) for r in results}
    finally:
        srv.stop()
    return [{"id": r.req.id, "endpoint": r.req.endpoint, "body": r.req.body, "soak": r.text, label: again[r.req.id].text,
             "soak_finish": r.finish, f"{label}_finish": again[r.req.id].finish}
            for r in results if (r.text, r.finish) != (again[r.req.id].text, again[r.req.id].finish)]


def run(pair: Path, n_requests: int, clients: int, max_tokens: int, *, seed: int = 0, warmup: int = 24,
        work: Path | None = None, parallel: int | None = None) -> dict:
    """The soak against a server with ``parallel`` slots (None: one request at a time). With slots, the
    sampled requests the batched engine served are compared for their count only: a seed's text depends
    on the batch around it there (the drafts do), its distribution does not (tests/test_batch.py)."""
    work = work or Path(os.environ.get("TMPDIR", "/tmp"))
    t0 = time.monotonic()
    reqs = make_requests(n_requests, seed, max_tokens)
    srv = Server(pair, work / "server-soak.log", parallel=parallel)
    try:
        warm = [r for r in make_requests(warmup * 3, seed + 999, max_tokens) if r.kind == "good"][:warmup]
        run_traffic(srv.port, warm, clients, seed + 999)
        m0 = metrics(srv.port)
        rss0 = srv.rss()
        mon = Monitor(srv.port)
        mon.start()
        results = run_traffic(srv.port, reqs, clients, seed)
        time.sleep(0.5)
        mon.halt.set()
        mon.join()
        time.sleep(0.5)
        rss1 = srv.rss()
        m1 = metrics(srv.port)
    finally:
        rc = srv.stop()
    soak_s = time.monotonic() - t0
    # replay every good request alone on a fresh server, in another order
    good = [r for r in results if r.req.kind == "good" and r.status == 200]
    if parallel is not None:
        good = [r for r in good if r.req.body.get("temperature") == 0]
    order = list(good)
    random.Random(seed + 1).shuffle(order)
    mismatches = replay(pair, order, work / "server-soak-fresh.log", "alone")
    # and every greedy one on a server decoding plainly (the same pair, --no-dflash): what DFlash under
    # load returned is the target's own text (sampled requests are the same distribution, not the same
    # draws, so they are compared with DFlash alone only)
    greedy = [r for r in order if r.req.body.get("temperature") == 0]
    plain_mismatches = replay(pair, greedy, work / "server-soak-plain.log", "plain", plain=True)
    # /metrics arithmetic over the soak window
    def count(m, status):
        return sum(x["count"] for x in m["requests"] if x["status"] == status and x["endpoint"] != "/health")
    seen = {s: sum(1 for r in results if r.status == s) for s in (200, 400)}
    n_half = sum(r.req.kind == "drop_request" for r in results)
    n_drop = sum(r.req.kind == "drop_stream" for r in results)
    completed = [r for r in results if r.status == 200 and r.counted]
    m_200, m_400 = count(m1, 200) - count(m0, 200), count(m1, 400) - count(m0, 400)
    m_tokens = m1["completion_tokens"] - m0["completion_tokens"]
    c_tokens = sum(r.tokens for r in completed)
    m_disc = m1["client_disconnects"] - m0["client_disconnects"]
    gens = lambda m: m["dflash_requests"] + m["plain_requests"]   # noqa: E731
    m_gens = gens(m1) - gens(m0)
    # a stream whose client hangs up: the server notices at its next chunk (a disconnect), or its
    # generation reaches the end first (counted as a generation, and then maybe also as a disconnect);
    # the client cannot tell which, so these bound the counters instead of fixing them
    gone = [r for r in results if r.req.kind == "drop_stream" and not r.counted]
    late = m_gens - len(completed)
    late_max = sum(r.req.body["max_tokens"] for r in gone)
    fives = [r for r in results if r.status >= 500]
    wrong_status = [r for r in results if (r.req.kind in ("good", "bad") and r.status != r.req.expect) or r.status == -2]
    rep = {
        "requests": len(results), "clients": clients, "max_tokens": max_tokens, "seed": seed, "parallel": parallel,
        "kinds": {k: sum(r.req.kind == k for r in results) for k in ("good", "bad", "drop_stream", "drop_request")},
        "streamed": sum(r.req.stream for r in results if r.req.kind == "good"),
        "chat": sum(r.req.endpoint.endswith("chat/completions") for r in results if r.req.kind == "good"),
        "status_5xx": len(fives), "wrong_status": [{"id": r.req.id, "kind": r.req.kind, "status": r.status,
                                                   "error": r.error} for r in wrong_status],
        "health": {"polls": mon.polls, "failures": mon.failures, "slowest_s": round(mon.slowest, 3)},
        "rss_after_warmup_mib": round(rss0 / 2 ** 20, 1), "rss_after_mib": round(rss1 / 2 ** 20, 1),
        "rss_change_pct": round(100.0 * (rss1 - rss0) / rss0, 2) if rss0 else None,
        "replayed": len(good), "mismatches": mismatches,
        "replayed_plain": len(greedy), "plain_mismatches": plain_mismatches,
        "metrics": {"200": [m_200, seen[200]], "400": [m_400, seen[400], n_half], "completion_tokens": [m_tokens, c_tokens],
                    "client_disconnects": [m_disc, n_drop], "generations": [m_gens, len(completed)],
                    "late_hangups": late, "hangups": len(gone)},
        "server_exit": rc, "seconds": round(soak_s, 1), "seconds_total": round(time.monotonic() - t0, 1),
        "tokens": c_tokens,
    }
    rep["metrics_ok"] = (m_200 == seen[200] and seen[400] <= m_400 <= seen[400] + n_half and 0 <= m_disc <= n_drop
                         and 0 <= late <= len(gone) and m_disc + late >= len(gone)
                         and (m_tokens == c_tokens if late == 0 else c_tokens < m_tokens <= c_tokens + late_max))
    rep["ok"] = (not fives and not wrong_status and not mismatches and not plain_mismatches and mon.failures == 0
                 and rep["metrics_ok"]
                 and rep["rss_change_pct"] is not None and abs(rep["rss_change_pct"]) <= 5.0)
    return rep


def summary(rep: dict) -> str:
    k = rep["kinds"]
    m = rep["metrics"]
    return "\n".join([
        f"{rep['requests']} requests from {rep['clients']} clients"
        f"{'' if rep.get('parallel') is None else ' to ' + str(rep['parallel']) + ' slots'} in {rep['seconds']} s "
        f"(max_tokens <= {rep['max_tokens']}): "
        f"{k['good']} good ({rep['streamed']} streamed, {rep['chat']} chat), {k['bad']} bad, {k['drop_stream']} "
        f"disconnects mid-stream, {k['drop_request']} mid-request; {rep['tokens']} tokens",
        f"  5xx responses: {rep['status_5xx']}; wrong status: {len(rep['wrong_status'])}",
        f"  /health: {rep['health']['polls']} polls, {rep['health']['failures']} failures, "
        f"slowest {rep['health']['slowest_s']} s",
        f"  replay alone on a fresh server: {rep['replayed']} requests, {len(rep['mismatches'])} mismatches",
        f"  greedy ones on a plain (--no-dflash) server: {rep['replayed_plain']} requests, "
        f"{len(rep['plain_mismatches'])} mismatches",
        f"  RSS {rep['rss_after_warmup_mib']} MiB after warm-up -> {rep['rss_after_mib']} MiB after the run "
        f"({rep['rss_change_pct']:+.2f}%)",
        f"  /metrics vs clients: 200 {m['200'][0]}/{m['200'][1]}, 400 {m['400'][0]}/{m['400'][1]} (+<= {m['400'][2]} "
        f"half bodies), generations {m['generations'][0]}/{m['generations'][1]} and completion tokens "
        f"{m['completion_tokens'][0]}/{m['completion_tokens'][1]} (+ {m['late_hangups']} of {m['hangups']} hung-up "
        f"streams that ran to their end), disconnects {m['client_disconnects'][0]} (of {m['client_disconnects'][1]} "
        f"mid-stream hang-ups) -> "
        f"{'adds up' if rep['metrics_ok'] else 'DOES NOT ADD UP'}",
        f"  => {'OK' if rep['ok'] else 'FAILED'}",
    ])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.reliability.server_soak", description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, default=DEMO_DIR)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--full", action="store_true", help="500 requests, max_tokens up to 256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--parallel", type=int, default=None, metavar="N",
                    help="soak a server with N slots (--parallel N); greedy responses replayed alone")
    args = ap.parse_args(argv)
    if args.full:
        args.requests, args.max_tokens = 500, 256
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    rep = run(args.pair, args.requests, args.clients, args.max_tokens, seed=args.seed, parallel=args.parallel)
    print(summary(rep))
    for mm in rep["mismatches"][:5]:
        print("  MISMATCH", json.dumps(mm)[:600])
    for w in rep["wrong_status"][:5]:
        print("  WRONG STATUS", w)
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
