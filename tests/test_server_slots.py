"""The server with ``--parallel N``: requests decoded together in the batched engine, each response what
llama_cpp.Llama gives for that request alone (the shipped demo pair: a trained drafter, real acceptance)."""
from __future__ import annotations

import contextlib
import inspect
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import llama_cpp
import pytest

from dflash_gguf import Llama
from dflash_gguf.demo import DEMO_DIR
from dflash_gguf.server import create_app
from support import serve

TARGET, DRAFTER = DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
KW = dict(n_ctx=512, n_threads=2, seed=0, verbose=False, chat_format="chatml")
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import json\n\ndef load(path):\n",
           "for i in range(10):\n", "def add(a, b):\n    return", "# sort a list\n", "x = [", "while True:\n"]


@pytest.fixture(scope="module")
def plain():
    llm = llama_cpp.Llama(str(TARGET), **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server():
    # blocks pinned: these tests assert that drafted blocks are verified in batched steps, which the speed gate
    # (its choices follow this machine's timings; gated batches: tests/test_batch.py) may rightly skip
    llm = Llama(str(TARGET), draft_model_path=str(DRAFTER), draft_adaptive=False, **KW)
    app = create_app(llm, "demo", parallel=3)
    with serve(app) as url:
        yield url, app.state.server
    app.state.server.slots.close()
    llm.close()


def _complete(url, prompt, **kw):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "temperature": 0, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, path, body):
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _slots_freed(url, within: float = 20.0) -> bool:
    """Whether every slot of the server at ``url`` is free within ``within`` seconds."""
    deadline = time.time() + within
    while httpx.get(f"{url}/health").json()["slots"]["busy"] and time.time() < deadline:
        time.sleep(0.05)
    return httpx.get(f"{url}/health").json()["slots"]["busy"] == 0


def test_concurrent_completions_equal_llama_cpp_alone(server, plain):
    url, srv = server
    want = [plain.create_completion(p, max_tokens=40, temperature=0)["choices"][0] for p in PROMPTS]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda p: _complete(url, p, max_tokens=40), PROMPTS))
    for w, g in zip(want, got):
        c = g["choices"][0]
        assert (c["text"], c["finish_reason"]) == (w["text"], w["finish_reason"])
        assert g["dflash"]["enabled"] is True and g["usage"]["completion_tokens"] > 0
    assert sum(g["dflash"]["steps"] for g in got) > 0 and sum(g["dflash"]["accepted"] for g in got) > 0
    health = httpx.get(f"{url}/health").json()
    assert health["slots"] == {"total": 3, "busy": 0, "waiting": 0}
    m = httpx.get(f"{url}/metrics?format=json").json()
    assert m["slots"]["steps"] > 0 and 1 < m["slots"]["mean_batch"] <= 3, m["slots"]
    assert m["completion_tokens"] >= sum(g["usage"]["completion_tokens"] for g in got)
    assert "dflash_batch_steps_total" in httpx.get(f"{url}/metrics").text


def test_streams_and_stop_strings(server, plain):
    url, _ = server
    for p in PROMPTS[:4]:
        ref = plain.create_completion(p, max_tokens=48, temperature=0)["choices"][0]["text"]
        stop = ref[len(ref) // 2:len(ref) // 2 + 2] or "\n"
        want = plain.create_completion(p, max_tokens=48, temperature=0, stop=[stop])["choices"][0]
        got = _complete(url, p, max_tokens=48, stop=[stop])["choices"][0]
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), (p, stop)
        chunks = _stream(url, "/v1/completions", {"prompt": p, "max_tokens": 48, "temperature": 0, "stop": [stop]})
        assert "".join(c["choices"][0]["text"] for c in chunks) == want["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == want["finish_reason"]
        assert chunks[-1]["dflash"]["enabled"] is True


def test_chat_equals_llama_cpp(server, plain):
    url, _ = server
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    want = plain.create_chat_completion(msgs, max_tokens=32, temperature=0)["choices"][0]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": msgs, "max_tokens": 32, "temperature": 0},
                   timeout=120).json()
    assert r["object"] == "chat.completion" and r["dflash"]["enabled"] is True
    assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) == \
        (want["message"]["content"], want["finish_reason"])
    chunks = _stream(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 32, "temperature": 0})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want["message"]["content"]


