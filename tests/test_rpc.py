"""A target split across llama.cpp rpc-server processes (loopback only), DFlash on top.

Two rpc-servers on 127.0.0.1 hold the demo target's layers half and half (tensor_split 1,1), so the
drafter's tapped layers sit on both; greedy DFlash and DFlash2 over RPC equal plain decoding, local
and over RPC. The faults: an unreachable port, listeners that are not rpc-servers (bounded time,
typed errors), and a server killed during a generation (the request fails with RpcLostError and the
process lives: run in a child process, since an unpatched ggml-rpc aborts the process there).
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from dflash_gguf import Llama, paths
from dflash_gguf.native import rpc
from dflash_gguf.native.engine import DrafterInfo, Model
from dflash_gguf.errors import InvalidArgumentError, RpcConnectError, RpcProtocolError
from dflash_gguf.options import rpc_kwargs

DEMO = paths.DEMO_DIR
DFLASH2 = DEMO.parent / "demo-dflash2" / "drafter.gguf"
KW = dict(n_ctx=512, n_threads=1, n_threads_batch=1, seed=0, verbose=False)
PROMPT = "The story of the little"
N = 40


def _rpc_server() -> Path | None:
    return rpc.server_binary()


needs_server = pytest.mark.skipif(_rpc_server() is None, reason="upstream's rpc-server (ggml-rpc-server) is not "
                                  "built: python -m dflash_gguf.build --with-tools builds it")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(n: int) -> tuple[list[subprocess.Popen], list[str]]:
    procs, eps = [], []
    for _ in range(n):
        port = _free_port()
        procs.append(subprocess.Popen([str(_rpc_server()), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        eps.append(f"127.0.0.1:{port}")
    for ep in eps:
        deadline = time.monotonic() + 30
        while True:
            try:
                rpc.probe(ep, timeout=2)
                break
            except RpcConnectError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return procs, eps


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


@pytest.fixture(scope="module")
def servers():
    procs, eps = start_servers(2)
    yield eps
    stop(procs)


def _text(llm, **kw) -> str:
    return llm.create_completion(PROMPT, max_tokens=N, temperature=0.0, **kw)["choices"][0]["text"]


@pytest.fixture(scope="module")
def local_text():
    with closing(Llama(str(DEMO / "target.gguf"), **KW)) as llm:
        return _text(llm)


# ----------------------------------------------------------------------------- no server needed
@pytest.mark.parametrize("bad", ["localhost", "h:0", "h:x", ":5", "::1:50052", ["a:1", "a:1"]])
def test_bad_endpoints(bad):
    with pytest.raises(InvalidArgumentError):
        rpc.parse_servers(bad)


def test_flags_to_arguments():
    import argparse

    from dflash_gguf.options import add_model_args

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    args = ap.parse_args(["-m", "t.gguf", "--rpc", "10.0.0.2:50052,10.0.0.3:50052", "-ts", "3,1"])
    kw = rpc_kwargs(args, {"n_gpu_layers": 0})
    assert kw == {"rpc_servers": ["10.0.0.2:50052", "10.0.0.3:50052"], "n_gpu_layers": -1, "tensor_split": [3.0, 1.0]}
    assert rpc_kwargs(ap.parse_args(["-m", "t.gguf"]), {"n_gpu_layers": 0}) == {}


def test_unreachable_fails_fast():
    rpc._ggml()   # the libraries loaded first: the bound is on the refusal
    t0 = time.monotonic()
    with pytest.raises(RpcConnectError, match="unreachable"):
        Llama(str(DEMO / "target.gguf"), rpc_servers=[f"127.0.0.1:{_free_port()}"], **KW)
    assert time.monotonic() - t0 < rpc.CONNECT_TIMEOUT_S / 2


class _Listener:
    """A loopback TCP listener that is not an rpc-server: it answers ``reply`` (None: nothing)."""

    def __init__(self, reply: bytes | None):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply, self.conns = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                conn.recv(64)
                conn.sendall(self.reply)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("reply, match", [
    (b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n", "not an rpc-server"),
    (struct.pack("<Q", 28) + bytes([6, 0, 0, 0]) + bytes(24), "protocol 6.0.0"),   # an older rpc-server
    (None, "did not answer"),
])
def test_not_an_rpc_server(reply, match, monkeypatch):
    monkeypatch.setattr(rpc, "CONNECT_TIMEOUT_S", 0.5)
    lis = _Listener(reply)
    try:
        t0 = time.monotonic()
        with pytest.raises(RpcProtocolError, match=match):
            Llama(str(DEMO / "target.gguf"), rpc_servers=[lis.endpoint], **KW)
        assert time.monotonic() - t0 < 2.5
    finally:
        lis.close()


def test_a_server_that_never_accepts_fails_within_the_connect_timeout(monkeypatch):
    """A host that takes no connection (a black-holed address; here a listener whose accept queue is full, so
    the kernel drops the SYN as a firewall would) fails within the timeout, not after TCP's retries."""
    monkeypatch.setattr(rpc, "CONNECT_TIMEOUT_S", 0.5)
    lis = socket.socket()
    lis.bind(("127.0.0.1", 0))
    lis.listen(0)
    ep = f"127.0.0.1:{lis.getsockname()[1]}"
    held = []
    try:
        while True:        # fill the accept queue: the next connection is not answered
            c = socket.socket()
            c.settimeout(0.3)
            held.append(c)
            try:
                c.connect(lis.getsockname())
            except (socket.timeout, TimeoutError):
                break
            assert len(held) < 64, "the listener accepts every connection"
        done: list = []

        def load():
            try:
                Llama(str(DEMO / "target.gguf"), rpc_servers=[ep], **KW)
            except Exception as e:
                done.append(e)
        t0 = time.monotonic()
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        worker.join(10)
        assert not worker.is_alive(), "the connection attempt is unbounded"
        assert isinstance(done[0], RpcConnectError) and "no connection within 0.5 s" in str(done[0]), done
        assert time.monotonic() - t0 < 3
    finally:
        lis.close()      # a connect still waiting is refused now
        for c in held:
            c.close()


