"""logits_all=True and logprobs under DFlash: llama_cpp's scores filled from the prompt's rows and the
verify rows of the kept tokens, so its own logprobs code answers the same as with plain decoding
(completions and chat, streamed and not, with echo). Tokens must be equal; values within 1e-2: a batched
verify rounds differently from a one-row decode (measured on this pair: logits differ by up to 3e-3)."""
from __future__ import annotations

import llama_cpp
import pytest

from dflash_gguf import Llama
from dflash_gguf.decoding import OverrideProposer

from support import KW, Oracle, assert_served, both, pair  # noqa: F401 (fixtures)

TOL = 1e-2


@pytest.fixture(scope="module")
def oracle():
    return Oracle()


@pytest.fixture(scope="module")
def plain(pair):
    llm = llama_cpp.Llama(str(pair.target), logits_all=True, **KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def fast(pair, oracle):
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_adaptive=False, logits_all=True, **KW)
    llm.decoder.proposer = OverrideProposer(oracle)
    yield llm
    llm.close()


def _close(a: dict, b: dict) -> None:
    """Two completion logprobs objects: the same tokens, offsets and top-k ids, values within TOL."""
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    for x, y in zip(a["token_logprobs"], b["token_logprobs"]):
        assert (x is None) == (y is None) and (x is None or abs(x - y) < TOL)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.keys() == y.keys() and max(abs(x[k] - y[k]) for k in x) < TOL


@pytest.mark.parametrize("echo", [False, True], ids=["completion", "echo"])
def test_completion_logprobs_equal_llama_cpp(plain, fast, oracle, echo):
    a, b = both(plain, fast, oracle, "create_completion", "def main(", max_tokens=24, temperature=0, logprobs=3,
                echo=echo)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert_served(b["dflash"])
    assert b["dflash"]["accepted"] > 0, "rows of accepted blocks give logprobs too"
    _close(a["choices"][0]["logprobs"], b["choices"][0]["logprobs"])
    assert len(b["choices"][0]["logprobs"]["tokens"]) >= 24


def test_streamed_logprobs_equal_llama_cpp(plain, fast, oracle):
    a, b = both(plain, fast, oracle, "create_completion", "import os\n", max_tokens=20, temperature=0, logprobs=2,
                stream=True)
    la = [c["choices"][0]["logprobs"] for c in a if c["choices"][0]["logprobs"]]
    lb = [c["choices"][0]["logprobs"] for c in b if c["choices"][0]["logprobs"]]
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        _close(x, y)
    assert_served(b[-1]["dflash"])


def test_chat_logprobs_and_grammar_equal_llama_cpp(plain, fast, oracle):
    msgs = [{"role": "user", "content": "x = "}]
    a, b = both(plain, fast, oracle, "create_chat_completion", msgs, max_tokens=16, temperature=0, logprobs=True,
                top_logprobs=2, grammar=llama_cpp.LlamaGrammar.from_string('root ::= [a-z ]+', verbose=False))
    ca, cb = a["choices"][0], b["choices"][0]
    assert cb["message"] == ca["message"]
    assert_served(b["dflash"])
    ta, tb = ca["logprobs"]["content"], cb["logprobs"]["content"]
    assert [t["token"] for t in ta] == [t["token"] for t in tb]
    for x, y in zip(ta, tb):
        assert abs(x["logprob"] - y["logprob"]) < TOL
        assert [t["token"] for t in x["top_logprobs"]] == [t["token"] for t in y["top_logprobs"]]


def test_scores_rows_are_the_target_logits(plain, fast, oracle):
    """After a generation llama_cpp's scores hold the logits of every evaluated position (prompt and
    kept tokens), as its own eval leaves them."""
    both(plain, fast, oracle, "create_completion", "class Foo:\n", max_tokens=20, temperature=0)
    assert fast.n_tokens == plain.n_tokens
    n = plain.n_tokens
    assert (fast.input_ids[:n] == plain.input_ids[:n]).all()
    diff = abs(fast.scores[:n] - plain.scores[:n]).max()
    assert diff < TOL, diff


def test_server_logprobs_with_logits_all(plain, fast, oracle):
    """The server on a Llama with logits_all: completions' logprobs (streamed too) and chats'
    top_logprobs through the openai client, with DFlash, numbers as JSON numbers."""
    import openai

    from dflash_gguf.server import create_app
    from support import serve

    want = plain.create_completion("def main(", max_tokens=12, temperature=0, logprobs=2)["choices"][0]
    oracle.learn(plain)
    wchat = plain.create_chat_completion([{"role": "user", "content": "x = "}], max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2)["choices"][0]
    oracle.learn(plain)
    with serve(create_app(fast, "m")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.completions.create(model="m", prompt="def main(", max_tokens=12, temperature=0, logprobs=2)
        assert r.choices[0].text == want["text"] and r.model_extra["dflash"]["enabled"] is True
        assert r.choices[0].logprobs.tokens == want["logprobs"]["tokens"]
        assert max(abs(x - y) for x, y in zip(r.choices[0].logprobs.token_logprobs,
                                              want["logprobs"]["token_logprobs"])) < TOL
        chunks = list(client.completions.create(model="m", prompt="def main(", max_tokens=12, temperature=0,
                                                logprobs=2, stream=True))
        assert [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens] == want["logprobs"]["tokens"]
        c = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x = "}], max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2)
        assert c.choices[0].message.content == wchat["message"]["content"]
        assert [t.token for t in c.choices[0].logprobs.content] == [t["token"] for t in wchat["logprobs"]["content"]]
