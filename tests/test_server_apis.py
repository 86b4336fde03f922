"""The other APIs the server speaks (dflash_gguf.server.translate, dflash_gguf.server.extras), driven by
the official openai and anthropic clients: OpenAI's Responses API, Anthropic's Messages API, embeddings,
llama-server's and llama_cpp.server's tokenizer routes. Every generation answer must be the chat route's
answer to the same messages (greedy: the same text), with DFlash serving it."""
from __future__ import annotations

import base64
import json
import struct
import time

import anthropic
import httpx
import llama_cpp
import numpy as np
import openai
import pytest

from dflash_gguf.server import create_app
from support import KW, assert_served, fast, oracle, pair, plain, serve  # noqa: F401 (fixtures)

MODEL_ID = "tiny-qwen3"
SYSTEM = "Python only."
USER = "def add(a, b):"
# the anthropic client (2.x) has no sampling arguments: they go in the body, as llama-server takes them
GREEDY = {"temperature": 0}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}


@pytest.fixture(scope="module")
def app(fast):
    return create_app(fast, MODEL_ID)


@pytest.fixture(scope="module")
def base_url(app):
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=60)


def chat(client, messages, plain=None, oracle=None, **kw):
    """The chat route's greedy answer (``plain``: llama_cpp's first, so that the oracle drafts it)."""
    if plain is not None:
        extra = kw.get("extra_body") or {}
        plain.create_chat_completion(messages, temperature=0, **{k: v for k, v in kw.items() if k != "extra_body"},
                                     **extra)
        oracle.learn(plain)
    return client.chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, **kw)


