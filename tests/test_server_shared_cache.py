"""The default server: 4 slots sharing the model's own context, one KV cache of ``-c`` cells (llama-server's
``-np -1``). More clients than the cache holds wait for room or give their cells back and resume; a request
on llama_cpp's own path takes the cache to itself between slot requests. Every response is the request's
answer alone: greedy ones llama_cpp's, seeded sampled ones their own answer served alone (the shipped demo
pair; a small ``-c`` so that the cache runs out)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import llama_cpp
import pytest

from dflash_gguf.demo import DEMO_DIR
from dflash_gguf.server.cli import build, parser
from support import serve

TARGET, DRAFTER = DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
CELLS = 256
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import json\n\ndef load(path):\n",
           "for i in range(10):\n", "def add(a, b):\n    return", "# sort a list\n", "x = [", "while True:\n"]


@pytest.fixture(scope="module")
def server():
    # the command line's defaults but for a small cache, two threads, blocks pinned (the speed gate's choices
    # follow this machine's timings) and every position's logits (so that an echoed prompt's logprobs run on
    # llama_cpp's own path)
    args = parser().parse_args(["-m", str(TARGET), "-md", str(DRAFTER), "-c", str(CELLS), "-t", "2",
                                "--no-draft-adaptive", "--logits-all"])
    app, llm = build(args)
    with serve(app) as url:
        yield url, app.state.server, llm, args
    app.state.server.slots.close()
    llm.close()


@pytest.fixture(scope="module")
def plain():
    llm = llama_cpp.Llama(str(TARGET), n_ctx=512, n_threads=2, seed=0, verbose=False, flash_attn=True,
                          logits_all=True)
    yield llm
    llm.close()


def _post(url, path, body, status=200):
    r = httpx.post(f"{url}{path}", json=body, timeout=600)
    assert r.status_code == status, r.text
    return r.json()


def _complete(url, prompt, **kw):
    return _post(url, "/v1/completions", {"prompt": prompt, "temperature": 0, **kw})


def _text(r) -> str:
    c = r["choices"][0]
    return c["message"]["content"] if "message" in c else c["text"]


def _greedy(plain, prompt, n):
    return plain.create_completion(prompt, max_tokens=n, temperature=0)["choices"][0]["text"]


class _Preempted:
    """The prompts (token ids as admitted) of the requests that gave their cells back, from now on."""

    def __init__(self, slots):
        self.prompts: list[list[int]] = []
        dec = slots.decoder
        inner = dec._preempt

        def record(s):
            if s.request is not None:
                self.prompts.append(list(s.request.prompt))
            inner(s)
        dec._preempt = record
        self._undo = lambda: setattr(dec, "_preempt", inner)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._undo()


def test_the_default_server_has_four_slots_sharing_one_cache_of_c_cells(server, plain):
    url, srv, llm, args = server
    assert args.parallel == -1
    sl = srv.slots
    assert sl.n == 4 and sl.shared
    # one context: the model's own, made as one unified KV cache of -c cells for the 4 sequences
    assert sl.target.ptr == llm._ctx.ctx
    assert llm.context_params.n_seq_max == 4 and llm.context_params.kv_unified
    assert sl.target.n_cells == llm.n_ctx() == CELLS == llama_cpp.llama_n_ctx(llm._ctx.ctx)
    assert sl.target.n_ctx == CELLS, "a sequence may use every cell"
    assert httpx.get(f"{url}/health").json()["slots"] == {"total": 4, "busy": 0, "waiting": 0}
    m = httpx.get(f"{url}/metrics?format=json").json()["slots"]
    assert m["shared"] is True and m["cells"] == CELLS
    # alone, a request uses nearly the whole cache (prompt + 240 tokens of 256 cells), as with -np 1
    n = CELLS - 16
    r = _complete(url, PROMPTS[0], max_tokens=n, ignore_eos=False)
    assert _text(r) == _greedy(plain, PROMPTS[0], n)
    # a prompt longer than -c fails alone, as it always did
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x " * (CELLS + 50), "max_tokens": 4}, timeout=120)
    assert r.status_code == 400, r.text


def test_more_clients_than_the_cache_holds_all_complete_as_alone(server, plain):
    """8 clients, each wanting about 130 cells of 256: they wait for room, and those admitted last give their
    cells back when the running ones need them, resuming unseen - every text llama_cpp's alone. (Any two
    running requests outgrow the cache, so it runs out however the clients' arrivals interleave.)"""
    url, srv, _, _ = server
    n = 120
    want = [_greedy(plain, p, n) for p in PROMPTS]
    before = srv.slots.decoder.preempted
    with _Preempted(srv.slots) as seen, ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: _complete(url, p, max_tokens=n), PROMPTS))
    assert [_text(g) for g in got] == want
    assert all(g["usage"]["completion_tokens"] == n for g in got)
    assert srv.slots.decoder.preempted > before and seen.prompts, "the cache never ran out: no preemption tested"
    f = srv.slots.figures()
    assert f["busy"] == 0 and f["waiting"] == 0 and f["mean_batch"] > 1


