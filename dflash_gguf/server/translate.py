"""OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``), served by
the chat route.

Each request becomes the server's :class:`ChatRequest` and is served by the chat route itself (DFlash,
the slots, limits, timeouts and disconnects as there); its answer, a chat completion or a chat stream,
is translated back. One home per shape: ``responses_to_chat`` / ``messages_to_chat`` map a request,
``Reply`` reads a chat completion, ``Deltas`` reads a chat stream, and ``response_object`` /
``message_object`` / the two ``*_events`` generators write the answers. Every answer keeps the chat
route's top-level ``dflash`` object.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Literal, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dflash_gguf.server.responses import BadRequest, ServingError, validation_message
from dflash_gguf.server.schemas import ChatRequest

STORED_RESPONSES = 256      # previous_response_id: the most recent responses kept, in memory


# --------------------------------------------------------------------------- request bodies
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Extensions(_Strict):
    """llama.cpp-tradition fields the chat route takes, accepted here too."""
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repeat_penalty: Optional[float] = Field(None, gt=0.0)
    seed: Optional[int] = None
    dflash: Optional[bool] = Field(None, description="false: plain decoding for this request")
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    def extension_fields(self) -> dict:
        names = ("top_k", "min_p", "repeat_penalty", "seed", "dflash", "chat_template_kwargs")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


class ResponsesRequest(_Extensions):
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    stream: bool = False
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    previous_response_id: Optional[str] = None
    store: bool = True
    text: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, str]] = None
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = None


class MessagesRequest(_Extensions):
    model: Optional[str] = None
    max_tokens: int = Field(..., ge=1)
    messages: List[Dict[str, Any]] = Field(..., min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None
    metadata: Optional[Dict[str, Any]] = None


class CountTokensRequest(_Strict):
    model: Optional[str] = None
    messages: List[Dict[str, Any]] = Field(..., min_length=1)
    system: Optional[Union[str, List[Dict[str, Any]]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Dict[str, Any]] = None


async def json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not valid JSON ({e.msg} at character {e.pos})") from None
    except UnicodeDecodeError:
        raise BadRequest("the body is not valid JSON (not UTF-8 text)") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data


def parse(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(*validation_message(e)) from None


def chat_request(fields: dict) -> ChatRequest:
    """The chat route's request; what it refuses is refused here with its message."""
    return parse(ChatRequest, {k: v for k, v in fields.items() if v is not None})


def _text_of(parts, kinds: tuple[str, ...], where: str) -> str:
    """The text of a content given as a string or as a list of text parts of the ``kinds`` types."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise BadRequest(f"{where} must be a string or a list of content parts", where)
    out = []
    for i, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in kinds or not isinstance(p.get("text"), str):
            raise BadRequest(f"{where}[{i}]: only text content is supported ({', '.join(kinds)} parts with a "
                             f"string 'text'), got {kind!r}", where)
        out.append(p["text"])
    return "".join(out)


def _required(item: dict, key: str, kind: type, where: str):
    v = item.get(key)
    if not isinstance(v, kind):
        raise BadRequest(f"{where}.{key} is required ({kind.__name__})", where)
    return v


def _call(call_id: str, name: str, arguments: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_calls(messages: list[dict], calls: list[dict]) -> None:
    """Tool calls join the assistant message they follow (one turn), else start one."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).extend(calls)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": calls})


