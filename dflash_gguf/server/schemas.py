"""Request bodies of the OpenAI-compatible server (pydantic v2), and how they map onto ``Llama``.

Unknown fields are rejected (400) so that a typo never silently changes sampling. The OpenAI
fields this server cannot honour (``n > 1``, ``best_of > 1``, ``suffix``) are rejected too, with a
message saying why (llama_cpp.server ignores ``n`` and ``best_of`` and answers with one choice). Extensions in the
llama.cpp tradition: ``top_k``, ``min_p``, ``typical_p``, ``repeat_penalty``, ``mirostat_*``,
``grammar`` (GBNF), ``ignore_eos`` (llama-server's: the end-of-generation tokens are masked, as a
``logit_bias`` of -inf), ``dflash`` (per-request on/off) and, for chat, ``chat_template_kwargs``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

Stop = Optional[Union[str, List[str]]]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1, description="tokens to generate; null: until EOS or the context is full")
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    typical_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    repeat_penalty: Optional[float] = Field(None, gt=0.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    mirostat_mode: Optional[int] = Field(None, ge=0, le=2)
    mirostat_tau: Optional[float] = None
    mirostat_eta: Optional[float] = None
    seed: Optional[int] = None
    stop: Stop = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None
    grammar: Optional[str] = Field(None, description="GBNF grammar (served by the plain path)")
    n: Optional[int] = Field(1, description="only 1 is supported")
    user: Optional[str] = None
    dflash: Optional[bool] = Field(None, description="false: plain decoding for this request")
    ignore_eos: bool = Field(False, description="llama-server's: no end-of-generation token is chosen "
                                                "(their logits become -inf); the reply ends at max_tokens")

    @field_validator("n")
    @classmethod
    def _n(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"n={v} is not supported: one choice per request (send n=1, or one request per choice)")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options is not None and self.stream_options.include_usage)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 stop sequences")
            if any(not s for s in v):
                raise ValueError("stop sequences must not be empty")
        elif v == "":
            raise ValueError("stop sequences must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is not None:
            for k in v:
                if not k.lstrip("-").isdigit():
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        return v

    def sampling_kwargs(self) -> dict:
        """The keyword arguments of ``create_completion`` / ``create_chat_completion`` that were set."""
        names = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                 "presence_penalty", "mirostat_mode", "mirostat_tau", "mirostat_eta", "seed", "stop", "dflash")
        out = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        if self.logit_bias:
            out["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        return out


class CompletionRequest(_Sampling):
    prompt: Union[str, List[int], List[str]] = Field(..., description="text, token ids, or a list of one text")
    suffix: Optional[str] = None
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    best_of: Optional[int] = Field(1, description="only 1 is supported")

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"best_of={v} is not supported: one candidate per request (send best_of=1)")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        if v is not None:
            raise ValueError("suffix (fill-in-the-middle) is not supported: llama_cpp 0.3.36 builds FIM prompts "
                             "with placeholder token id 0, not the model's FIM tokens; put the text in the prompt")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if all(isinstance(x, str) for x in v):
                if len(v) != 1:
                    raise ValueError("one prompt per request (send a list of one string, or a string)")
                v = v[0]
            elif not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
                raise ValueError("a token-id prompt must be a list of non-negative integers")
        if isinstance(v, str) and v == "":
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # name, tool_calls, tool_call_id, ...
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None

    def as_dict(self) -> dict:
        d = self.model_dump(exclude_none=True)
        if self.role == "developer":             # llama_cpp's chat formats know "system"
            d["role"] = "system"
        if isinstance(self.content, list):        # [{type: text, text: ...}, ...] -> one string
            texts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
                texts.append(str(part.get("text", "")))
            d["content"] = "".join(texts)
        d.setdefault("content", "")
        return d


class ChatRequest(_Sampling):
    messages: List[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[str, Dict[str, Any]]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(
        None, description='variables for the chat template, e.g. {"enable_thinking": false}')

    @field_validator("response_format")
    @classmethod
    def _format(cls, v):
        if v is not None and v.get("type") not in ("text", "json_object"):
            raise ValueError("response_format.type must be 'text' or 'json_object'")
        return v