def test_constrained_requests_run_in_the_slots(server, plain):
    """Grammars, logit_bias and chat JSON mode are batched like any request (each verify row judged under
    its own request's grammar state): every response equals llama_cpp's alone."""
    url, srv = server
    g = 'root ::= [a-z ]+ | "(" [a-z, ]* ")" [a-z:\n ]*'
    bias = {"13": 4.0, "30": -50.0}
    cases = [("c", PROMPTS[i], dict(grammar=g)) for i in range(3)] + \
        [("c", PROMPTS[3], dict(logit_bias=bias)), ("c", PROMPTS[4], dict(grammar=g, logit_bias=bias)),
         ("chat", [{"role": "user", "content": "a JSON object, please"}], dict(response_format={"type": "json_object"}))]

    def want(kind, prompt, extra):
        kw = dict(extra, max_tokens=32, temperature=0)
        if "grammar" in kw:
            kw["grammar"] = llama_cpp.LlamaGrammar.from_string(kw["grammar"], verbose=False)
        if kind == "chat":
            return plain.create_chat_completion(prompt, **kw)["choices"][0]["message"]["content"]
        return plain.create_completion(prompt, **kw)["choices"][0]["text"]

    def got(case):
        kind, prompt, extra = case
        if kind == "chat":
            r = httpx.post(f"{url}/v1/chat/completions", json={"messages": prompt, "max_tokens": 32, "temperature": 0,
                                                              **extra}, timeout=120).json()
            return r["choices"][0]["message"]["content"], r["dflash"]
        r = _complete(url, prompt, max_tokens=32, **extra)
        return r["choices"][0]["text"], r["dflash"]

    wants = [want(*c) for c in cases]
    before = srv.slots.sequences
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(got, cases))
    for case, w, (text, info) in zip(cases, wants, results):
        assert text == w, case
        assert info["enabled"] is True, (case, info)
    # every target pass of theirs was a sequence of a batched step
    assert srv.slots.sequences - before >= sum(info["passes"] for _, info in results), "they ran in the slots"
    assert sum(info["accepted"] for _, info in results) > 0


def test_requests_the_slots_do_not_serve_run_on_the_llama(server):
    """The logprobs of an echoed prompt need the prompt's rows, which the slots do not keep: the request goes
    to the model's own Llama (no slot step), which answers as llama_cpp does without logits_all."""
    url, srv = server
    before = srv.slots.sequences
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                                  "echo": True, "logprobs": 2}, timeout=120)
    assert r.status_code == 400 and "logits_all" in r.text, r.text
    assert srv.slots.sequences == before, "it did not run in the slots"


@pytest.mark.parametrize("sampler", [dict(typical_p=0.5), dict(mirostat_mode=1, mirostat_tau=3.0),
                                     dict(mirostat_mode=2, mirostat_eta=0.2)], ids=["typical", "mirostat1", "mirostat2"])
def test_typical_p_and_mirostat_run_in_the_slots(server, plain, sampler):
    """typical_p and mirostat are part of the engine's sampler: greedy they change nothing (as in llama.cpp's
    chain) and equal llama_cpp's; sampled with a seed they run in the slots, drafted and repeatable (their
    distributions: tests/test_sampling.py)."""
    url, srv = server
    before = srv.slots.sequences
    r = _complete(url, PROMPTS[1], max_tokens=16, **sampler)
    want = plain.create_completion(PROMPTS[1], max_tokens=16, temperature=0, **sampler)["choices"][0]["text"]
    assert r["choices"][0]["text"] == want and r["dflash"]["enabled"] is True
    sampled = [_complete(url, PROMPTS[2], max_tokens=16, temperature=0.8, seed=11, **sampler) for _ in range(2)]
    assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]
    assert all(s["dflash"]["enabled"] is True and s["dflash"]["drafted"] > 0 for s in sampled)
    assert srv.slots.sequences - before >= 3, "they ran in the slots"