# --------------------------------------------------------------------------- Responses API: requests
def responses_input(inp: Union[str, list]) -> list[dict]:
    """The chat messages of a Responses ``input``: a string (one user message) or a list of items."""
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    messages: list[dict] = []
    for i, item in enumerate(inp):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role must be user, assistant, system or developer, got {role!r}", where)
            text = _text_of(item.get("content"), ("input_text", "output_text", "text", "refusal"), f"{where}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            args = _required(item, "arguments", str, where)
            _add_calls(messages, [_call(_required(item, "call_id", str, where), _required(item, "name", str, where),
                                        args)])
        elif kind == "function_call_output":
            out = item.get("output")
            text = _text_of(out, ("input_text", "output_text", "text"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _required(item, "call_id", str, where), "content": text})
        else:
            raise BadRequest(f"{where}: item type {kind!r} is not supported (message, function_call, "
                             "function_call_output)", where)
    if not messages:
        raise BadRequest("input must not be empty", "input")
    return messages


def responses_tools(tools: list | None, choice) -> tuple[list | None, Any]:
    out = None
    if tools is not None:
        out = []
        for i, t in enumerate(tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise BadRequest(f"tools[{i}]: only function tools ({{type: function, name, parameters}}) are "
                                 f"supported, got type {t.get('type')!r}", "tools")
            fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
            out.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and choice not in ("auto", "none", "required"):
        raise BadRequest("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
    return out, choice


def responses_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_object", "schema": fmt["schema"]}
    raise BadRequest("text.format.type must be text, json_object or json_schema (with a schema)", "text")


def responses_to_chat(body: ResponsesRequest, history: list[dict]) -> tuple[ChatRequest, list[dict]]:
    """The chat request for ``body`` after ``history`` (the earlier turns of previous_response_id), and
    the turns to keep for a later one (``instructions`` are not carried over, as OpenAI's are not)."""
    turns = history + responses_input(body.input)
    tools, choice = responses_tools(body.tools, body.tool_choice)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions is not None else []) + turns
    req = chat_request(dict(messages=messages, max_tokens=body.max_output_tokens, temperature=body.temperature,
                            top_p=body.top_p, stream=body.stream, tools=tools, tool_choice=choice,
                            response_format=responses_format(body.text), user=body.user,
                            stream_options={"include_usage": True} if body.stream else None,
                            **body.extension_fields()))
    return req, turns


# --------------------------------------------------------------------------- Messages API: requests
def _anthropic_content(msg: dict, where: str) -> tuple[str, list[dict], list[dict]]:
    """A message's text, tool calls (tool_use blocks) and tool results (tool_result blocks)."""
    content = msg.get("content")
    if isinstance(content, str):
        return content, [], []
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of content blocks", where)
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        here = f"{where}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_required(b, "text", str, here))
        elif kind == "tool_use" and msg.get("role") == "assistant":
            args = _required(b, "input", dict, here)
            calls.append(_call(_required(b, "id", str, here), _required(b, "name", str, here), json.dumps(args)))
        elif kind == "tool_result" and msg.get("role") == "user":
            out = b.get("content", "")
            text = _text_of(out, ("text",), f"{here}.content")
            results.append({"role": "tool", "tool_call_id": _required(b, "tool_use_id", str, here), "content": text})
        else:
            raise BadRequest(f"{here}: block type {kind!r} is not supported here (text; tool_use in assistant "
                             "messages, tool_result in user messages)", where)
    return "".join(texts), calls, results


def anthropic_messages(system, messages: list[dict]) -> list[dict]:
    out = []
    if system is not None:
        out.append({"role": "system", "content": _text_of(system, ("text",), "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be user or assistant, got {m.get('role')!r}", where)
        text, calls, results = _anthropic_content(m, where)
        out.extend(results)          # tool results answer the calls of the turn before, ahead of new text
        if text or not (calls or results):
            out.append({"role": m["role"], "content": text})
        if calls:
            _add_calls(out, calls)
    return out


def anthropic_tools(tools: list | None, choice: dict | None) -> tuple[list | None, Any]:
    out = None
    if tools is not None:
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict) \
                    or t.get("type") not in (None, "custom"):
                raise BadRequest(f"tools[{i}]: only client tools ({{name, description, input_schema}}) are "
                                 "supported", "tools")
            fn = {"name": t["name"], "parameters": t["input_schema"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
    if choice is None:
        return out, None
    kind = choice.get("type")
    if kind == "tool" and isinstance(choice.get("name"), str):
        return out, {"type": "function", "function": {"name": choice["name"]}}
    if kind in ("auto", "any", "none"):
        return out, {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise BadRequest("tool_choice.type must be auto, any, none or tool (with a name)", "tool_choice")


def messages_to_chat(body: MessagesRequest) -> ChatRequest:
    tools, choice = anthropic_tools(body.tools, body.tool_choice)
    return chat_request(dict(messages=anthropic_messages(body.system, body.messages), max_tokens=body.max_tokens,
                             temperature=body.temperature, top_p=body.top_p, stop=body.stop_sequences,
                             stream=body.stream, tools=tools, tool_choice=choice,
                             stream_options={"include_usage": True} if body.stream else None,
                             **body.extension_fields()))


# --------------------------------------------------------------------------- chat answers, read
@dataclass
class Reply:
    """What a chat answer says, as the other APIs need it."""
    text: str = ""
    calls: list[dict] = field(default_factory=list)     # {"id", "name", "arguments"}
    finish: str | None = None                           # the chat finish_reason
    usage: dict = field(default_factory=dict)
    dflash: dict | None = None

    @classmethod
    def of(cls, completion: dict) -> "Reply":
        choice = completion["choices"][0]
        msg = choice.get("message") or {}
        calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"] or ""}
                 for c in msg.get("tool_calls") or []]
        return cls(msg.get("content") or "", calls, choice.get("finish_reason"), completion.get("usage") or {},
                   completion.get("dflash"))


class Deltas:
    """A chat SSE stream read as ``("text", str)``, ``("call", index, id, name, arguments)``, then one
    ``("end", Reply)`` or ``("error", status, message)``; ``reply`` holds everything seen so far."""

    def __init__(self, body: AsyncIterator):
        self.body, self.reply = body, Reply()
        self._seen: set[int] = set()

    async def _chunks(self):
        buf = ""
        async for piece in self.body:
            buf += piece if isinstance(piece, str) else piece.decode("utf-8")
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                for line in event.splitlines():
                    if line.startswith("data: "):
                        if line == "data: [DONE]":
                            return
                        yield json.loads(line[6:])

    async def __aiter__(self):
        r = self.reply
        try:
            async for c in self._chunks():
                if "error" in c and "choices" not in c:
                    err = c["error"]
                    status = err.get("code") if isinstance(err.get("code"), int) else 500
                    yield ("error", status, err.get("message") or "error")
                    return
                r.usage = c.get("usage") or r.usage
                r.dflash = c.get("dflash") if c.get("dflash") is not None else r.dflash
                for ch in c.get("choices") or []:
                    d = ch.get("delta") or {}
                    for tc in d.get("tool_calls") or []:
                        i, fn = tc.get("index", 0), tc.get("function") or {}
                        if i not in self._seen:
                            self._seen.add(i)
                            r.calls.append({"id": tc.get("id"), "name": fn.get("name"), "arguments": ""})
                        r.calls[-1]["arguments"] += fn.get("arguments") or ""
                        yield ("call", i, r.calls[-1]["id"], r.calls[-1]["name"], fn.get("arguments") or "")
                    if d.get("content"):
                        r.text += d["content"]
                        yield ("text", d["content"])
                    r.finish = ch.get("finish_reason") or r.finish
            yield ("end", r)
        finally:
            close = getattr(self.body, "aclose", None)
            if close is not None:
                await close()      # the chat stream's own cleanup (its lease or slot) runs now


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- Responses API: answers
class ResponseStore:
    """previous_response_id: the last ``size`` stored responses, with the turns that led to them."""

    def __init__(self, size: int = STORED_RESPONSES):
        self.size = size
        self._items: OrderedDict[str, tuple[list[dict], dict]] = OrderedDict()

    def get(self, rid: str) -> tuple[list[dict], dict]:
        if rid not in self._items:
            raise ServingError(404, f"Previous response with id '{rid}' not found (this server keeps the last "
                                    f"{self.size} responses, in memory, until it restarts)",
                               "invalid_request_error", "previous_response_not_found")
        self._items.move_to_end(rid)
        return self._items[rid]

    def put(self, rid: str, turns: list[dict], response: dict) -> None:
        self._items[rid] = (turns, response)
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


def _message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [] if status != "completed" else [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["name"],
            "arguments": call["arguments"], "status": status}


def response_shell(rid: str, model_id: str, body: ResponsesRequest) -> dict:
    """A response object before its output: the request's settings, as OpenAI echoes them."""
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": model_id, "output": [],
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": body.temperature, "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
            "truncation": "disabled", "usage": None, "user": body.user, "metadata": body.metadata or {}}


def response_object(shell: dict, reply: Reply, output: list[dict] | None = None) -> dict:
    """The finished response (``output``: the items a stream sent, else made from ``reply``)."""
    if output is None:
        output = [_message_item(_id("msg"), reply.text)] if reply.text or not reply.calls else []
        output += [_call_item(_id("fc"), c) for c in reply.calls]
    n_in, n_out = reply.usage.get("prompt_tokens", 0), reply.usage.get("completion_tokens", 0)
    out = dict(shell, output=output, status="completed" if reply.finish != "length" else "incomplete",
               incomplete_details=None if reply.finish != "length" else {"reason": "max_output_tokens"},
               usage={"input_tokens": n_in, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": n_out,
                      "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out})
    out["dflash"] = reply.dflash
    return out


def response_turns(turns: list[dict], reply: Reply) -> list[dict]:
    """``turns`` and the reply, as chat messages a later request continues from."""
    out = list(turns)
    if reply.text or not reply.calls:
        out.append({"role": "assistant", "content": reply.text})
    if reply.calls:
        _add_calls(out, [_call(c["id"], c["name"], c["arguments"]) for c in reply.calls])
    return out


async def responses_events(deltas: Deltas, shell: dict, done: Callable[[dict, Reply], None]):
    """The Responses API's stream events for a chat stream (``done``: called with the finished response)."""
    seq = -1
    output: list[dict] = []
    current: dict | None = None      # the open item: a message receiving text, or a call receiving arguments

    def ev(kind: str, **fields) -> str:
        nonlocal seq
        seq += 1
        return _sse(kind, {"type": kind, "sequence_number": seq, **fields})

    def close():
        nonlocal current
        item, at, current = current, len(output), None
        if item is None:
            return
        if item["type"] == "message":
            text = item.pop("_text")
            item.update(status="completed", content=[_text_part(text)])
            yield ev("response.output_text.done", item_id=item["id"], output_index=at, content_index=0, text=text,
                     logprobs=[])
            yield ev("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                     part=_text_part(text))
        else:
            item["status"] = "completed"
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                     name=item["name"], arguments=item["arguments"])
        output.append(item)
        yield ev("response.output_item.done", output_index=at, item=item)

    def open_message():
        nonlocal current
        current = dict(_message_item(_id("msg"), "", "in_progress"), _text="")
        at = len(output)
        yield ev("response.output_item.added", output_index=at,
                 item={k: v for k, v in current.items() if k != "_text"})
        yield ev("response.content_part.added", item_id=current["id"], output_index=at, content_index=0,
                 part=_text_part(""))

    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    async for d in deltas:
        if d[0] == "text":
            if current is None or current["type"] != "message":
                for e in [*close(), *open_message()]:
                    yield e
            current["_text"] += d[1]
            yield ev("response.output_text.delta", item_id=current["id"], output_index=len(output),
                     content_index=0, delta=d[1], logprobs=[])
        elif d[0] == "call":
            _, _, call_id, name, args = d
            if current is None or current["type"] != "function_call" or current["call_id"] != call_id:
                for e in close():
                    yield e
                current = _call_item(_id("fc"), {"id": call_id, "name": name, "arguments": ""}, "in_progress")
                yield ev("response.output_item.added", output_index=len(output), item=dict(current))
            current["arguments"] += args
            if args:
                yield ev("response.function_call_arguments.delta", item_id=current["id"],
                         output_index=len(output), delta=args)
        elif d[0] == "error":
            _, status, message = d
            yield ev("error", code=str(status), message=message, param=None)
            failed = dict(shell, status="failed", error={"code": str(status), "message": message})
            yield ev("response.failed", response=failed)
            return
        else:
            reply = d[1]
            if current is None and not output:       # an empty reply is still a message, as unstreamed
                for e in open_message():
                    yield e
            for e in close():
                yield e
            final = response_object(shell, reply, output)
            done(final, reply)
            yield ev("response.completed" if final["status"] == "completed" else "response.incomplete",
                     response=final)


# --------------------------------------------------------------------------- Messages API: answers
ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERRORS.get(status, "invalid_request_error" if status < 500
                                                                    else "api_error"), "message": message}}


def anthropic_error(resp: JSONResponse) -> JSONResponse:
    """An OpenAI-shaped error response in Anthropic's shape (same status, same retry headers)."""
    try:
        message = json.loads(resp.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.body.decode("utf-8", "replace")
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(anthropic_error_body(resp.status_code, message), status_code=resp.status_code,
                        headers=headers)


def _stop_reason(finish: str | None) -> str:
    # a stop sequence and the model's own end both finish a chat reply with "stop": the chat route
    # does not say which, so both are end_turn here (stop_sequence stays null)
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(finish or "stop", "end_turn")


def _tool_use(call: dict) -> dict | None:
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        return None
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": args} \
        if isinstance(args, dict) else None


def message_object(model_id: str, reply: Reply, mid: str | None = None) -> dict:
    content: list[dict] = [{"type": "text", "text": reply.text}] if reply.text else []
    for c in reply.calls:
        # arguments that are no JSON object (cut by max_tokens) come back as text, as llama-server
        # answers a call it cannot parse
        content.append(_tool_use(c) or {"type": "text", "text": c["arguments"]})
    u = reply.usage
    return {"id": mid or _id("msg"), "type": "message", "role": "assistant", "model": model_id, "content": content,
            "stop_reason": _stop_reason(reply.finish), "stop_sequence": None,
            "usage": {"input_tokens": u.get("prompt_tokens", 0), "output_tokens": u.get("completion_tokens", 0)},
            "dflash": reply.dflash}


async def messages_events(deltas: Deltas, model_id: str, n_prompt: int):
    """Anthropic's stream events for a chat stream (``n_prompt``: the prompt's tokens, for message_start)."""
    start = message_object(model_id, Reply(usage={"prompt_tokens": n_prompt}))
    start.update(stop_reason=None)
    start.pop("dflash")
    yield _sse("message_start", {"type": "message_start", "message": start})
    index, kind = -1, None          # the open content block

    def stop():
        return _sse("content_block_stop", {"type": "content_block_stop", "index": index})

    async for d in deltas:
        if d[0] == "text":
            if kind != "text":
                if kind:
                    yield stop()
                index, kind = index + 1, "text"
                yield _sse("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {"type": "text", "text": ""}})
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                               "delta": {"type": "text_delta", "text": d[1]}})
        elif d[0] == "call":
            _, _, call_id, name, args = d
            if kind != ("tool_use", call_id):
                if kind:
                    yield stop()
                index, kind = index + 1, ("tool_use", call_id)
                yield _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block":
                                                   {"type": "tool_use", "id": call_id, "name": name, "input": {}}})
            if args:
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "input_json_delta", "partial_json": args}})
        elif d[0] == "error":
            yield _sse("error", anthropic_error_body(d[1], d[2]))
            return
        else:
            reply = d[1]
            if kind:
                yield stop()
            u = reply.usage
            yield _sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": _stop_reason(reply.finish), "stop_sequence": None},
                                         "usage": {"input_tokens": u.get("prompt_tokens", n_prompt),
                                                   "output_tokens": u.get("completion_tokens", 0)},
                                         "dflash": reply.dflash})
            yield _sse("message_stop", {"type": "message_stop"})