def sse(base_url, path, body) -> list[tuple[str, dict]]:
    """A stream's events as (event name, data)."""
    out = []
    with httpx.stream("POST", base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for block in r.read().decode().split("\n\n"):
            lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
            if "data" in lines:
                out.append((lines.get("event"), json.loads(lines["data"])))
    return out


# --------------------------------------------------------------------------- Responses API
def test_responses_equal_chat(client, plain, oracle):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    want = chat(client, msgs, plain, oracle, max_tokens=20)
    r = client.responses.create(model=MODEL_ID, instructions=SYSTEM, input=USER, max_output_tokens=20, temperature=0)
    assert r.output_text == want.choices[0].message.content
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL_ID
    assert (r.status == "incomplete") == (want.choices[0].finish_reason == "length")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert_served(r.model_extra["dflash"])
    # the same as a list of message items, with content parts
    r2 = client.responses.create(model=MODEL_ID, max_output_tokens=20, temperature=0, input=[
        {"role": "developer", "content": SYSTEM},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": USER}]}])
    assert r2.output_text == r.output_text


def test_responses_stream(client, base_url, plain, oracle):
    msgs = [{"role": "user", "content": "import os\n"}]
    want = chat(client, msgs, plain, oracle, max_tokens=25).choices[0].message.content
    events = list(client.responses.create(model=MODEL_ID, input="import os\n", max_output_tokens=25, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if events[-1].response.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == want
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == want
    final = events[-1].response
    assert final.output_text == want and final.usage.output_tokens > 0
    assert_served(final.model_extra["dflash"])
    # the wire: named events, as OpenAI sends them
    names = [name for name, data in sse(base_url, "/v1/responses", {"input": "x", "max_output_tokens": 3,
                                                                    "stream": True, "temperature": 0})]
    assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")


def test_previous_response_id_continues_the_conversation(client, base_url, fast, plain, oracle):
    r1 = client.responses.create(model=MODEL_ID, input=USER, max_output_tokens=12, temperature=0)
    r2 = client.responses.create(model=MODEL_ID, input="class A:", previous_response_id=r1.id,
                                 max_output_tokens=12, temperature=0)
    # the server's prompt held the first exchange
    seen = fast.detokenize(fast.input_ids[: fast.n_tokens].tolist()).decode("utf-8", "replace")
    assert USER in seen and r1.output_text in seen and "class A:" in seen
    msgs = [{"role": "user", "content": USER}, {"role": "assistant", "content": r1.output_text},
            {"role": "user", "content": "class A:"}]
    want = chat(client, msgs, max_tokens=12)
    assert r2.output_text == want.choices[0].message.content
    assert r2.usage.input_tokens == want.usage.prompt_tokens > r1.usage.input_tokens
    assert r2.previous_response_id == r1.id
    # a stream is stored too, and a stored response can be read back
    events = list(client.responses.create(model=MODEL_ID, input="x = 1", previous_response_id=r2.id,
                                          max_output_tokens=5, temperature=0, stream=True))
    r3 = events[-1].response
    assert client.responses.retrieve(r3.id).output_text == r3.output_text
    r4 = client.responses.create(model=MODEL_ID, input="y", previous_response_id=r3.id, max_output_tokens=3,
                                 temperature=0)
    assert r4.usage.input_tokens > r3.usage.input_tokens
    # store=false: nothing to continue from
    r5 = client.responses.create(model=MODEL_ID, input="z", max_output_tokens=2, temperature=0, store=False)
    for rid in (r5.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model=MODEL_ID, input="y", previous_response_id=rid, max_output_tokens=2)
        assert rid in e.value.message and e.value.code == "previous_response_not_found"


def test_response_store_is_bounded():
    from dflash_gguf.server.translate import ResponseStore

    store = ResponseStore(size=3)
    for i in range(5):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
        if i == 2:
            store.get("r0")          # used: kept over r1
    assert store.get("r0")[1]["id"] == "r0" and store.get("r4")[1]["id"] == "r4"
    for gone in ("r1", "r2"):
        with pytest.raises(Exception, match="not found"):
            store.get(gone)


def test_responses_function_tools(client, plain, oracle):
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    tool = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}
    want = chat(client, msgs, plain, oracle, max_tokens=24, tools=[tool],
                tool_choice={"type": "function", "function": {"name": "add"}}).choices[0].message
    kw = dict(model=MODEL_ID, input="add 2 and 3", max_output_tokens=24, temperature=0,
              tools=[{"type": "function", "name": "add", "parameters": SCHEMA}],
              tool_choice={"type": "function", "name": "add"})
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [c.name for c in calls] == ["add"]
    assert calls[0].arguments == want.tool_calls[0].function.arguments
    assert calls[0].call_id.startswith("call__0_add_") and calls[0].status == "completed"   # llama_cpp's ids
    events = list(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == want.tool_calls[0].function.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and done.name == "add"
    assert [o.type for o in events[-1].response.output] == ["function_call"]
    # the call's output goes back as a function_call_output item
    r2 = client.responses.create(model=MODEL_ID, previous_response_id=r.id, max_output_tokens=4, temperature=0,
                                 input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}])
    assert r2.status in ("completed", "incomplete")


def test_responses_json_format(client, plain, oracle):
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    want = chat(client, msgs, plain, oracle, max_tokens=24,
                extra_body={"response_format": {"type": "json_object", "schema": SCHEMA}})
    r = client.responses.create(model=MODEL_ID, input="add 2 and 3", max_output_tokens=24, temperature=0,
                                text={"format": {"type": "json_schema", "name": "add", "schema": SCHEMA}})
    assert r.output_text == want.choices[0].message.content


# --------------------------------------------------------------------------- Messages API
def test_messages_equal_chat(client, claude, plain, oracle):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    want = chat(client, msgs, plain, oracle, max_tokens=20)
    m = claude.messages.create(model=MODEL_ID, max_tokens=20, system=SYSTEM, extra_body=GREEDY,
                               messages=[{"role": "user", "content": USER}])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_ID
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert m.usage.input_tokens == want.usage.prompt_tokens
    assert m.usage.output_tokens == want.usage.completion_tokens
    assert_served(m.model_extra["dflash"])
    # system and content as blocks
    m2 = claude.messages.create(model=MODEL_ID, max_tokens=20, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM}],
                                messages=[{"role": "user", "content": [{"type": "text", "text": USER}]}])
    assert m2.content[0].text == m.content[0].text


def test_messages_stream(client, claude, base_url, plain, oracle):
    msgs = [{"role": "user", "content": "class A:"}]
    want = chat(client, msgs, plain, oracle, max_tokens=25)
    with claude.messages.stream(model=MODEL_ID, max_tokens=25, messages=msgs, extra_body=GREEDY) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == want.choices[0].message.content
    assert final.content[0].text == want.choices[0].message.content
    assert final.usage.output_tokens == want.usage.completion_tokens
    assert final.stop_reason in ("max_tokens", "end_turn")
    events = sse(base_url, "/v1/messages", {"max_tokens": 25, "temperature": 0, "messages": msgs, "stream": True})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(n == d["type"] for n, d in events)
    assert events[0][1]["message"]["usage"]["input_tokens"] == want.usage.prompt_tokens
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == \
        want.choices[0].message.content
    assert_served(events[-2][1]["dflash"])


def test_messages_stop_sequences(client, claude, plain, oracle):
    msgs = [{"role": "user", "content": USER}]
    full = chat(client, msgs, plain, oracle, max_tokens=30).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = chat(client, msgs, max_tokens=30, stop=[stop]).choices[0].message.content
    assert want == full[: full.index(stop)]
    m = claude.messages.create(model=MODEL_ID, max_tokens=30, messages=msgs, stop_sequences=[stop],
                               extra_body=GREEDY)
    assert m.content[0].text == want and m.stop_reason == "end_turn"


def test_messages_tools(client, claude, plain, oracle):
    msgs = [{"role": "user", "content": "add 2 and 3"}]
    tool = {"type": "function", "function": {"name": "add", "parameters": SCHEMA}}
    want = chat(client, msgs, plain, oracle, max_tokens=40, tools=[tool],
                tool_choice={"type": "function", "function": {"name": "add"}}).choices[0].message
    args = want.tool_calls[0].function.arguments
    kw = dict(model=MODEL_ID, max_tokens=40, extra_body=GREEDY, messages=msgs,
              tools=[{"name": "add", "description": "adds", "input_schema": SCHEMA}],
              tool_choice={"type": "tool", "name": "add"})
    m = claude.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    try:
        parsed = json.loads(args)
    except ValueError:        # cut by max_tokens: the call's text, as llama-server answers it
        assert [b.type for b in m.content] == ["text"] and m.content[0].text == args
    else:
        assert [b.type for b in m.content] == ["tool_use"]
        assert m.content[0].name == "add" and m.content[0].input == parsed
    with claude.messages.stream(**kw) as s:
        events = list(s)
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert partial == args
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "add"
    # the result goes back as a tool_result block
    if m.content[0].type == "tool_use":
        m2 = claude.messages.create(model=MODEL_ID, max_tokens=4, extra_body=GREEDY, messages=[
            *msgs, {"role": "assistant", "content": [m.content[0].model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": m.content[0].id, "content": "5"}]}])
        assert m2.usage.input_tokens > m.usage.input_tokens


def test_count_tokens(claude, client):
    msgs = [{"role": "user", "content": USER}]
    n = claude.messages.count_tokens(model=MODEL_ID, system=SYSTEM, messages=msgs).input_tokens
    want = chat(client, [{"role": "system", "content": SYSTEM}, *msgs], max_tokens=1)
    assert n == want.usage.prompt_tokens


# --------------------------------------------------------------------------- tokenizer
def test_tokenize_and_detokenize(base_url, plain):
    text = "def main():\n    return 'héllo' </s>"
    post = lambda path, body: httpx.post(base_url + path, json=body, timeout=30)  # noqa: E731
    r = post("/tokenize", {"content": text})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert ids == plain.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    assert plain.token_eos() in ids      # special tokens parsed, as llama-server does by default
    assert post("/tokenize", {"content": text, "parse_special": False}).json()["tokens"] == \
        plain.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    assert post("/tokenize", {"content": text, "add_special": True}).json()["tokens"] == \
        plain.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    content = post("/detokenize", {"tokens": ids}).json()["content"]
    assert content == plain.detokenize(ids, special=True).decode("utf-8")
    # the tiny target's vocabulary is SentencePiece's: llama.cpp puts a space before the first word
    # (add_space_prefix) and, as llama-server, keeps it on the way back
    assert content == " " + text
    pieces = post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(p["piece"].encode("utf-8") if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert raw.decode("utf-8") == content
    assert post("/tokenize", {"content": ""}).json() == {"tokens": []}
    # llama_cpp.server's shapes (BOS added; llama_cpp drops the space after it)
    ex = post("/extras/tokenize", {"input": text}).json()["tokens"]
    assert ex == plain.tokenize(text.encode("utf-8"), special=True) and ex[0] == plain.token_bos()
    assert post("/extras/tokenize/count", {"input": text}).json() == {"count": len(ex)}
    assert post("/extras/detokenize", {"tokens": ex}).json() == {"text": plain.detokenize(ex).decode("utf-8")}


# --------------------------------------------------------------------------- embeddings
def test_embeddings(client, base_url, pair, fast, plain, oracle):
    texts = ["def main(", "import os\nimport sys\n"]
    ref = llama_cpp.Llama(str(pair.target), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, **KW)
    try:
        want = [ref.create_embedding(t)["data"][0]["embedding"] for t in texts]
        n_ref = ref.create_embedding(texts)["usage"]["prompt_tokens"]
    finally:
        ref.close()
    before = (fast.n_tokens, fast.input_ids[: fast.n_tokens].tolist())
    r = client.embeddings.create(model=MODEL_ID, input=texts)      # the client asks for base64
    assert [d.index for d in r.data] == [0, 1] and r.model == MODEL_ID
    assert all(len(d.embedding) == fast.n_embd() for d in r.data)
    for d, w in zip(r.data, want):
        np.testing.assert_allclose(d.embedding, w, rtol=1e-3, atol=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_ref
    # floats on the wire, and token ids in
    j = httpx.post(base_url + "/v1/embeddings", json={"input": texts[0], "encoding_format": "float"}).json()
    assert j["object"] == "list" and j["data"][0]["object"] == "embedding"
    np.testing.assert_allclose(j["data"][0]["embedding"], r.data[0].embedding, rtol=1e-6)
    ids = fast.tokenize(texts[0].encode("utf-8"))
    j2 = httpx.post(base_url + "/v1/embeddings", json={"input": [ids], "encoding_format": "base64"}).json()
    b = base64.b64decode(j2["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(b) // 4}f", b)) == j["data"][0]["embedding"]
    # the generation context is untouched, and generation goes on as before
    assert (fast.n_tokens, fast.input_ids[: fast.n_tokens].tolist()) == before
    msgs = [{"role": "user", "content": "x = 1\n"}]
    want_chat = chat(client, msgs, plain, oracle, max_tokens=10).choices[0].message.content
    assert client.embeddings.create(model=MODEL_ID, input="y").data
    assert chat(client, msgs, max_tokens=10).choices[0].message.content == want_chat


def test_embeddings_unavailable_is_501_with_a_remedy():
    class Stub:                # a server model llama_cpp cannot pool
        model_path = "stub.gguf"

    with serve(create_app(Stub())) as url:
        r = httpx.post(url + "/v1/embeddings", json={"input": "x"})
    assert r.status_code == 501
    assert r.json()["error"]["code"] == "embeddings_unavailable" and "-m EMBEDDING.gguf" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- bad input
MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/responses", {}, "input"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", {"input": []}, "input"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": "x", "temperature": "hot"}, "temperature"),
    ("/v1/responses", {"input": "x", "tempreature": 0.5}, "tempreature"),
    ("/v1/responses", {"input": [{"role": "wizard", "content": "x"}]}, "role"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input"),
    ("/v1/responses", {"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ("/v1/responses", {"input": [{"type": "function_call_output", "output": "5"}]}, "call_id"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ("/v1/responses", {"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters":
                                                {"type": "array", "items": 5}}]}, "tools"),
    ("/v1/messages", {"messages": MSG}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 5}, "messages"),
    ("/v1/messages", {"max_tokens": 5, "messages": []}, "messages"),
    ("/v1/messages", {"max_tokens": "many", "messages": MSG}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "image"),
    ("/v1/messages", {"max_tokens": 5, "messages": MSG, "temperature": 1.5}, "temperature"),
    ("/v1/messages", {"max_tokens": 5, "messages": MSG, "stop_sequences": [""]}, "stop"),
    ("/v1/messages", {"max_tokens": 5, "messages": MSG, "tools": [{"name": "f"}]}, "tools"),
    ("/v1/messages", {"max_tokens": 5, "messages": MSG, "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ("/v1/messages", {"max_tokens": 5, "messages": MSG, "thinking": {"type": "enabled"}}, "thinking"),
    ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 700}]}, None),
    ("/v1/messages/count_tokens", {"system": "x"}, "messages"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": [1, 2, 99999]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 3}, "dimensions"),
    ("/v1/embeddings", {"input": "word " * 700}, "input"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/extras/tokenize", {"content": "x"}, "input"),
    ("/extras/detokenize", {"tokens": [99999]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{p.strip('/').replace('/', '-')}"
                                                     for i, (p, _, _) in enumerate(BAD)])
def test_bad_request_is_400(base_url, path, body, param):
    for stream in (False, True) if path in ("/v1/responses", "/v1/messages") else (False,):
        b = dict(body, stream=stream) if stream else body
        r = httpx.post(base_url + path, json=b, timeout=30)
        assert r.status_code == 400, (stream, r.text)
        j = r.json()
        if path.startswith("/v1/messages"):
            assert j["type"] == "error" and j["error"]["type"] == "invalid_request_error"
            message = j["error"]["message"]
        else:
            assert j["error"]["type"] == "invalid_request_error"
            message = (j["error"]["param"] or "") + j["error"]["message"]
        assert message
        if param:
            assert param in message, message


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages", "/v1/embeddings", "/tokenize"])
def test_malformed_bodies_are_400(base_url, path, client):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = httpx.post(base_url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400, (raw, r.text)
        assert ("error" in r.json())
    assert client.models.list().data    # the server lives


def test_errors_through_the_clients(client, claude):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL_ID, input=[], max_output_tokens=3)
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL_ID, input="x", dimensions=3)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL_ID, max_tokens=3, messages=[])
    assert "messages" in e.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.get("/v1/messages/nothing", cast_to=object)


def test_api_key_for_both_clients(fast):
    with serve(create_app(fast, MODEL_ID, api_key="sesame")) as url:
        ok = anthropic.Anthropic(base_url=url, api_key="sesame", max_retries=0)
        assert ok.messages.create(model=MODEL_ID, max_tokens=2, messages=MSG).content is not None
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
                model=MODEL_ID, max_tokens=2, messages=MSG)
        o = openai.OpenAI(base_url=url + "/v1", api_key="sesame", max_retries=0)
        assert o.responses.create(model=MODEL_ID, input="x", max_output_tokens=2).output
        r = httpx.post(url + "/tokenize", json={"content": "x"})
        assert r.status_code == 401


@pytest.mark.parametrize("path,body", [("/v1/responses", {"input": USER, "max_output_tokens": 400}),
                                       ("/v1/messages", {"messages": MSG, "max_tokens": 400})])
def test_a_client_leaving_a_stream_stops_its_generation(base_url, client, fast, path, body):
    before = httpx.get(base_url + "/metrics", params={"format": "json"}).json()["client_disconnects"]
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", base_url + path, json=dict(body, stream=True, temperature=0)) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data:") and "delta" in line)
    deadline = time.time() + 10
    while httpx.get(base_url + "/health").json()["busy"]:
        assert time.time() < deadline, "server stayed busy"
        time.sleep(0.02)
    assert httpx.get(base_url + "/metrics", params={"format": "json"}).json()["client_disconnects"] == before + 1
    assert fast.n_tokens == len(fast.decoder.cache) < 300     # stopped early, caches consistent
    assert client.responses.create(model=MODEL_ID, input="x", max_output_tokens=3).output


# --------------------------------------------------------------------------- the slots (--parallel)
def test_slots_serve_the_other_apis(fast, client):
    """With --parallel the translated requests run in the batched engine, with the same answers."""
    msgs = [{"role": "user", "content": USER}]
    want = chat(client, msgs, max_tokens=16)
    app = create_app(fast, MODEL_ID, parallel=2)
    try:
        with serve(app) as url:
            o = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            r = o.responses.create(model=MODEL_ID, input=USER, max_output_tokens=16, temperature=0)
            assert r.output_text == want.choices[0].message.content
            events = list(o.responses.create(model=MODEL_ID, input=USER, max_output_tokens=16, temperature=0,
                                             stream=True))
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
            c = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
            with c.messages.stream(model=MODEL_ID, max_tokens=16, messages=msgs, extra_body=GREEDY) as s:
                assert "".join(s.text_stream) == r.output_text
            assert app.state.server.slots.steps > 0
    finally:
        app.state.server.slots.close()
