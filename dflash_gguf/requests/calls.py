"""Per-call state of :class:`dflash_gguf.Llama`: what one request carries through llama_cpp's entry points."""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

from dflash_gguf.native.llama import llama_cpp

from dflash_gguf.decoding.stats import GenerationStats
from dflash_gguf.requests.responses import usage


@dataclass
class Request:
    """What ``_create_completion`` knows about a call and ``generate`` needs."""
    max_tokens: int | None
    logprobs: int | None
    dflash: bool | None
    seeded: bool = False               # the user gave a seed (this call, the instance, set_seed): repeatable
    served: bool = False               # True once generate() picked the DFlash path
    stats: GenerationStats | None = None
    reason: str | None = None          # why the plain path served it (a fallback)
    n_prompt: int = 0                  # tokens of the prompt handed to generate()
    n_completion: int = 0              # tokens llama_cpp took as completion (consumed, not end-of-generation)

    def usage(self) -> dict:
        return usage(self.n_prompt, self.n_completion)


@dataclass
class CallState:
    """Per-call state of a :class:`Llama`, in one place.

    llama_cpp's entry points call each other (chat -> completion -> generate) without a way to pass
    our extras along, so they travel here: ``dflash`` is the per-call override; ``created`` is the
    request ``_create_completion`` made (read back by ``create_chat_completion`` for its stats);
    ``handoff`` is set right before llama_cpp's body calls ``generate()``, which takes it; ``live``
    is the DFlash generator in flight; ``body_sets_seed`` is set while llama_cpp's completion body is about
    to call ``set_seed`` itself (once, before its first chunk), so that call is told from the user's.
    """
    dflash: bool | None = None
    body_sets_seed: bool = False
    created: Request | None = None
    handoff: Request | None = None
    live: weakref.ref | None = None


def check_template_kwargs(extra: dict) -> None:
    """``chat_template_kwargs`` reach llama_cpp's chat handler beside the request's own parameters: the
    name of one of those (or ``llama``) is refused."""
    own = set(inspect.signature(llama_cpp.Llama.create_chat_completion).parameters) - {"self"}
    clash = sorted(set(extra) & (own | {"llama"}))
    if clash:
        raise ValueError(f"chat_template_kwargs must not repeat request parameters: {clash}")


def check_grammar(llm: llama_cpp.Llama, grammar) -> None:
    """Raise ValueError (InvalidArgumentError) for a grammar llama.cpp cannot parse (llama_cpp would crash
    on it)."""
    from dflash_gguf.decoding.constraints import Grammar

    Grammar.of(llm, grammar).close()


def extended_signature(base, **extra) -> inspect.Signature:
    """``base``'s signature plus keyword-only ``extra`` parameters (for help() and IDEs)."""
    sig = inspect.signature(base)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in extra.items()]
    return sig.replace(parameters=params)
