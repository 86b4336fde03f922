"""logprobs in the server's slots (``--parallel``): the generated tokens' log-probabilities from the rows the
batched engine verified, equal to what llama_cpp.Llama(logits_all=True) reports for the request alone (the
shipped demo pair: real acceptance, so accepted drafted tokens' rows are covered, not only rejected ones)."""
from __future__ import annotations

import gc
import json
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import httpx
import llama_cpp
import numpy as np
import pytest

from dflash_gguf import Llama
from dflash_gguf.requests import logprobs as L
from dflash_gguf.demo import DEMO_DIR
from support import serve

TARGET, DRAFTER = DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
KW = dict(n_ctx=512, n_threads=2, seed=0, verbose=False, chat_format="chatml")
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import json\n\ndef load(path):\n",
           "for i in range(10):\n"]
# log-probabilities of a k-row verify and of llama_cpp's one-row decodes: the same up to rounding. The demo
# target is F16: ggml multiplies several rows through llamafile's sgemm and one row through its F16 dot
# product, which accumulate in different orders (seen: up to 8e-4 on logits of order 10); the tokens, their
# order in the top and their text are exact
TOL = dict(rel=1e-3, abs=2e-3)


@pytest.fixture(scope="module")
def reference():
    llm = llama_cpp.Llama(str(TARGET), logits_all=True, **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def server():
    from dflash_gguf.server import create_app

    llm = Llama(str(TARGET), draft_model_path=str(DRAFTER), draft_adaptive=False, **KW)   # blocks pinned
    app = create_app(llm, "demo", parallel=3)
    with serve(app) as url:
        yield url, app.state.server
    app.state.server.slots.close()
    llm.close()


def _post(url, path, body):
    r = httpx.post(f"{url}{path}", json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, path, body):
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={"temperature": 0, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def assert_same_logprobs(got: dict, want: dict):
    assert got["tokens"] == want["tokens"] and got["text_offset"] == want["text_offset"]
    assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], **TOL)
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in want["top_logprobs"]], "the same top, in order"
    for g, w in zip(got["top_logprobs"], want["top_logprobs"]):
        assert list(g.values()) == pytest.approx(list(w.values()), **TOL)


def test_completion_logprobs_equal_llama_cpp_alone(server, reference):
    """Concurrent requests (batched steps, drafted blocks accepted), different k, a stop string mid-output."""
    url, srv = server
    cases = [(p, dict(max_tokens=24, logprobs=k)) for p, k in zip(PROMPTS, (0, 1, 3, 5))]
    want0 = reference.create_completion(PROMPTS[0], max_tokens=24, temperature=0)["choices"][0]["text"]
    stop = want0[len(want0) // 2:len(want0) // 2 + 3]
    cases.append((PROMPTS[0], dict(max_tokens=24, logprobs=2, stop=[stop])))
    before = srv.slots.sequences
    with ThreadPoolExecutor(len(cases)) as ex:
        got = list(ex.map(lambda c: _post(url, "/v1/completions", {"prompt": c[0], **c[1]}), cases))
    assert srv.slots.sequences > before
    assert sum(g["dflash"]["accepted"] for g in got) > 0, "drafted tokens were accepted (their rows reported)"
    for (p, kw), g in zip(cases, got):
        want = reference.create_completion(p, temperature=0, **kw)["choices"][0]
        assert g["choices"][0]["text"] == want["text"]
        assert_same_logprobs(g["choices"][0]["logprobs"], want["logprobs"])
        k = kw["logprobs"]
        assert all(len(t) in (k, k + 1) for t in g["choices"][0]["logprobs"]["top_logprobs"])
    assert stop not in got[-1]["choices"][0]["text"] and got[-1]["choices"][0]["finish_reason"] == "stop"


def test_chat_logprobs_equal_llama_cpp_alone(server, reference):
    url, _ = server
    messages = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    got = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 20, "logprobs": True,
                                              "top_logprobs": 3})
    want = reference.create_chat_completion(messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3)
    g, w = got["choices"][0], want["choices"][0]
    assert g["message"]["content"] == w["message"]["content"]
    gc, wc = g["logprobs"]["content"], w["logprobs"]["content"]
    assert [x["token"] for x in gc] == [x["token"] for x in wc] and len(gc) > 0
    assert [x["logprob"] for x in gc] == pytest.approx([x["logprob"] for x in wc], **TOL)
    assert [[t["token"] for t in x["top_logprobs"]] for x in gc] == [[t["token"] for t in x["top_logprobs"]] for x in wc]
    plain = _post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 20})
    assert plain["choices"][0]["logprobs"] is None and plain["choices"][0]["message"] == g["message"]


