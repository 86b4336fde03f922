"""The server's limits and OpenAI stream conventions: usage chunks, disconnects of non-streaming
requests, the queue limit (503) and the per-request timeout (408).

A proposer that sleeps makes every DFlash step slow (about 25 ms), so that a long generation is still
running when the test acts on it; the output stays plain decoding's (lossless).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time

import httpx
import openai
import pytest

from dflash_gguf import Llama
from dflash_gguf.server import create_app
from dflash_gguf.decoding import OverrideProposer
from support import KW, Oracle, fast, oracle, pair, plain, serve  # noqa: F401 (fixtures)

MODEL_ID = "tiny-qwen3"
STEP_S = 0.025


class Slow:
    """Proposes nothing useful, slowly."""

    def __init__(self):
        self.delay = STEP_S

    def __call__(self, ctx, n):
        time.sleep(self.delay)
        return [0] * n


@pytest.fixture(scope="module")
def slow(pair):
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_adaptive=False, **KW)   # slow blocks every step
    llm.decoder.proposer = OverrideProposer(Slow())
    yield llm
    llm.close()


@contextlib.contextmanager
def serving(llm, **kw):
    with serve(create_app(llm, MODEL_ID, **kw)) as url:
        yield url


def metrics(url: str) -> dict:
    return httpx.get(url + "/metrics", params={"format": "json"}).json()


def wait_idle(url: str, timeout: float) -> float:
    t0 = time.time()
    while httpx.get(url + "/health").json()["busy"]:
        assert time.time() - t0 < timeout, "server stayed busy: the generation was not stopped"
        time.sleep(0.02)
    return time.time() - t0


def consistent(llm) -> None:
    assert llm.n_tokens == len(llm.decoder.cache)
    assert llm.input_ids[: llm.n_tokens].tolist() == llm.decoder.cache


# --------------------------------------------------------------------------- stream usage
@pytest.fixture(scope="module")
def url(fast):
    with serving(fast) as u:
        yield u


def test_completion_stream_include_usage(url, plain, oracle):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    ref = plain("def main(", max_tokens=30, temperature=0)
    oracle.learn(plain)
    full = client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert {k: getattr(last.usage, k) for k in ref["usage"]} == ref["usage"]
    assert last.usage.completion_tokens == full.usage.completion_tokens == ref["usage"]["completion_tokens"]
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert last.model_extra["dflash"]["enabled"] is True and last.model_extra["dflash"]["steps"] > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == ref["choices"][0]["text"]
    # without include_usage: no usage chunk, no usage field (as OpenAI)
    chunks = list(client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=30, temperature=0,
                                            stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_stream_usage_without_a_drafter(pair, plain):
    """A dflash_gguf.Llama without a drafter streams llama_cpp's chunks (no usage on them): the server
    still sends the right usage chunk, from the Llama's last_usage."""
    llm = Llama(str(pair.target), **KW)
    ref = plain("def main(", max_tokens=12, temperature=0)["usage"]
    try:
        with serve(create_app(llm, MODEL_ID)) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
            for stream in (client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}),
                           client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "x"}],
                                                          max_tokens=12, temperature=0, stream=True,
                                                          stream_options={"include_usage": True})):
                last = list(stream)[-1]
                assert last.choices == [] and last.usage is not None and last.usage.completion_tokens > 0
            assert last.usage.completion_tokens <= 12
            chunks = list(client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            assert {k: getattr(chunks[-1].usage, k) for k in ref} == ref
    finally:
        llm.close()


def test_chat_stream_include_usage_raw(url, plain, oracle):
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    ref = plain.create_chat_completion(msgs, max_tokens=20, temperature=0)
    oracle.learn(plain)
    body = {"messages": msgs, "max_tokens": 20, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"] == ref["usage"] and usage["dflash"]["enabled"] is True
    assert usage["id"] == chunks[-2]["id"] and chunks[-2]["choices"][0]["finish_reason"] is not None
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])
    assert text == ref["choices"][0]["message"]["content"]


def test_streamed_tokens_are_counted_in_metrics(url):
    before = metrics(url)
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 7, "temperature": 0,
                                                             "stream": True}, timeout=60) as r:
        r.read()
    assert metrics(url)["completion_tokens"] - before["completion_tokens"] == 7