def test_echo_of_a_token_id_prompt(server, plain):
    """echo=true with a token-id prompt (llama_cpp 0.3.36 fails on it): the text starts with the prompt's
    text and equals llama_cpp's echo of the same prompt as text; run in the slots. Its logprobs cannot be
    echoed (llama_cpp's offsets need the text): a 400 that says so."""
    url, srv = server
    for p in PROMPTS[:2]:
        ids = plain.tokenize(p.encode("utf-8"), special=True)
        want = plain.create_completion(p, max_tokens=16, temperature=0, echo=True)["choices"][0]
        before = srv.slots.sequences
        got = _complete(url, ids, max_tokens=16, echo=True)["choices"][0]
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"])
        assert want["text"].startswith(p) and len(want["text"]) > len(p)
        assert srv.slots.sequences > before, "it ran in the slots"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 4, "echo": True, "logprobs": 2},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    assert "text prompt" in r.json()["error"]["message"]


def test_an_abandoned_stream_frees_its_slot(server):
    url, srv = server
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 400,
                                                             "temperature": 0, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    assert _slots_freed(url)
    assert _complete(url, PROMPTS[2], max_tokens=8)["choices"][0]["text"]


def test_bad_prompts_fail_alone(server):
    url, _ = server
    too_long = list(range(5, 600))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": too_long, "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 400, r.text
    assert _complete(url, PROMPTS[3], max_tokens=8)["choices"][0]["text"]