def test_streams_of_preempted_requests_are_uninterrupted(server, plain):
    url, srv, _, _ = server
    n = 120     # any two running requests outgrow the 256 cells: the cache runs out whatever the timing

    def stream(p):
        text, last = "", None
        with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": p, "max_tokens": n, "temperature": 0,
                                                                  "stream": True}, timeout=600) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    import json
                    c = json.loads(line[6:])
                    assert "error" not in c, c
                    text += c["choices"][0]["text"]
                    last = c
        return text, last["choices"][0]["finish_reason"]

    before = srv.slots.decoder.preempted
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(stream, PROMPTS[:6]))
    assert got == [(_greedy(plain, p, n), "length") for p in PROMPTS[:6]]
    assert srv.slots.decoder.preempted > before


def test_a_seeded_sampled_request_under_load_equals_its_answer_alone(server):
    """What a seeded sampled request guarantees: its text is a function of the request and its seed alone -
    served alone, beside other requests, given its cells back and resumed: token for token the same (each
    position's draw comes from the seed and the position: dflash_gguf.decoding.sampling.TokenChooser)."""
    url, srv, _, _ = server
    body = dict(max_tokens=100, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _complete(url, PROMPTS[3], **body)
    assert alone["usage"]["completion_tokens"] == 100
    before = srv.slots.decoder.preempted
    ids = None
    with _Preempted(srv.slots) as seen, ThreadPoolExecutor(8) as pool:
        loads = [pool.submit(_complete, url, p, max_tokens=150, ignore_eos=True) for p in PROMPTS[4:7]]
        deadline = time.monotonic() + 120
        while srv.slots.busy() < 3:          # the three long requests run: the seeded one is admitted last,
            assert time.monotonic() < deadline, "the load requests never started"
            time.sleep(0.005)                # so it is the first to give its cells back
        again = pool.submit(_complete, url, PROMPTS[3], **body).result()
        [f.result() for f in loads]
        ids = [p for p in seen.prompts]
    assert _text(again) == _text(alone)
    assert srv.slots.decoder.preempted > before
    tokenized = srv.llm.tokenize(PROMPTS[3].encode(), special=True)
    assert tokenized in ids, "the seeded request itself was not preempted"


def test_mixed_requests_under_load_equal_their_answers_alone(server, plain):
    """Grammar, chat JSON mode, logprobs and seeded sampled requests beside long greedy ones (the cache runs
    out): each equals what it gives alone."""
    url, srv, _, _ = server
    g = 'root ::= [a-z ]+ | "(" [a-z, ]* ")" [a-z:\n ]*'
    cases = [
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "grammar": g}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a JSON object, please"}], "max_tokens": 32,
                                  "temperature": 0, "response_format": {"type": "json_object"}}),
        ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 24, "temperature": 0, "logprobs": 2}),
        ("/v1/completions", {"prompt": PROMPTS[2], "max_tokens": 40, "temperature": 0.8, "seed": 5}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "write a loop"}], "max_tokens": 40,
                                  "temperature": 0.7, "top_k": 20, "seed": 9}),
    ]
    alone = [_post(url, path, body) for path, body in cases]
    loads = PROMPTS[4:8]
    want_loads = [_greedy(plain, p, 80) for p in loads]
    with ThreadPoolExecutor(9) as pool:
        lf = [pool.submit(_complete, url, p, max_tokens=80) for p in loads]
        cf = [pool.submit(_post, url, path, body) for path, body in cases]
        got = [f.result() for f in cf]
        got_loads = [_text(f.result()) for f in lf]
    assert got_loads == want_loads
    for a, b in zip(alone, got):
        assert _text(a) == _text(b)
        lp_a, lp_b = a["choices"][0].get("logprobs"), b["choices"][0].get("logprobs")
        if lp_a is not None:
            assert lp_a["tokens"] == lp_b["tokens"] and lp_a["text_offset"] == lp_b["text_offset"]
            # within float rounding: a verify row's sums follow where its sequence's cells lie in the shared cache
            # and which rows share its decode (a resumed request's cache was prefilled again in other chunks)
            assert lp_b["token_logprobs"] == pytest.approx(lp_a["token_logprobs"], rel=2e-3, abs=1e-4)
            assert [list(t) for t in lp_a["top_logprobs"]] == [list(t) for t in lp_b["top_logprobs"]]