# --------------------------------------------------------------------------- routes
def _is_stream(resp: Response) -> bool:
    return hasattr(resp, "body_iterator")


def add_routes(app: FastAPI, srv, serve_chat: Callable) -> None:
    """``/v1/responses`` (and ``GET``/``DELETE /v1/responses/{id}``), ``/v1/messages`` and
    ``/v1/messages/count_tokens`` on ``app``, answered through ``serve_chat`` (the chat route)."""
    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(request: Request):
        endpoint = "/v1/responses"
        try:
            body = parse(ResponsesRequest, await json_body(request))
            history = store.get(body.previous_response_id)[0] if body.previous_response_id else []
            chat, turns = responses_to_chat(body, history)
            resp = await serve_chat(chat, request, endpoint)
        except Exception as e:
            return srv.failed(endpoint, e)
        shell = response_shell(_id("resp"), srv.model_id, body)

        def done(response: dict, reply: Reply) -> None:
            if body.store:
                store.put(response["id"], response_turns(turns, reply), response)

        if resp.status_code != 200:
            return resp
        if _is_stream(resp):
            resp.body_iterator = responses_events(Deltas(resp.body_iterator), shell, done)
            return resp
        reply = Reply.of(json.loads(resp.body))
        out = response_object(shell, reply)
        done(out, reply)
        return JSONResponse(out)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        try:
            return store.get(response_id)[1]
        except ServingError as e:
            return srv.failed("/v1/responses/{id}", e)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if not store.delete(response_id):
            return srv.failed("/v1/responses/{id}", ServingError(
                404, f"No response with id '{response_id}' is stored", "invalid_request_error", "not_found"))
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages")
    async def messages(request: Request):
        endpoint = "/v1/messages"
        try:
            body = parse(MessagesRequest, await json_body(request))
            chat = messages_to_chat(body)
            n_prompt = (prompt_tokens(srv.llm, chat) or 0) if body.stream else 0
            resp = await serve_chat(chat, request, endpoint)
        except Exception as e:
            return anthropic_error(srv.failed(endpoint, e))
        if resp.status_code != 200:
            return anthropic_error(resp)
        if _is_stream(resp):
            resp.body_iterator = messages_events(Deltas(resp.body_iterator), srv.model_id, n_prompt)
            return resp
        return JSONResponse(message_object(srv.model_id, Reply.of(json.loads(resp.body))))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        endpoint = "/v1/messages/count_tokens"
        try:
            body = parse(CountTokensRequest, await json_body(request))
            tools, choice = anthropic_tools(body.tools, body.tool_choice)
            chat = chat_request(dict(messages=anthropic_messages(body.system, body.messages), tools=tools,
                                     tool_choice=choice))
            n = prompt_tokens(srv.llm, chat)
            if n is None:
                raise BadRequest("this server's chat format has no prompt formatter to count with (a chat "
                                 "handler of its own)")
        except Exception as e:
            return anthropic_error(srv.failed(endpoint, e))
        srv.metrics.request(endpoint, 200)
        return {"input_tokens": n}


def prompt_tokens(llm, chat: ChatRequest) -> int | None:
    """How many tokens the chat route's prompt for ``chat`` has (None: the chat format cannot say)."""
    from dflash_gguf.requests.prompts import chat_prompt

    formatted = chat_prompt(llm, [m.as_dict() for m in chat.messages], chat.tools, chat.tool_choice,
                            chat.chat_template_kwargs)
    return None if formatted is None else len(formatted[0])