def test_streamed_logprobs_add_up_to_the_whole_responses(server):
    """Each chunk carries the tokens whose text it completes; together, the non-streamed response's."""
    url, _ = server
    for body in ({"prompt": PROMPTS[1], "max_tokens": 24, "logprobs": 2},
                 {"prompt": PROMPTS[2], "max_tokens": 24, "logprobs": 1, "stop": ["\n\n"]}):
        whole = _post(url, "/v1/completions", body)["choices"][0]
        chunks = _stream(url, "/v1/completions", body)
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        assert len(parts) > 1, "streamed as the tokens come"
        joined = {k: sum((p[k] for p in parts), []) for k in ("tokens", "text_offset", "token_logprobs", "top_logprobs")}
        want = whole["logprobs"]
        assert {k: joined[k] for k in ("tokens", "text_offset")} == {k: want[k] for k in ("tokens", "text_offset")}
        # the same tokens' rows; the first one's float rounding follows its decode's rows (the whole prompt's
        # tail with it where the prompt was new, the last prompt token alone where it was cached)
        assert joined["token_logprobs"] == pytest.approx(want["token_logprobs"], rel=1e-5, abs=1e-6)
        assert [list(t) for t in joined["top_logprobs"]] == [list(t) for t in want["top_logprobs"]]
        for got, ref in zip(joined["top_logprobs"], want["top_logprobs"]):
            assert list(got.values()) == pytest.approx(list(ref.values()), rel=1e-5, abs=1e-6)
        text = ""
        for c in chunks:
            if not c["choices"]:
                continue
            text += c["choices"][0]["text"]
            lp = c["choices"][0]["logprobs"]
            if lp and c["choices"][0]["finish_reason"] is None and len(text) < len(whole["text"]):
                # before the end, a chunk's tokens' text is all sent
                last = lp["text_offset"][-1] - len(body["prompt"]) + len(lp["tokens"][-1])
                assert last <= len(text)


def test_sampled_requests_report_their_own_tokens(server):
    """Sampled (DFlash's sampled verify): every reported token is the one generated, with a log-probability
    no higher than the best alternative's, and the top in llama_cpp's order."""
    url, _ = server
    r = _post(url, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": 24, "logprobs": 4, "temperature": 0.8,
                                       "seed": 3})["choices"][0]
    lp = r["logprobs"]
    assert "".join(lp["tokens"]) == r["text"]
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        best = list(top.values())[:4]               # the top 4 in order (the token's own entry comes after them)
        assert v <= 0 and top[tok] == v and best[0] >= v
        assert best == sorted(best, reverse=True)


def test_top_k_and_log_softmax_follow_llama_cpp():
    rng = np.random.default_rng(0)
    row = rng.normal(size=1000).astype(np.float32) * 4
    row[[10, 20, 30]] = row.max() + 1          # a tie at the top: llama_cpp puts the larger id first
    lp = L.log_softmax(row)
    assert np.array_equal(lp, llama_cpp.Llama.logits_to_logprobs(row))
    want = sorted(zip(lp.tolist(), range(len(lp))), reverse=True)[:7]
    assert list(L.top_k(lp, 7)) == [(i, v) for v, i in want]
    assert [i for i, _ in L.top_k(lp, 3)] == [30, 20, 10]
    assert L.top_k(lp, 0) == ()


def test_the_collector_reports_kept_tokens_up_to_the_end_token():
    c = L.Collector(2, end_tokens=[9])
    rows = [np.eye(12, dtype=np.float32)[i] * 5 for i in (3, 4, 9, 5)]
    for r in rows:
        c.sink(0, r)
    c.commit([3, 4, 9, 5])                      # the end token is no token of the completion
    assert [e.token for e in c.entries] == [3, 4]
    assert c.entries[0].top[0][0] == 3 and c.entries[0].logprob == pytest.approx(float(L.log_softmax(rows[0])[3]))
    for r in rows[:3]:
        c.sink(0, r)
    c.commit([3])                               # a consumer that kept one token: the other rows are dropped
    c.sink(0, rows[1])
    c.commit([4])
    assert [e.token for e in c.entries] == [3, 4, 3, 4]


def _freed(*refs, seconds: float = 2.0) -> bool:
    """Whether every ``weakref`` target is freed within ``seconds``: the slots' thread hands a request its last
    tokens before its own step returns, so its frame may hold the job for a moment after the response arrives."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        if all(r() is None for r in refs) or time.monotonic() > deadline:
            return all(r() is None for r in refs)
        time.sleep(0.01)


def test_nothing_of_a_logprobs_request_survives_its_slot():
    """A finished request leaves nothing of its own on its slot, idle or not: the next requests there sink no logits row
    into its collector, and the request, its job and its collector are freed (a long-running server would
    otherwise keep growing them with every later request's rows)."""
    from dflash_gguf.server import create_app

    llm = Llama(str(TARGET), draft_model_path=str(DRAFTER), draft_adaptive=False, **KW)
    app = create_app(llm, "demo", parallel=1)      # one slot: every request runs where the first one did
    slots = app.state.server.slots
    seen = []
    submit = slots.submit

    def watched(job):
        seen.append((weakref.ref(job), weakref.ref(job.request), job.logprobs and weakref.ref(job.logprobs)))
        submit(job)
    slots.submit = watched
    try:
        with serve(app) as url:
            r = _post(url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 16, "logprobs": 2})
            n = len(r["choices"][0]["logprobs"]["tokens"])
            collector = seen[0][2]()
            assert collector is not None and len(collector.entries) == n > 0 and not collector._rows
            del collector
            # the slot waiting idle holds none of it either
            assert _freed(seen[0][2], seen[0][1]), "the idle slot keeps its last request"
            for p in PROMPTS:
                _post(url, "/v1/completions", {"prompt": p, "max_tokens": 16})
            _freed(seen[0][2])
            left = seen[0][2]()
            assert left is None, (f"the collector survived its request: {len(left.entries)} entries for {n} "
                                   f"tokens, {len(left._rows)} rows of later requests")
            assert _freed(seen[0][0], seen[0][1]), "the request survived its slot"
    finally:
        slots.close()
        llm.close()
