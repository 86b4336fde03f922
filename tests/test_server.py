"""The OpenAI-compatible server, driven by the official openai client and raw httpx."""
from __future__ import annotations

import json
import threading
import time

import httpx
import llama_cpp
import openai
import pytest

from dflash_gguf.server import create_app
from support import KW, Oracle, assert_served, fast, oracle, pair, plain, serve  # noqa: F401 (fixtures)

MODEL_ID = "tiny-qwen3"




@pytest.fixture(scope="module")
def base_url(fast):
    with serve(create_app(fast, MODEL_ID)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(base_url: str, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while httpx.get(base_url + "/health").json()["busy"]:
        assert time.time() < deadline, "server stayed busy"
        time.sleep(0.02)


def plain_text(plain, oracle, prompt, **kw) -> str:
    out = plain(prompt, temperature=0, **kw)["choices"][0]["text"]
    oracle.learn(plain)
    return out


def plain_chat(plain, oracle, messages, **kw) -> str:
    out = plain.create_chat_completion(messages, temperature=0, **kw)["choices"][0]["message"]["content"]
    oracle.learn(plain)
    return out


def test_models_and_health(client, base_url):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    h = httpx.get(base_url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL_ID
    assert h["dflash"]["block_size"] == 8 and h["dflash"]["n_draft"] == 7


def test_completion(client, plain, oracle):
    want = plain_text(plain, oracle, "def main(", max_tokens=24)
    r = client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=24, temperature=0)
    assert r.choices[0].text == want
    assert r.model == MODEL_ID
    assert r.usage.completion_tokens == 24
    st = r.model_extra["dflash"]
    assert st["steps"] > 0 and st["drafted"] >= st["accepted"] > 0


def test_chat(client, plain, oracle):
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    want = plain_chat(plain, oracle, msgs, max_tokens=20)
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=20, temperature=0)
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.model_extra["dflash"]["steps"] > 0


def test_completion_stream(client, plain, oracle):
    want = plain_text(plain, oracle, "import os\n", max_tokens=30)
    chunks = list(client.completions.create(model=MODEL_ID, prompt="import os\n", max_tokens=30, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["dflash"]["steps"] > 0


def test_chat_stream(client, plain, oracle):
    msgs = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "class A:"}]
    want = plain_chat(plain, oracle, msgs, max_tokens=25)
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=25, temperature=0,
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason is not None
    assert_served(chunks[-1].model_extra["dflash"])


def test_sse_wire_format(base_url):
    with httpx.stream("POST", base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True,
                                                                  "temperature": 0}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        body = r.read().decode()
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_grammar_and_mirostat_are_served_by_dflash(client, plain):
    g = 'root ::= [a-z ]+'
    want = plain("def main(", max_tokens=12, temperature=0,
                 grammar=llama_cpp.LlamaGrammar.from_string(g, verbose=False))["choices"][0]["text"]
    r = client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=12, temperature=0,
                                  extra_body={"grammar": g})
    assert r.choices[0].text == want
    assert r.model_extra["dflash"]["enabled"] is True
    r = client.completions.create(model=MODEL_ID, prompt="def main(", max_tokens=6, temperature=0.7, seed=1,
                                  extra_body={"mirostat_mode": 2})
    assert r.model_extra["dflash"]["enabled"] is True, r.model_extra["dflash"]


def test_structured_chat_requests_are_served_by_dflash(client, plain, oracle):
    """response_format (JSON mode, a schema), tools + tool_choice and logit_bias through the openai client:
    llama_cpp's answers, with DFlash (the dflash object says so)."""
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    tool = {"type": "function", "function": {"name": "add", "parameters": schema}}
    cases = [dict(response_format={"type": "json_object"}),
             dict(response_format={"type": "json_object", "schema": schema}),
             dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "add"}}),
             dict(logit_bias={"13": 3.0})]
    for kw in cases:
        want = plain.create_chat_completion(msgs, max_tokens=24, temperature=0, **kw)["choices"][0]["message"]
        oracle.learn(plain)
        extra = {"response_format": kw.pop("response_format")} if "response_format" in kw else {}
        r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=24, temperature=0,
                                           extra_body=extra, **kw)
        got = r.choices[0].message
        if "tools" in kw:
            assert [c.function.name for c in got.tool_calls] == ["add"]
            assert got.tool_calls[0].function.arguments == want["tool_calls"][0]["function"]["arguments"]
        else:
            assert got.content == want["content"], kw
        assert r.model_extra["dflash"]["enabled"] is True, (kw, r.model_extra["dflash"])


def test_per_request_dflash_off_and_template_kwargs(client, plain, oracle):
    msgs = [{"role": "user", "content": "import sys"}]
    want = plain_chat(plain, oracle, msgs, max_tokens=10)
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"dflash": False})
    assert r.choices[0].message.content == want and r.model_extra["dflash"]["enabled"] is False
    r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == want and r.model_extra["dflash"]["enabled"] is True