def test_a_llama_cpp_path_request_between_slot_requests(server, plain):
    """An echoed prompt's logprobs run on llama_cpp's own path, which removes positions of every sequence: it
    waits for the slots' requests to finish, has the cache to itself (slot requests that come meanwhile wait),
    and the slots start again from an empty cache - every answer as alone."""
    url, srv, _, _ = server
    n = 48
    want = {p: _greedy(plain, p, n) for p in PROMPTS}
    echo = plain.create_completion(PROMPTS[5], max_tokens=8, temperature=0, echo=True, logprobs=2)["choices"][0]
    lent = srv.slots.lent
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(_complete, url, p, max_tokens=n) for p in PROMPTS[:3]]
        time.sleep(0.3)
        own = pool.submit(_complete, url, PROMPTS[5], max_tokens=8, echo=True, logprobs=2)
        time.sleep(0.3)
        later = [pool.submit(_complete, url, p, max_tokens=n) for p in PROMPTS[3:5]]
        r = own.result()
        assert r["dflash"] is None or "steps" in r["dflash"] or r["dflash"].get("enabled") is not None
        c = r["choices"][0]
        assert c["text"] == echo["text"] and c["logprobs"]["tokens"] == echo["logprobs"]["tokens"]
        assert [_text(f.result()) for f in first + later] == [want[p] for p in PROMPTS[:5]]
    assert srv.slots.lent == lent + 1
    # and after it: slot requests (a prompt the Llama's path left in the cache too) as alone
    with ThreadPoolExecutor(3) as pool:
        after = list(pool.map(lambda p: _text(_complete(url, p, max_tokens=n)), [PROMPTS[5], PROMPTS[6], PROMPTS[0]]))
    assert after == [want[PROMPTS[5]], want[PROMPTS[6]], want[PROMPTS[0]]]
    assert httpx.get(f"{url}/health").json()["busy"] is False


def test_the_engine_shares_cells_and_preempts_losslessly():
    """The batched engine on one cache of 256 cells for 3 sequences (ContextOptions.shared), no server: 5 requests
    of 150 tokens (no end token stops them) cannot all fit, so the latest give their cells back and resume -
    greedy ones token for token llama_cpp's alone, a seeded sampled one its own answer alone."""
    from dflash_gguf.decoding import DFlashDecoder, Request, SpecOptions
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding.sampling import SamplingParams
    from support import llama_cpp_greedy

    n = 150
    tm, dm = Model(TARGET), Model(DRAFTER)
    prompts = [tm.tokenize(p.encode()) for p in PROMPTS[:5]]
    seeded = SamplingParams(temperature=0.8, seed=21)
    try:
        opts = ContextOptions(n_ctx=CELLS, n_batch=256, n_ubatch=256, n_threads=2, n_seq=3, shared=True)
        with Context(tm, opts) as tc, Context(dm, opts, other=tc) as dc:
            assert tc.n_cells == CELLS and tc.n_ctx == CELLS      # one cache: any sequence may use all of it
            assert dc.n_cells == 3 * dc.n_ctx                     # the drafter: a window per sequence
            dec = DFlashDecoder(tc, dc, SpecOptions())
            assert dec.n_cells == CELLS
            alone = dec.generate_batch([Request(prompts[4], n, seeded, stop_tokens=[])])[0]
            reqs = [Request(p, n, stop_tokens=[]) for p in prompts[:4]] + [Request(prompts[4], n, seeded, stop_tokens=[])]
            got = dec.generate_batch(reqs)
            assert dec.preempted > 0, "the cache never ran out"
            assert dec.cells_used() <= CELLS
        assert got[4] == alone
        for p, g in zip(prompts[:4], got[:4]):
            assert g == llama_cpp_greedy(TARGET, p, n)
    finally:
        dm.close()
        tm.close()