def test_echo_as_llama_cpp(url, plain, oracle):
    want = plain("import os\n", max_tokens=12, temperature=0, echo=True)["choices"][0]["text"]
    oracle.learn(plain)
    assert want.startswith("import os\n")
    r = httpx.post(url + "/v1/completions", json={"prompt": "import os\n", "max_tokens": 12, "temperature": 0,
                                                  "echo": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


@pytest.mark.parametrize("field,value", [("n", 2), ("best_of", 3), ("suffix", "return x")])
def test_unsupported_openai_fields_are_a_clear_400(url, field, value):
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported" in err["message"]


# --------------------------------------------------------------------------- cancellation and limits
def test_non_streaming_disconnect_stops_generation(slow, plain):
    with serving(slow) as u:
        before = metrics(u)
        with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes the connection
            httpx.post(u + "/v1/completions", json={"prompt": "def main(", "max_tokens": 400, "temperature": 0},
                       timeout=httpx.Timeout(60, read=0.5))
        waited = wait_idle(u, 400 * STEP_S / 2)
        after = metrics(u)
        assert after["client_disconnects"] == before["client_disconnects"] + 1, (waited, after)
        assert {"endpoint": "/v1/completions", "status": 499, "count": 1} in after["requests"]
        consistent(slow)
        want = plain("class A:", max_tokens=6, temperature=0)["choices"][0]["text"]
        r = httpx.post(u + "/v1/completions", json={"prompt": "class A:", "max_tokens": 6, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want


def test_queue_limit_503(slow):
    with serving(slow, max_queue=1) as u:
        results: dict[str, int] = {}

        def post(name, n):
            r = httpx.post(u + "/v1/completions", json={"prompt": name, "max_tokens": n, "temperature": 0},
                           timeout=120)
            results[name] = r.status_code

        running = threading.Thread(target=post, args=("a = ", 60))
        running.start()
        while not httpx.get(u + "/health").json()["busy"]:
            time.sleep(0.01)
        waiting = threading.Thread(target=post, args=("b = ", 4))
        waiting.start()
        while httpx.get(u + "/health").json()["waiting"] < 1:
            time.sleep(0.01)
        r = httpx.post(u + "/v1/completions", json={"prompt": "c = ", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert "--max-queue 1" in err["message"] and err["code"] == "queue_full"
        running.join(120)
        waiting.join(120)
        assert results == {"a = ": 200, "b = ": 200}
        assert metrics(u)["rejected_queue_full"] == 1


def test_request_timeout_408(slow, plain):
    with serving(slow, request_timeout=0.6) as u:
        client = openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=2, timeout=60)
        t0 = time.time()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=400, temperature=0)
        assert e.value.status_code == 408 and "--request-timeout" in str(e.value)
        assert e.value.response.headers["x-should-retry"] == "false"   # not resent despite max_retries=2
        wait_idle(u, 400 * STEP_S / 2)
        assert time.time() - t0 < 400 * STEP_S / 2
        consistent(slow)
        # a stream past its first chunk gets an error event and ends
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=400, temperature=0,
                                               stream=True):
                pass
        wait_idle(u, 400 * STEP_S / 2)
        consistent(slow)
        assert metrics(u)["timeouts"] == 2
        want = plain("x = 1", max_tokens=5, temperature=0)["choices"][0]["text"]
        assert client.completions.create(model=MODEL_ID, prompt="x = 1", max_tokens=5,
                                         temperature=0).choices[0].text == want


def test_interrupt_from_another_thread(slow, plain):
    """``Llama.interrupt`` (what the server calls) stops a running call at its next token, keeps the
    output a prefix of plain decoding and the caches consistent, and does not leak into the next call."""
    timer = threading.Timer(0.4, slow.interrupt)
    timer.start()
    t0 = time.time()
    out = slow("def main(", max_tokens=400, temperature=0)
    assert time.time() - t0 < 400 * STEP_S / 2
    n = out["usage"]["completion_tokens"]
    assert n < 400 and out["dflash"]["enabled"] is True and out["choices"][0]["finish_reason"] == "stop"
    if n:
        # plain decoding's first n tokens, as llama_cpp makes text of tokens it stopped after (a cut UTF-8
        # character dropped; with max_tokens=n it would read on to complete one)
        prompt = plain.tokenize(b"def main(")
        ref = list(itertools.islice(plain.generate(prompt, temp=0), n))
        want = plain.detokenize(ref, prev_tokens=prompt).decode("utf-8", errors="ignore")
        assert out["choices"][0]["text"] == want
    consistent(slow)
    assert slow("x = ", max_tokens=5, temperature=0)["usage"]["completion_tokens"] == 5