BAD = [
    ("/v1/completions", {"max_tokens": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "tempreature": 0.5}, "tempreature"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "x", "grammar": "root ::= ("}, "grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object", "schema": {"type": "bogus"}}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "array", "items": 5}}}]}, "tools"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "word " * 700, "max_tokens": 4}, None),     # context overflow
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, None),                  # needs logits_all
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"max_tokens": 3}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "maybe"}, "stream"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{p.split('/')[-1]}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_request_is_400(base_url, path, body, param):
    for stream in (False, True):
        b = dict(body, stream=body.get("stream", stream))
        r = httpx.post(base_url + path, json=b, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param:
            assert param in (err["param"] or "") + err["message"]


def test_echo_of_a_token_id_prompt(base_url, plain, oracle):
    """echo=true with a token-id prompt (a 500 from llama_cpp 0.3.36): the prompt's text, then the completion,
    as llama_cpp's echo of the same prompt given as text; streams leave the prompt out, as llama_cpp's."""
    prompt = "def main("
    ids = plain.tokenize(prompt.encode("utf-8"), special=True)
    want = plain(prompt, temperature=0, max_tokens=12, echo=True)["choices"][0]["text"]
    oracle.learn(plain)
    r = httpx.post(base_url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0,
                                                       "echo": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want and want.startswith(prompt) and len(want) > len(prompt)
    text = ""
    with httpx.stream("POST", base_url + "/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0,
                                                                  "echo": True, "stream": True}, timeout=60) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == want[len(prompt):]


def test_bad_requests_through_openai_client_and_server_survives(client, base_url, plain, oracle):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=[], max_tokens=3)
    r = httpx.post(base_url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(base_url + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(base_url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    want = plain_text(plain, oracle, "class Foo:\n", max_tokens=16)
    assert client.completions.create(model=MODEL_ID, prompt="class Foo:\n", max_tokens=16,
                                     temperature=0).choices[0].text == want


def test_two_concurrent_clients(base_url, plain, oracle):
    jobs = [("def main(", 60, False), ("import os\n", 50, True), ("class Foo:\n    def", 40, True),
            ("x = 1\n", 45, False)]
    want = {p: plain_text(plain, oracle, p, max_tokens=n) for p, n, _ in jobs}
    got: dict[str, str] = {}
    errors: list[BaseException] = []

    def worker(my_jobs):
        try:
            c = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
            for p, n, stream in my_jobs:
                if stream:
                    chunks = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=n, temperature=0, stream=True)
                    got[p] = "".join(ch.choices[0].text for ch in chunks)
                else:
                    got[p] = c.completions.create(model=MODEL_ID, prompt=p, max_tokens=n, temperature=0).choices[0].text
        except BaseException as e:   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(jobs[0::2],)), threading.Thread(target=worker, args=(jobs[1::2],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got == want


def test_disconnect_mid_stream_stops_generation(base_url, client, fast, plain, oracle):
    before = httpx.get(base_url + "/metrics", params={"format": "json"}).json()
    body = {"prompt": "def main(", "max_tokens": 450, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", base_url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["text"] is not None
    wait_idle(base_url)
    after = httpx.get(base_url + "/metrics", params={"format": "json"}).json()
    assert after["client_disconnects"] == before["client_disconnects"] + 1
    assert after["completion_tokens"] - before["completion_tokens"] < 450
    # the generation itself stopped soon after the client left (a stream drained to its end would
    # have evaluated up to 450 tokens): the context holds the prompt and a few blocks at most
    assert fast.n_tokens - len(fast.tokenize(b"def main(")) < 150, fast.n_tokens
    assert fast.n_tokens == len(fast.decoder.cache)
    assert fast.input_ids[: fast.n_tokens].tolist() == fast.decoder.cache
    want = plain_text(plain, oracle, "import os\n", max_tokens=20)
    assert client.completions.create(model=MODEL_ID, prompt="import os\n", max_tokens=20,
                                     temperature=0).choices[0].text == want


def test_metrics(base_url):
    text = httpx.get(base_url + "/metrics").text
    for name in ("dflash_requests_total", "dflash_steps_total", "dflash_drafted_tokens_total",
                 "dflash_accepted_tokens_total", "dflash_acceptance_length", "dflash_tokens_per_second",
                 "dflash_completion_tokens_total", "dflash_client_disconnects_total", "dflash_generations_total"):
        assert f"\n{name}" in "\n" + text, name
    assert 'endpoint="/v1/completions",status="400"' in text
    assert 'dflash_generations_total{path="plain"}' in text      # the dflash=false request
    assert 'dflash_fallbacks_total{reason="dflash disabled for this call"} 1' in text
    j = httpx.get(base_url + "/metrics", params={"format": "json"}).json()
    assert j["dflash_requests"] > 0 and j["acceptance_length"] >= 1.0
    assert j["requests_in_flight"] == 0
    fallbacks = {f["reason"]: f["count"] for f in j["fallbacks"]}
    assert fallbacks == {"dflash disabled for this call": 1} and j["plain_requests"] == 1
