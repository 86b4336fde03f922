"""Chat through GGUFs that carry their own chat template, as released models do.

llama_cpp builds a ``Jinja2ChatFormatter`` from the template with the end-of-turn id as a stopping
criterion; the engine must serve that with DFlash (stopping exactly, mid-block) and give llama_cpp's
text. The end-of-turn token of each test GGUF is chosen so that it falls in the middle of a greedy
answer, and a proposer that knows the answer drafts past it, so the stop cuts a block.
"""
from __future__ import annotations

import inspect

import httpx

import llama_cpp
import llama_cpp.llama_chat_format as llama_chat_format
import openai
import pytest

from dflash_gguf import Llama, StopOnTokens
from dflash_gguf.server import create_app
from dflash_gguf.decoding import OverrideProposer

from chat_templates import LLAMA3, QWEN3, token_mid_answer, with_chat_template
from support import KW, serve

CHAT_KW = {**KW, "chat_format": None}            # None: llama_cpp uses the GGUF's template
MSGS = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]


class Known:
    """Proposes a known token sequence (the plain answer, its end-of-turn token and filler after it)."""

    def __init__(self):
        self.seq: list[int] = []

    def __call__(self, ctx: list[int], n: int) -> list[int]:
        out = self.seq[len(ctx):len(ctx) + n] if self.seq[:len(ctx)] == ctx else []
        return out + [0] * (n - len(out))


def _completion_tokens(llm: llama_cpp.Llama, n_prompt: int) -> list[int]:
    return llm.input_ids[n_prompt:llm.n_tokens].tolist()


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def chat(request, models, tmp_path_factory):
    pair = models.pair("qwen3", "dflash", 8)
    template = {"qwen3": QWEN3, "llama3": LLAMA3}[request.param]
    d = tmp_path_factory.mktemp(f"chat-{request.param}")
    probe_path = with_chat_template(pair.target, d / "probe.gguf", template)
    probe = llama_cpp.Llama(str(probe_path), **CHAT_KW)
    out = probe.create_chat_completion(MSGS, max_tokens=40, temperature=0)
    n_prompt = out["usage"]["prompt_tokens"]
    toks = _completion_tokens(probe, n_prompt)
    eot = token_mid_answer(probe, toks)    # the end-of-turn token
    probe.close()
    assert eot is not None, f"no usable end-of-turn token in {toks}"
    target = with_chat_template(pair.target, d / "chat.gguf", template, eos_token_id=eot)
    plain = llama_cpp.Llama(str(target), **CHAT_KW)
    known = Known()
    fast = Llama(str(target), draft_model_path=str(pair.drafter), draft_adaptive=False, **CHAT_KW)   # blocks pinned
    fast.decoder.proposer = OverrideProposer(known)
    yield plain, fast, known, eot
    fast.close()
    plain.close()


def _plain_chat(plain, known, eot, **kw):
    a = plain.create_chat_completion(MSGS, temperature=0, **kw)
    if kw.get("stream"):
        a = list(a)
    # what the plain path evaluated, then the end-of-turn token and filler: drafted past the stop
    known.seq = plain.input_ids[:plain.n_tokens].tolist() + [eot, 5, 6, 7, 8, 9, 10, 11]
    return a


def test_gguf_template_is_what_llama_cpp_uses(chat):
    """Qwen3's template becomes a Jinja2 formatter with stop ids; Llama 3's is recognised as llama_cpp's
    named "llama-3" format (stop strings)."""
    plain, fast, _, eot = chat
    want = "llama-3" if "start_header_id" in plain.metadata["tokenizer.chat_template"] else "chat_template.default"
    assert plain.chat_format == fast.chat_format == want
    assert plain.token_eos() == eot


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_gguf_template_runs_dflash(chat, stream):
    plain, fast, known, eot = chat
    a = _plain_chat(plain, known, eot, max_tokens=60, stream=stream)
    b = fast.create_chat_completion(MSGS, max_tokens=60, temperature=0, stream=stream)
    if stream:
        b = list(b)
        text_a = "".join(c["choices"][0]["delta"].get("content", "") for c in a)
        text_b = "".join(c["choices"][0]["delta"].get("content", "") for c in b)
        fin_a, fin_b = a[-1]["choices"][0]["finish_reason"], b[-1]["choices"][0]["finish_reason"]
        stats = b[-1]["dflash"]
    else:
        text_a, text_b = a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]
        fin_a, fin_b = a["choices"][0]["finish_reason"], b["choices"][0]["finish_reason"]
        stats = b["dflash"]
        assert b["usage"] == a["usage"]
    assert text_b == text_a and fin_b == fin_a == "stop"
    assert stats["enabled"] is True and stats["finish"] == "stop"
    # the known answer was drafted past the end-of-turn token: the stop cut a block
    assert stats["accepted"] > 0 and stats["steps"] < stats["n_generated"]


