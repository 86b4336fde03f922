"""llama_cpp.Llama's sampling defaults: what a request gets for a field it leaves out, per entry point.

One table for every front door: the server (both routes: the slots take these, the ``Llama`` has them as
llama_cpp's keyword defaults), ``Llama.generate`` (llama_cpp's signature), :class:`dflash_gguf.batch.BatchLlama`,
the command line and :class:`dflash_gguf.decoding.sampling.SamplingParams`. ``create_completion`` (and ``generate``)
and ``create_chat_completion`` differ only in the temperature; our own entry points (``BatchLlama``, the
command line, ``SamplingParams``) take :data:`COMPLETION`'s filters but are greedy unless asked
(:data:`GREEDY`). A leaf: it imports nothing of the package.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

# llama_cpp.Llama.create_completion's (and generate's, whose ``temp`` is the temperature)
COMPLETION: Mapping = MappingProxyType({
    "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "typical_p": 1.0, "repeat_penalty": 1.0,
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "mirostat_mode": 0, "mirostat_tau": 5.0,
    "mirostat_eta": 0.1, "seed": None})
# llama_cpp.Llama.create_chat_completion's
CHAT: Mapping = MappingProxyType({**COMPLETION, "temperature": 0.2})
# the temperature of our own entry points: greedy
GREEDY = 0.0

_TYPES = {"top_k": int, "mirostat_mode": int, "seed": lambda v: v}


def for_endpoint(chat: bool) -> Mapping:
    """The defaults of ``create_chat_completion`` (``chat``) or ``create_completion``."""
    return CHAT if chat else COMPLETION


def sampling(kw: Mapping, chat: bool) -> dict:
    """A request's sampling (``SamplingParams``' keyword arguments, llama_cpp's names): its endpoint's
    defaults, overridden by the fields ``kw`` sets."""
    return {k: _TYPES.get(k, float)(kw.get(k, v)) for k, v in for_endpoint(chat).items()}