def test_openai_client_against_the_slots(server, plain):
    """What an OpenAI client sees from the slots: completions, chat, streamed chat, usage."""
    import openai

    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    want = plain.create_completion(PROMPTS[4], max_tokens=24, temperature=0)["choices"][0]["text"]
    r = client.completions.create(model="demo", prompt=PROMPTS[4], max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.usage.completion_tokens > 0
    msgs = [{"role": "user", "content": "def add(a, b):"}]
    want = plain.create_chat_completion(msgs, max_tokens=24, temperature=0)["choices"][0]["message"]["content"]
    c = client.chat.completions.create(model="demo", messages=msgs, max_tokens=24, temperature=0)
    assert c.choices[0].message.content == want
    parts, usage = [], None
    for ch in client.chat.completions.create(model="demo", messages=msgs, max_tokens=24, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage is not None:
            usage = ch.usage
    assert "".join(parts) == want and usage is not None and usage.completion_tokens > 0


def test_queue_limit_counts_requests_waiting_for_a_slot():
    """--max-queue with slots: a request that would wait while max_queue others already wait gets a 503;
    one that finds a free slot never does."""
    llm = Llama(str(TARGET), draft_model_path=str(DRAFTER), **KW)
    app = create_app(llm, "demo", parallel=1, max_queue=0)
    dec = app.state.server.slots.decoder
    step = dec.step
    dec.step = lambda: (time.sleep(0.05), step())[1]   # slow steps: the slot stays busy while we look
    try:
        with serve(app) as url:
            assert _complete(url, PROMPTS[0], max_tokens=4)["choices"][0]["text"] is not None   # a free slot: served
            body = {"prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                # read on from the same iterator: leaving it would close the connection (httpcore), and the
                # server would end that stream and free its slot before the next request arrives
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))   # the one slot is busy now
                busy = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full", busy.text
            assert "a slot" in busy.json()["error"]["message"]
    finally:
        app.state.server.slots.close()
        llm.close()


def test_timeouts_and_a_gone_client_free_the_slot():
    """--request-timeout and a client that leaves, in the slots: a whole response past its deadline is a 408,
    a stream past it ends with a 408 error event, a client that gives up on a whole response frees its slot,
    and each is counted in /metrics."""
    llm = Llama(str(TARGET), draft_model_path=str(DRAFTER), **KW)
    app = create_app(llm, "demo", parallel=1, request_timeout=0.5)
    slots = app.state.server.slots
    step = slots.decoder.step
    slots.decoder.step = lambda: (time.sleep(0.02), step())[1]   # 480 tokens take well over the 0.5 s
    body = {"prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0}

    try:
        with serve(app) as url:
            t0 = time.time()
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout", r.text
            assert time.time() - t0 < 5 and _slots_freed(url)
            events = [json.loads(x[6:]) for x in httpx.post(f"{url}/v1/completions", json={**body, "stream": True},
                                                             timeout=60).text.splitlines() if x.startswith("data: {")]
            assert events[-1]["error"]["code"] == 408 and any("choices" in e for e in events[:-1]), events[-1]
            assert _slots_freed(url)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 20000 // 50}, timeout=0.2)
            assert _slots_freed(url)
            m = httpx.get(f"{url}/metrics?format=json").json()
            assert m["timeouts"] == 2 and m["client_disconnects"] == 1, m
            assert _complete(url, PROMPTS[2], max_tokens=8)["usage"]["completion_tokens"] == 8
    finally:
        slots.close()
        llm.close()


def test_echo_of_a_text_prompt_runs_in_the_slots(server, plain):
    """echo=true with a text prompt: the text starts with the prompt (as llama_cpp's; its streams leave the
    prompt out, and so do ours), decoded in the batched engine."""
    url, srv = server
    for p in PROMPTS[:2]:
        want = plain.create_completion(p, max_tokens=24, temperature=0, echo=True)["choices"][0]
        want_stream = "".join(c["choices"][0]["text"] for c in
                              plain.create_completion(p, max_tokens=24, temperature=0, echo=True, stream=True))
        before = srv.slots.sequences
        got = _complete(url, p, max_tokens=24, echo=True)
        assert got["choices"][0]["text"] == want["text"] and want["text"].startswith(p)
        assert (got["choices"][0]["finish_reason"], got["dflash"]["enabled"]) == (want["finish_reason"], True)
        assert srv.slots.sequences - before >= got["dflash"]["passes"] > 0, "it ran in the slots"
        chunks = _stream(url, "/v1/completions", {"prompt": p, "max_tokens": 24, "temperature": 0, "echo": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == want_stream


def test_a_hybrid_target_runs_in_the_slots(models):
    """A hybrid target (Qwen3.5's gated delta-net) with --parallel: its requests run in the batched engine
    (blocks padded per step, each slot rolling back by its own recurrent snapshots, as the Llama does),
    each response llama_cpp's for that request alone."""
    pair = models.pair("qwen35", "dflash", 8)
    kw = dict(n_ctx=256, n_batch=64, n_threads=1, seed=0, verbose=False)
    prompts = ["def main(argv):\n    parser = argparse.ArgumentParser(", "    for key, value in sorted(items):\n",
               "import os\n", "x = [i * i for i in range("]
    ref = llama_cpp.Llama(str(pair.target), **kw)
    want = [ref.create_completion(p, max_tokens=24, temperature=0)["choices"][0]["text"] for p in prompts]
    ref.close()
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_adaptive=False, **kw)
    app = create_app(llm, "hybrid", parallel=2)
    try:
        slots = app.state.server.slots
        assert slots.decoder.rollback == llm.decoder.rollback == "snapshot"
        assert slots.target.n_rs_seq == llm.decoder.target.n_rs_seq > 0
        with serve(app) as url, ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _complete(url, p, max_tokens=24), prompts))
            m = httpx.get(f"{url}/metrics?format=json").json()
        assert [g["choices"][0]["text"] for g in got] == want
        assert sum(g["dflash"]["drafted"] for g in got) > 0
        assert m["slots"]["steps"] > 0 and m["slots"]["mean_batch"] > 1, m["slots"]
    finally:
        app.state.server.slots.close()
        llm.close()


def test_ignore_eos_masks_end_of_generation_tokens(server, plain):
    """llama-server's ``ignore_eos``: the end-of-generation tokens get a logit of -inf, over any bias the
    request gives them. A bias of +30 on EOS ends the reply at once; with ignore_eos it runs to max_tokens,
    equal to llama_cpp's reply with EOS masked, in the slots and on the Llama one request at a time."""
    url, srv = server
    eos = plain.token_eos()
    p, n = PROMPTS[0], 24
    want = plain.create_completion(p, max_tokens=n, temperature=0, logit_bias={eos: float("-inf")})["choices"][0]
    pushed = _complete(url, p, max_tokens=n, logit_bias={str(eos): 30.0})
    assert pushed["choices"][0]["finish_reason"] == "stop" and pushed["usage"]["completion_tokens"] == 0
    got = _complete(url, p, max_tokens=n, logit_bias={str(eos): 30.0}, ignore_eos=True)
    assert (got["choices"][0]["text"], got["choices"][0]["finish_reason"]) == (want["text"], "length")
    assert got["usage"]["completion_tokens"] == n and got["dflash"]["enabled"] is True
    with serve(create_app(srv.llm, "demo")) as one:      # the same Llama, one request at a time, no slots
        r = _complete(one, p, max_tokens=n, logit_bias={str(eos): 30.0}, ignore_eos=True)
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == (want["text"], "length")
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 8, "temperature": 0, "logit_bias": {str(eos): 30.0}, "ignore_eos": True},
                      timeout=120).json()
    assert chat["usage"]["completion_tokens"] == 8 and chat["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_a_streams_text_chunk_is_the_json_of_its_chunk(chat):
    """The streamed text chunks are written from a frame made once per stream: byte for byte the JSON of
    the chunk (quotes, escapes, control characters and non-ASCII text included)."""
    from dflash_gguf.requests.responses import chunk, text_chunk_frame

    head, tail = text_chunk_frame("cmpl-1", 'a "model"\\', chat, 1700000000)
    for text in ["", "x", 'say "hi"\n', "tab\there\\", "\x00\x1f\x7f", "é 漢字 🙂", "end"]:
        want = json.dumps(chunk("cmpl-1", 'a "model"\\', text, None, chat, created=1700000000))
        assert head + json.dumps(text) + tail == want
    assert text_chunk_frame("cmpl-1", "\x00text\x00", chat, 1) is None     # a model id that is the marker: no frame


@contextlib.contextmanager
def _own_server(parallel: int = 1, **create_kw):
    """A --parallel server of its own (slowed or broken on purpose, so kept apart from the module's)."""
    llm = Llama(str(TARGET), draft_model_path=str(DRAFTER), **KW)
    app = create_app(llm, "demo", parallel=parallel, **create_kw)
    try:
        with serve(app) as url:
            yield url, app.state.server.slots
    finally:
        app.state.server.slots.close()
        llm.close()


def _submitted(slots) -> list:
    """The jobs ``slots`` is given from now on, in order."""
    jobs = []
    submit = slots.submit
    slots.submit = lambda job: (jobs.append(job), submit(job))[1]
    return jobs


SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                   "presence_penalty", "mirostat_mode", "mirostat_tau", "mirostat_eta", "seed")


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_request_without_sampling_fields_gets_the_llamas_defaults_for_its_endpoint(server, chat):
    """A field the request leaves out is sampled in the slots with llama_cpp.Llama's default for that
    endpoint (create_completion's or create_chat_completion's: temperature 0.8 and 0.2), which is what the
    server without --parallel hands the Llama: a seeded request without temperature gives what the same
    request with the endpoint's default temperature gives, not what the other endpoint's gives."""
    from dflash_gguf.requests.defaults import sampling

    fn = llama_cpp.Llama.create_chat_completion if chat else llama_cpp.Llama.create_completion
    defaults = {k: v.default for k, v in inspect.signature(fn).parameters.items()}
    sp = sampling({}, chat)
    assert {f: sp[f] for f in SAMPLING_FIELDS} == {f: defaults[f] for f in SAMPLING_FIELDS}

    url, srv = server
    other = inspect.signature(llama_cpp.Llama.create_completion if chat else
                              llama_cpp.Llama.create_chat_completion).parameters["temperature"].default
    assert other != defaults["temperature"]
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "def add(a, b):"}]}
    else:
        path, body = "/v1/completions", {"prompt": PROMPTS[5]}
    body.update(max_tokens=32, seed=3)

    def text(**kw) -> str:
        r = httpx.post(f"{url}{path}", json={**body, **kw}, timeout=120)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["message"]["content"] if chat else c["text"]

    before = srv.slots.sequences
    got = text()
    assert srv.slots.sequences > before, "it ran in the slots"
    assert got == text(temperature=defaults["temperature"])
    assert got != text(temperature=other), "this seed cannot tell the two temperatures apart"


