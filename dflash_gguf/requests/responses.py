"""The shapes of an answer, as llama_cpp gives them (OpenAI's): why it ended, its usage, the ``dflash``
object, a completion's body and a stream's chunks.

``dflash_gguf.Llama``'s responses are llama_cpp's own, with :func:`dflash_object` and :func:`usage` added;
the server's slots build theirs here to the same shapes (key for key, as the server's ``Llama`` would
answer); :class:`dflash_gguf.batch.BatchLlama`'s ``Completion`` takes :func:`finish_reason`.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING

from dflash_gguf.requests.logprobs import chat_logprobs

if TYPE_CHECKING:
    from dflash_gguf.decoding.stats import GenerationStats


def finish_reason(finish: str | None, tool: str | None = None, *, exact: bool = False) -> str:
    """Why an answer ended, from the decoder's ``GenerationStats.finish`` ("stop": end of generation, a stop
    token or string; "length"; "context": the context is full; "error"; None: its consumer stopped it at
    its budget): "tool_calls" for a reply that calls ``tool``, however it ended (llama_cpp's); "stop"; else
    "length" (OpenAI's and llama_cpp's names). ``exact``: the decoder's other ends by their own names
    ("context", "error"; BatchLlama's ``Completion``)."""
    if tool is not None:
        return "tool_calls"
    if finish == "stop":
        return "stop"
    return (finish or "length") if exact else "length"


def usage(n_prompt: int, n_completion: int) -> dict:
    """An answer's ``usage`` (``n_completion``: tokens generated, no end-of-generation token, as llama_cpp counts)."""
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}


def dflash_object(stats: GenerationStats | None, reason: str | None) -> dict:
    """An answer's ``dflash`` object (where a drafter is loaded): DFlash's statistics where it served the
    generation (``stats``), else why plain decoding did (``reason``)."""
    if stats is not None:
        return {"enabled": True, **stats.as_dict()}
    return {"enabled": False, "reason": reason}


def tool_call_id(tool: str, response_id: str) -> str:
    return f"call__0_{tool}_{response_id}"        # llama_cpp's form


def tool_message(tool: str, response_id: str, arguments: str | None, stream: bool) -> dict:
    """A chat reply (``stream``: a chunk's delta) that calls ``tool`` with ``arguments``, in the shape
    llama_cpp's chat handlers give it (``function_call`` beside ``tool_calls``)."""
    call: dict = {"id": tool_call_id(tool, response_id), "type": "function",
                  "function": {"name": tool, "arguments": arguments}}
    if stream:
        call = {"index": 0, **call}
    return {"role": None if stream else "assistant", "content": None,
            "function_call": {"name": tool, "arguments": arguments}, "tool_calls": [call]}


def completion_body(model_id: str, text: str, chat: bool, finish: str, used: dict, info: dict | None = None,
                    logprobs: dict | None = None, tool: str | None = None, echo: str = "") -> dict:
    """A whole response: a chat completion (``chat``) or a text completion whose text is ``echo + text``;
    ``used``: its :func:`usage`; ``info``: its :func:`dflash_object` (None: no ``dflash`` key); ``logprobs``:
    in the completion format (a chat's is made from it); ``tool``: the function a chat reply calls, with
    ``text`` its arguments."""
    now = int(time.time())
    if chat:
        rid = f"chatcmpl-{uuid.uuid4()}"
        message = {"role": "assistant", "content": text} if tool is None else tool_message(tool, rid, text, False)
        body = {"id": rid, "object": "chat.completion", "created": now, "model": model_id,
                "choices": [{"index": 0, "message": message,
                             "logprobs": chat_logprobs(logprobs), "finish_reason": finish}]}
    else:
        body = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": now, "model": model_id,
                "choices": [{"text": echo + text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}
    body["usage"] = used
    if info is not None:
        body["dflash"] = info
    return body


def chunk(job_id: str, model_id: str, text: str | None, finish: str | None, chat: bool, first: bool = False,
          logprobs: dict | None = None, tool: str | None = None, created: int | None = None) -> dict:
    """A streamed chunk; ``logprobs``: a completion's for the tokens whose text it completes; ``tool``: the
    function a chat reply calls (deltas as llama_cpp streams them: the call's id and name in each);
    ``created``: the stream's time (every chunk of a stream carries the same, as OpenAI's do)."""
    now = int(time.time()) if created is None else created
    if chat and tool is not None:
        none = {"role": None, "content": None, "function_call": None, "tool_calls": None}
        delta = {**none, "role": "assistant"} if first else none if text is None else \
            tool_message(tool, job_id, text, True)
        return {"id": job_id, "object": "chat.completion.chunk", "created": now, "model": model_id,
                "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}]}
    if chat:
        delta: dict = {"role": "assistant"} if first else ({} if text is None else {"content": text})
        return {"id": job_id, "object": "chat.completion.chunk", "created": now, "model": model_id,
                "choices": [{"index": 0, "delta": delta, "logprobs": chat_logprobs(logprobs), "finish_reason": finish}]}
    return {"id": job_id, "object": "text_completion", "created": now, "model": model_id,
            "choices": [{"text": text or "", "index": 0, "logprobs": logprobs, "finish_reason": finish}]}


_MARK = "\x00text\x00"


def text_chunk_frame(job_id: str, model_id: str, chat: bool, created: int) -> tuple[str, str] | None:
    """The JSON of a text chunk (no logprobs, no tool call) around its text: ``head + json.dumps(text) +
    tail`` is ``json.dumps(chunk(...))`` of that text, built once per stream rather than per token (None
    where another string of the chunk is the marker it is cut at: a model id that is)."""
    whole, mark = json.dumps(chunk(job_id, model_id, _MARK, None, chat, created=created)), json.dumps(_MARK)
    if whole.count(mark) != 1:
        return None
    head, _, tail = whole.partition(mark)
    return head, tail


def usage_chunk(finish_chunk: dict, usage: dict | None) -> dict:
    """The chunk OpenAI sends last with ``stream_options.include_usage``: no choices, the usage."""
    out = {k: finish_chunk[k] for k in ("id", "object", "created", "model") if k in finish_chunk}
    out.update(choices=[], usage=usage)
    if "dflash" in finish_chunk:
        out["dflash"] = finish_chunk["dflash"]
    return out