def test_enable_thinking_kwarg_with_the_gguf_template(chat):
    plain, fast, known, eot = chat
    handler = (plain._chat_handlers.get(plain.chat_format)
               or llama_chat_format.get_chat_completion_handler(plain.chat_format))
    # the handler with create_chat_completion's own defaults (the handler's differ: repeat_penalty 1.1)
    call = inspect.signature(llama_cpp.Llama.create_chat_completion).bind(plain, MSGS, max_tokens=30, temperature=0)
    call.apply_defaults()
    args = {k: v for k, v in call.arguments.items() if k != "self"}
    a = handler(llama=plain, **args, enable_thinking=False)
    known.seq = plain.input_ids[:plain.n_tokens].tolist() + [eot, 5, 6, 7]
    b = fast.create_chat_completion(MSGS, max_tokens=30, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
    assert b["usage"] == a["usage"] and b["dflash"]["enabled"] is True


def test_logit_reading_criterion_falls_back_visibly(chat):
    """A stopping criterion that is not a StopOnTokens may read the logits: the call decodes plainly, says
    why, and gives llama_cpp's output. (The criterion here stops on the ids' count: llama_cpp 0.3.36 hands a
    criterion an unwritten row of its scores unless logits_all=True, so one that reads them stops on
    whatever that memory holds, in llama_cpp and in the plain path alike.)"""
    plain, fast, _, _ = chat
    n_prompt = len(plain.tokenize(b"def main("))
    crit = llama_cpp.StoppingCriteriaList([lambda ids, logits: len(ids) >= n_prompt + 5])
    a = plain.create_completion("def main(", max_tokens=12, temperature=0, stopping_criteria=crit)
    b = fast.create_completion("def main(", max_tokens=12, temperature=0, stopping_criteria=crit)
    assert a["choices"][0]["finish_reason"] == "stop" and a["usage"]["completion_tokens"] < 12
    assert (b["choices"][0]["text"], b["choices"][0]["finish_reason"]) == \
        (a["choices"][0]["text"], a["choices"][0]["finish_reason"])
    assert b["dflash"]["enabled"] is False and "stopping_criteria" in b["dflash"]["reason"]


@pytest.mark.parametrize("at", [3, 9, 14])
def test_stop_on_tokens_criterion_is_exact_mid_block(chat, at):
    """A non-end-of-turn stop id (DFlash stops after it; llama_cpp also evaluates it: finish 'stop')."""
    plain, fast, known, _ = chat
    base = plain.create_completion("import os\n", max_tokens=40, temperature=0)
    n_prompt = base["usage"]["prompt_tokens"]
    toks = _completion_tokens(plain, n_prompt)
    stop_id = toks[at]
    crit = llama_cpp.StoppingCriteriaList([StopOnTokens([stop_id])])
    a = plain.create_completion("import os\n", max_tokens=40, temperature=0, stopping_criteria=crit)
    known.seq = plain.input_ids[:plain.n_tokens].tolist() + toks[toks.index(stop_id) + 1:] + [0] * 8
    b = fast.create_completion("import os\n", max_tokens=40, temperature=0, stopping_criteria=crit)
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["finish_reason"] == a["choices"][0]["finish_reason"]
    assert b["usage"] == a["usage"] and b["dflash"]["enabled"] is True


def test_server_chat_with_gguf_template(chat):
    plain, fast, known, eot = chat
    want = _plain_chat(plain, known, eot, max_tokens=50)["choices"][0]["message"]["content"]
    with serve(create_app(fast, "chat-model")) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="chat-model", messages=MSGS, max_tokens=50, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
        assert r.model_extra["dflash"]["enabled"] is True and r.model_extra["dflash"]["steps"] > 0
        chunks = list(client.chat.completions.create(model="chat-model", messages=MSGS, max_tokens=50, temperature=0,
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].model_extra["dflash"]["enabled"] is True


TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NAMED = {"type": "function", "function": {"name": "add"}}


def test_server_slots_serve_tools_and_template_kwargs(chat):
    """--parallel: tools into the GGUF's template (the Qwen3 one renders them), a named tool_choice's
    grammar and llama_cpp's tool-call reply (plain and streamed), and chat_template_kwargs all run in the
    batched engine, each reply what llama_cpp gives for that request."""
    plain, fast, known, eot = chat
    app = create_app(fast, "chat-model", parallel=2)
    srv = app.state.server
    handler = (plain._chat_handlers.get(plain.chat_format)
               or llama_chat_format.get_chat_completion_handler(plain.chat_format))
    call = inspect.signature(llama_cpp.Llama.create_chat_completion).bind(plain, MSGS, max_tokens=30, temperature=0)
    call.apply_defaults()
    no_think = handler(llama=plain, **{k: v for k, v in call.arguments.items() if k != "self"}, enable_thinking=False)
    auto = plain.create_chat_completion(MSGS, tools=[TOOL], tool_choice="auto", max_tokens=30, temperature=0)
    named = plain.create_chat_completion(MSGS, tools=[TOOL], tool_choice=NAMED, max_tokens=30, temperature=0)
    named_chunks = list(plain.create_chat_completion(MSGS, tools=[TOOL], tool_choice=NAMED, max_tokens=30,
                                                     temperature=0, stream=True))
    want_args = named["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert want_args.startswith("{") and "".join(
        (c["choices"][0]["delta"].get("tool_calls") or [{"function": {"arguments": ""}}])[0]["function"]["arguments"]
        for c in named_chunks) == want_args
    try:
        with serve(app) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            before = srv.slots.sequences
            r = client.chat.completions.create(model="chat-model", messages=MSGS, tools=[TOOL], tool_choice="auto",
                                               max_tokens=30, temperature=0)
            assert r.choices[0].message.content == auto["choices"][0]["message"]["content"]
            assert r.usage.model_dump(exclude_none=True) == auto["usage"]
            r = client.chat.completions.create(model="chat-model", messages=MSGS, tools=[TOOL], tool_choice=NAMED,
                                               max_tokens=30, temperature=0)
            got = r.choices[0]
            assert got.finish_reason == "tool_calls" and got.message.content is None
            assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == [("add", want_args)]
            assert r.model_extra["dflash"]["enabled"] is True
            chunks = list(client.chat.completions.create(model="chat-model", messages=MSGS, tools=[TOOL],
                                                         tool_choice=NAMED, max_tokens=30, temperature=0, stream=True))
            calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
            assert "".join(c.function.arguments for c in calls) == want_args
            assert {c.function.name for c in calls} == {"add"} and len({c.id for c in calls}) == 1
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
            r = client.chat.completions.create(model="chat-model", messages=MSGS, max_tokens=30, temperature=0,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            assert r.choices[0].message.content == no_think["choices"][0]["message"]["content"]
            assert r.usage.model_dump(exclude_none=True) == no_think["usage"]
            assert srv.slots.sequences - before >= 4, "they ran in the slots"
            bad = httpx.post(url + "/v1/chat/completions", json={
                "messages": MSGS, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "mul"}}})
            assert bad.status_code == 400 and "'mul' not found" in bad.json()["error"]["message"]
            clash = httpx.post(url + "/v1/chat/completions", json={
                "messages": MSGS, "chat_template_kwargs": {"messages": []}})
            assert clash.status_code == 400 and "must not repeat" in clash.json()["error"]["message"]
    finally:
        srv.slots.close()
