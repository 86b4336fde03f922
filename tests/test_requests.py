"""The request surface every front door shares (dflash_gguf.requests), as a specification: the sampling
defaults are llama_cpp.Llama's, per entry point, and every front door's; the server's slots serve a request
exactly when the one rule says so; answers end, count and report DFlash in one way; stop strings end a
request on the token that completes one. The parts that read llama_cpp's own signatures or a front door are
skipped under ``--pure`` (the rest needs neither the native build nor a model)."""
from __future__ import annotations

import inspect
import json
from dataclasses import fields

import pytest

from dflash_gguf.decoding.stats import GenerationStats
from dflash_gguf.requests.defaults import CHAT, COMPLETION, GREEDY, for_endpoint, sampling
from dflash_gguf.requests.responses import (chunk, completion_body, dflash_object, finish_reason, text_chunk_frame,
                                            tool_message, usage, usage_chunk)
from dflash_gguf.requests.served import SERVED, asked, slots_plain_reason, slots_serve
from dflash_gguf.requests.stops import StopStrings, stop_list
from dflash_gguf.decoding.sampling import SamplingParams

pytestmark = pytest.mark.pure


# ---------------------------------------------------------------------------- sampling defaults
def test_chat_and_completion_defaults_differ_only_in_the_temperature():
    assert set(CHAT) == set(COMPLETION) and {k for k in CHAT if CHAT[k] != COMPLETION[k]} == {"temperature"}
    assert (COMPLETION["temperature"], CHAT["temperature"], GREEDY) == (0.8, 0.2, 0.0)
    assert for_endpoint(True) is CHAT and for_endpoint(False) is COMPLETION


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_a_requests_sampling_is_its_endpoints_defaults_under_its_own_fields(chat):
    assert sampling({}, chat) == dict(for_endpoint(chat))
    got = sampling({"temperature": 1, "top_k": 3.0, "seed": 7, "mirostat_mode": 2.0, "stop": ["x"]}, chat)
    assert got == {**for_endpoint(chat), "temperature": 1.0, "top_k": 3, "seed": 7, "mirostat_mode": 2}
    assert type(got["temperature"]) is float and type(got["top_k"]) is int and type(got["mirostat_mode"]) is int
    sp = SamplingParams(**got)      # every key is one of SamplingParams' fields
    assert (sp.temperature, sp.top_k, sp.seed) == (1.0, 3, 7)


def test_sampling_params_defaults_are_the_tables_greedy():
    sp = SamplingParams()
    assert {k: getattr(sp, k) for k in COMPLETION} == {**COMPLETION, "temperature": GREEDY}
    assert {f.name for f in fields(SamplingParams)} >= set(COMPLETION)


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_the_table_is_llama_cpps_signature_defaults(chat):
    llama_cpp = pytest.importorskip("llama_cpp")
    fn = llama_cpp.Llama.create_chat_completion if chat else llama_cpp.Llama.create_completion
    theirs = inspect.signature(fn).parameters
    assert {k: theirs[k].default for k in COMPLETION} == dict(for_endpoint(chat))


def test_generate_takes_llama_cpps_generate_defaults():
    """``Llama.generate`` (llama_cpp's signature: ``temp`` for the temperature) and ours."""
    llama_cpp = pytest.importorskip("llama_cpp")
    api = pytest.importorskip("dflash_gguf.api")
    names = {**{k: k for k in COMPLETION if k != "seed"}, "temperature": "temp"}
    for fn in (llama_cpp.Llama.generate, api.Llama._generate):
        p = inspect.signature(fn).parameters
        assert {k: p[v].default for k, v in names.items()} == {k: COMPLETION[k] for k in names}, fn