def test_a_dropped_or_timed_out_request_stops_within_a_few_steps():
    """A client that leaves a stream, or a request past --request-timeout, ends its generation at the
    next step or so, not at max_tokens: slow steps and a reply that cannot end early (ignore_eos, max_tokens
    near the context) show how many steps ran after the server learnt it."""
    with _own_server(request_timeout=1.5) as (url, slots):
        step, steps = slots.decoder.step, [0]

        def slow_step():
            time.sleep(0.05)
            steps[0] += 1
            return step()
        slots.decoder.step = slow_step
        jobs = _submitted(slots)
        body = {"prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
            left = steps[0]
        assert _slots_freed(url, within=5), "the dropped stream kept its slot"
        assert steps[0] - left <= 10, f"{steps[0] - left} steps after the client left"
        assert jobs[0].n_tokens < 200

        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 408, r.text
        answered = steps[0]
        assert _slots_freed(url, within=5), "the timed-out request kept its slot"
        assert steps[0] - answered <= 10, f"{steps[0] - answered} steps after the timeout"
        assert jobs[1].n_tokens < 480


def test_a_failure_handing_out_a_steps_tokens_fails_that_request_and_the_server_serves_on(monkeypatch):
    """An exception in the engine thread's handling of a step's results (here: reading a request's text,
    once) ends that request with a 500 at once; the request beside it and later ones are served as usual."""
    from dflash_gguf.requests.stops import StopStrings

    text, calls = StopStrings.text, [0]

    def text_once(self):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected fault")
        return text(self)
    with _own_server(parallel=2) as (url, slots):
        want = [_complete(url, p, max_tokens=16)["choices"][0]["text"] for p in PROMPTS[:2]]
        calls[0] = 0
        monkeypatch.setattr(StopStrings, "text", text_once)
        t0 = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            rs = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={
                "prompt": p, "max_tokens": 16, "temperature": 0}, timeout=20), PROMPTS[:2]))
        assert time.monotonic() - t0 < 10
        assert sorted(r.status_code for r in rs) == [200, 500], [r.text for r in rs]
        failed = next(r for r in rs if r.status_code == 500)
        assert "injected fault" in failed.json()["error"]["message"]
        ok = next(i for i, r in enumerate(rs) if r.status_code == 200)
        assert rs[ok].json()["choices"][0]["text"] == want[ok]
        assert _slots_freed(url, within=5)
        assert [_complete(url, p, max_tokens=16)["choices"][0]["text"] for p in PROMPTS[:2]] == want