# ----------------------------------------------------------------------------- over two rpc-servers
def _layer_devices(records) -> dict[int, str]:
    out = {}
    for r in records:
        m = re.search(r"layer\s+(\d+) assigned to device (\S+?),", r.getMessage())
        if m:   # the target's lines come first (the drafter's layers follow under the same ids)
            out.setdefault(int(m.group(1)), m.group(2))
    return out


@needs_server
@pytest.mark.parametrize("drafter", [DEMO / "drafter.gguf", DFLASH2], ids=["dflash", "dflash2"])
def test_greedy_over_rpc_equals_plain(servers, local_text, drafter, caplog):
    with closing(Llama(str(DEMO / "target.gguf"), draft_model_path=str(drafter), **KW)) as llm:
        assert _text(llm) == local_text                       # DFlash, local
    caplog.set_level(logging.DEBUG, logger="dflash_gguf.llama_cpp")
    with closing(Llama(str(DEMO / "target.gguf"), draft_model_path=str(drafter), rpc_servers=servers,
               tensor_split=[1, 1], draft_n_max=7, draft_adaptive=False, **KW)) as llm:
        on = _layer_devices(caplog.records)
        taps = DrafterInfo.read(llm._draft_model).target_layers
        where = {on[t] for t in taps}
        assert len(where) == 2 and all(d.startswith("RPC") for d in where), (taps, on)   # taps on both servers
        assert _text(llm, dflash=False) == local_text         # plain, over RPC
        out = llm.create_completion(PROMPT, max_tokens=N, temperature=0.0)
        assert out["dflash"]["enabled"] and out["dflash"]["steps"] > 0, out["dflash"]
        assert out["choices"][0]["text"] == local_text       # DFlash, over RPC
        assert llm.rpc_servers == servers


@needs_server
def test_drafter_on_rpc_by_choice(servers, local_text):
    with closing(Llama(str(DEMO / "target.gguf"), draft_model_path=str(DEMO / "drafter.gguf"),
               draft_rpc_servers=servers[:1], **KW)) as llm:
        assert llm._draft_rpc is not None and llm._rpc is None
        assert _text(llm) == local_text


_CHILD = r"""
import json, os, signal, sys, time
from dflash_gguf import Llama
from dflash_gguf.errors import RpcLostError
target, drafter, a, b, pid = sys.argv[1:6]
llm = Llama(target, draft_model_path=drafter, rpc_servers=[a, b], tensor_split=[1, 1], n_ctx=512,
            n_threads=1, n_threads_batch=1, seed=0, verbose=False, draft_adaptive=False)
n, text = 0, ""
try:
    for chunk in llm.create_completion("The story of the little", max_tokens=300, temperature=0.0, stream=True):
        n += 1
        text += chunk["choices"][0]["text"]
        if n == 3:
            os.kill(int(pid), signal.SIGKILL)
            time.sleep(0.5)
    print("FINISHED", n, flush=True)
except RpcLostError as e:
    print("LOST", n, e, flush=True)
print("TEXT", json.dumps(text), flush=True)
for dflash in (True, False):
    try:
        llm.create_completion("Once", max_tokens=8, temperature=0.0, dflash=dflash)
        print("NO-ERROR", dflash, flush=True)
    except RpcLostError:
        print("LOST-AGAIN", dflash, flush=True)
llm.close()
print("ALIVE", flush=True)
"""


@needs_server
def test_server_killed_mid_generation(local_text):
    procs, eps = start_servers(2)
    try:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        res = subprocess.run([sys.executable, "-c", _CHILD, str(DEMO / "target.gguf"), str(DEMO / "drafter.gguf"),
                              *eps, str(procs[1].pid)], capture_output=True, text=True, timeout=120, env=env)
    finally:
        stop(procs)
    out = res.stdout
    assert res.returncode == 0, f"the client process died (rc {res.returncode}):\n{out}\n{res.stderr[-2000:]}"
    m = re.search(r"^LOST (\d+) .*rpc-server 127\.0\.0\.1:\d+ was lost", out, re.M)
    assert m and 3 <= int(m.group(1)) < 40, out   # the tokens of the step under way when it was killed, no more
    streamed = json.loads(re.search(r"^TEXT (.*)$", out, re.M).group(1))
    assert local_text.startswith(streamed), (streamed, local_text)   # every token yielded was verified
    assert "LOST-AGAIN True" in out and "LOST-AGAIN False" in out and out.rstrip().endswith("ALIVE"), out


@needs_server
def test_model_handle_on_rpc(servers):
    """engine.Model takes the devices too (the drafter's path), and its decodes check the servers."""
    devs = rpc.RpcDevices(servers)
    m = Model(DEMO / "target.gguf", n_gpu_layers=-1, devices=devs.address, rpc_check=devs.check)
    try:
        assert m.n_layer == 6
        devs.check()
    finally:
        m.close()