def test_our_own_entry_points_take_the_tables_filters_and_are_greedy():
    """BatchLlama.generate and the command line: the table's values for the fields they take, temperature 0."""
    batch = pytest.importorskip("dflash_gguf.batch")
    p = inspect.signature(batch.BatchLlama.generate).parameters
    taken = [k for k in COMPLETION if k in p]
    assert set(taken) >= {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "seed"}
    assert {k: p[k].default for k in taken} == {**{k: COMPLETION[k] for k in taken}, "temperature": GREEDY}

    from dflash_gguf import cli

    args = cli.parser().parse_args(["generate", "x"])
    assert {k: getattr(args, k) for k in taken} == {**{k: COMPLETION[k] for k in taken}, "temperature": GREEDY}


# ---------------------------------------------------------------------------- what the slots serve
@pytest.mark.parametrize("kw, served", [
    ({}, True),
    ({"temperature": 0.5, "top_k": 0, "stop": [], "seed": None}, True),
    ({"suffix": "x"}, False), ({"suffix": None}, True), ({"suffix": False}, True), ({"suffix": 0}, False),
    ({"suffix": ""}, False),
    ({"echo": True}, True), ({"logprobs": 0}, True), ({"echo": False, "logprobs": 2}, True),
    ({"echo": True, "logprobs": 0}, False), ({"echo": True, "logprobs": None}, True),
    ({"logprobs": True, "top_logprobs": 2, "tools": [{}], "tool_choice": "auto"}, True),
], ids=repr)
def test_the_slots_serve_a_request_iff_every_field_it_asks_for_is_served(kw, served):
    """None and False ask for nothing (0 and "" do); an echoed prompt's log-probabilities go to the Llama."""
    assert slots_serve(kw) is served
    assert asked(kw) == {k for k, v in kw.items() if v is not None and v is not False}


@pytest.mark.parametrize("want, default, reason", [
    (None, True, None), (True, True, None), (True, False, None),
    (False, True, "dflash=false in the request"), (False, False, "dflash=false in the request"),
    (None, False, "dflash=False"),
])
def test_the_slots_decode_plainly_only_where_the_request_or_the_server_says_so(want, default, reason):
    assert slots_plain_reason(want, default) == reason


def test_every_sampling_field_is_served():
    assert set(COMPLETION) <= SERVED


# the server's request fields that its routes take themselves: never handed on to the Llama or the slots
ROUTES_OWN = {
    "prompt", "messages",              # the prompt
    "max_completion_tokens",           # max_tokens
    "ignore_eos",                      # a logit_bias
    "stream_options",                  # the stream's usage chunk
    "n", "best_of", "suffix",          # refused (n, best_of > 1; suffix)
    "user",                            # ignored
}


def test_every_field_the_server_takes_is_served_in_the_slots_or_the_routes_own():
    """Every other field of the server's requests reaches the slots, which serve it: a field added to the
    schemas fails here until it is placed (SERVED, or the routes' own)."""
    schemas = pytest.importorskip("dflash_gguf.server.schemas")
    taken = set(schemas.CompletionRequest.model_fields) | set(schemas.ChatRequest.model_fields)
    assert taken - ROUTES_OWN == SERVED


def test_the_server_slots_take_the_one_rule():
    slots = pytest.importorskip("dflash_gguf.server.slots")
    for kw in ({}, {"suffix": "x"}, {"echo": True, "logprobs": 1}, {"temperature": 1.0}):
        assert slots.Slots.eligible(kw) is slots_serve(kw)


# ---------------------------------------------------------------------------- answers
@pytest.mark.parametrize("finish, openai, exact", [
    ("stop", "stop", "stop"), ("length", "length", "length"), ("context", "length", "context"),
    ("error", "length", "error"), (None, "length", "length"),
])
def test_finish_reason(finish, openai, exact):
    """OpenAI's and llama_cpp's names for the server; the decoder's own ends for BatchLlama; a tool call's
    reply says so however it ended."""
    assert finish_reason(finish) == openai
    assert finish_reason(finish, exact=True) == exact
    assert finish_reason(finish, "get_weather") == finish_reason(finish, "f", exact=True) == "tool_calls"


