"""Shared test support: llama-cpp-python settings, an oracle proposer, plain references, fixtures."""
from __future__ import annotations

import contextlib

import llama_cpp
import pytest

from dflash_gguf import Llama
from dflash_gguf.decoding import OverrideProposer

# one thread: on a busy 2-core machine llama.cpp's spinning thread pool slows down badly
KW = dict(n_ctx=512, n_threads=1, n_threads_batch=1, seed=0, verbose=False, chat_format="chatml")


def assert_served(info: dict | None, drafted: bool = True) -> None:
    """A response's ``dflash`` object says DFlash served it: enabled, tokens generated and (``drafted``)
    at least one drafting step taken (a plain fallback is ``{"enabled": False, "reason": ...}``, which a
    bare ``is not None`` would accept). ``drafted=False`` where the speed gate may decode plainly."""
    assert info is not None, "no dflash object in the response"
    assert info.get("enabled") is True, f"served by plain decoding: {info}"
    assert info["n_generated"] > 0, info
    if drafted:
        assert info["steps"] > 0 and info["drafted"] > 0, info


def llama_cpp_greedy(path, prompt_tokens, n, n_ctx=512):
    """Plain greedy decoding by llama-cpp-python itself (flash attention on, like our contexts)."""
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=64, n_threads=1, n_threads_batch=1,
                          verbose=False, seed=0, flash_attn=True)
    out = []
    for t in llm.generate(prompt_tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
        out.append(t)
        if len(out) == n:
            break
    llm.close()
    return out


class Oracle:
    """A test proposer that drafts what plain decoding produced before (with planted mistakes).

    The random tiny drafter almost never agrees with the random target, so every block would commit
    one token. Proposing the known continuation makes blocks commit several tokens, which is what
    stop strings, max_tokens and streaming across block boundaries need to be tested against.
    """

    def __init__(self):
        self.known: list[list[int]] = []
        self.calls = 0

    def learn(self, llm: llama_cpp.Llama) -> None:
        self.known.append(llm.input_ids[: llm.n_tokens].tolist())

    def __call__(self, ctx: list[int], n: int) -> list[int]:
        self.calls += 1
        out = [0] * n
        for seq in self.known:
            if len(seq) > len(ctx) and seq[: len(ctx)] == ctx:
                got = seq[len(ctx): len(ctx) + n]
                out[: len(got)] = got
                break
        if self.calls % 4 == 0 and n > 3:      # a rejection in the middle of the block now and then
            out[3] = (out[3] + 1) % 512
        return out


@pytest.fixture(scope="module")
def pair(models):
    return models.pair("qwen3", "dflash", 8)


def both(plain, fast, oracle, method: str, *args, **kwargs):
    """``method`` on llama_cpp's Llama, then (the oracle having learnt its continuation) on ours."""
    a = getattr(plain, method)(*args, **kwargs)
    if kwargs.get("stream"):
        a = list(a)
    oracle.learn(plain)
    b = getattr(fast, method)(*args, **kwargs)
    if kwargs.get("stream"):
        b = list(b)
    return a, b


@pytest.fixture(scope="module")
def plain(pair):
    llm = llama_cpp.Llama(str(pair.target), **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def oracle():
    return Oracle()


@pytest.fixture(scope="module")
def fast(pair, oracle):
    # fixed drafting: these tests pin block mechanics (stops and budgets mid-block), which the speed
    # gate would make depend on the machine's timings; test_api checks the default (gate on) separately
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_adaptive=False, **KW)
    llm.decoder.proposer = OverrideProposer(oracle)
    yield llm
    llm.close()


@contextlib.contextmanager
def serve(app):
    """Serve a FastAPI ``app`` on a free loopback port for the block's duration; yields its base URL."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