def test_usage_and_the_dflash_object():
    assert usage(5, 3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    stats = GenerationStats()
    stats.observe_step(4, 3)
    assert dflash_object(stats, "ignored") == {"enabled": True, **stats.as_dict()}
    assert dflash_object(None, "dflash=False") == {"enabled": False, "reason": "dflash=False"}


def test_completion_bodies():
    used, info = usage(2, 1), {"enabled": False, "reason": "r"}
    text = completion_body("m", "hi", False, "stop", used, info, echo="say ")
    assert text["object"] == "text_completion" and text["id"].startswith("cmpl-")
    assert text["choices"] == [{"text": "say hi", "index": 0, "logprobs": None, "finish_reason": "stop"}]
    assert (text["usage"], text["dflash"], text["model"]) == (used, info, "m")
    pytest.importorskip("llama_cpp")      # a chat's logprobs are converted by llama_cpp's chat handler's code
    chat = completion_body("m", "hi", True, "length", used)
    assert chat["object"] == "chat.completion" and "dflash" not in chat
    assert chat["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                "finish_reason": "length"}]
    call = completion_body("m", '{"a": 1}', True, "tool_calls", used, tool="f")
    message = call["choices"][0]["message"]
    assert message == tool_message("f", call["id"], '{"a": 1}', False)
    assert message["tool_calls"][0]["id"] == f"call__0_f_{call['id']}" and message["content"] is None


@pytest.mark.parametrize("chat", [False, True])
def test_chunks(chat):
    if chat:
        pytest.importorskip("llama_cpp")      # a chat's logprobs are converted by llama_cpp's chat handler's code
    c = chunk("id", "m", "x", None, chat, created=9)
    assert (c["id"], c["created"], c["model"]) == ("id", 9, "m")
    assert c["object"] == ("chat.completion.chunk" if chat else "text_completion")
    head, tail = text_chunk_frame("id", "m", chat, 9)
    assert head + json.dumps("a\n\"b") + tail == json.dumps(chunk("id", "m", "a\n\"b", None, chat, created=9))
    fin = {**chunk("id", "m", None, "stop", chat, created=9), "dflash": {"enabled": True}}
    assert usage_chunk(fin, usage(1, 1)) == {"id": "id", "object": c["object"], "created": 9, "model": "m",
                                             "choices": [], "usage": usage(1, 1), "dflash": {"enabled": True}}
    if chat:
        first = chunk("id", "m", None, None, True, first=True, tool="f", created=9)["choices"][0]["delta"]
        assert first == {"role": "assistant", "content": None, "function_call": None, "tool_calls": None}
        delta = chunk("id", "m", "{", None, True, tool="f", created=9)["choices"][0]["delta"]
        assert delta["tool_calls"][0]["index"] == 0 and delta["function_call"] == {"name": "f", "arguments": "{"}


# ---------------------------------------------------------------------------- stop strings
PIECES = {1: b"he", 2: b"llo", 3: b" wor", 4: b"ld", 5: b"\xe2\x82", 6: b"\xac", 9: b"<eos>"}


def test_stop_strings_end_on_the_token_that_completes_one():
    s = StopStrings(PIECES.__getitem__, ["lo w", ""], frozenset({9}))
    assert s([1, 9]) is None and s.text() == "he"              # a silent token adds no text
    assert s([2, 3, 4]) == 2 and s.text() == "hel"             # "lo w" completed by the 2nd token: cut before it
    plain = StopStrings(PIECES.__getitem__, [])
    assert plain([1, 5]) is None and plain.text() == "he"      # half a character: left out until complete
    assert plain([6]) is None and plain.text() == "he€"


def test_stop_list():
    assert stop_list(None) == [] and stop_list("x") == ["x"] and stop_list(("a", "b")) == ["a", "b"]
