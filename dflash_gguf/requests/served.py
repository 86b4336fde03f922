"""What DFlash serves, and why the rest takes llama_cpp's plain path: the one home of that rule.

DFlash serves a generation only where its output is exactly what ``llama_cpp.Llama`` gives (the
same tokens greedy, the same distribution sampled); grammars and logits processors (``logit_bias``)
are applied on every verify row (:mod:`dflash_gguf.decoding.constraints`), and with ``logits_all=True`` the
prompt's and every kept token's logits rows fill llama_cpp's scores (its logprobs read them).
Everything else falls back to the plain path, and the reason is reported (the ``"dflash"`` object of
a response, ``Llama.last_dflash_stats``): :func:`plain_reason`, for every generation of a
``dflash_gguf.Llama`` (the server's one-at-a-time route included); :func:`slots_plain_reason` in the
server's slots, where a request's or the server's ``dflash`` setting is the only reason.

The server's ``--parallel`` slots (one batched engine) serve a request whose fields are all in
:data:`SERVED` (:func:`slots_serve`); the others go to the server's ``Llama``, which then applies
:func:`plain_reason`. Besides the sampling fields: ``tools``, ``tool_choice`` and ``chat_template_kwargs``
go into the chat template, a named ``tool_choice``'s grammar on the reply, the reply a tool call (as
llama_cpp's chat handlers do); ``echo`` as llama_cpp (the non-streamed text starts with the prompt; a
stream leaves it out; a token-id prompt's text detokenized); ``logprobs`` / ``top_logprobs``: the generated
tokens' (:mod:`dflash_gguf.requests.logprobs`), with or without ``--logits-all``. Not in the slots: the
log-probabilities of an echoed prompt (its rows), and a chat whose prompt the slots cannot build (a
``chat_handler`` of the ``Llama``'s own, a chat format without a formatter:
:func:`dflash_gguf.requests.prompts.chat_prompt` says None).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.requests.stopping import stop_token_ids

# request fields the batched engine serves (every sampling field llama_cpp has; a field added to the
# server's schema and not here goes to the Llama)
SERVED = frozenset({"temperature", "top_p", "top_k", "min_p", "typical_p", "repeat_penalty", "frequency_penalty",
                    "presence_penalty", "seed", "stop", "dflash", "max_tokens", "stream", "model", "grammar",
                    "logit_bias", "response_format", "echo", "logprobs", "top_logprobs", "tools", "tool_choice",
                    "chat_template_kwargs", "mirostat_mode", "mirostat_tau", "mirostat_eta"})


def asked(kw: Mapping) -> set[str]:
    """The fields of a request's keyword arguments that ask for something (None and False ask for nothing)."""
    return {k for k, v in kw.items() if v is not None and v is not False}


def slots_serve(kw: Mapping) -> bool:
    """Whether the server's slots serve a request with these keyword arguments (llama_cpp's
    ``create_completion`` / ``create_chat_completion`` names): every field it asks for in :data:`SERVED`,
    and not the log-probabilities of an echoed prompt."""
    fields = asked(kw)
    return fields <= SERVED and not {"echo", "logprobs"} <= fields


def slots_plain_reason(want: bool | None, default: bool) -> str | None:
    """Why the slots decode a request plainly (None when DFlash serves it): ``want`` is the request's own
    ``dflash`` field (None: not given), ``default`` the server's (``--no-dflash``: False)."""
    if want is None:
        return None if default else "dflash=False"
    return None if want else "dflash=false in the request"


@dataclass(frozen=True)
class Call:
    """What a generation asks for that decides the path (from ``Llama.generate`` and its request)."""
    sampling: SamplingParams
    drafter: bool = True             # a drafter is loaded
    want: bool = True                # dflash wanted (the Llama's setting, or the request's own)
    default: bool = True             # the Llama's dflash setting (tells the two "off" reasons apart)
    draft_model: bool = False        # a llama_cpp draft_model the engine does not serve is set (its
                                     # LlamaPromptLookupDecoding is served: Llama's prompt lookup)
    reset: bool = True
    stopping_criteria: object = None


def plain_reason(c: Call) -> str | None:
    """Why the call must use the plain path (None when DFlash serves it exactly)."""
    if not c.drafter:
        return "no drafter loaded (draft_model_path)"
    if not c.want:
        return "dflash disabled for this call" if c.default else "dflash=False"
    if c.draft_model:
        return "a llama_cpp draft_model is set"
    if not c.reset:
        return "generate(reset=False) continues llama_cpp's own state"
    if c.stopping_criteria and stop_token_ids(c.stopping_criteria) is None:
        return "stopping_criteria that read more than token ids (use dflash_gguf.StopOnTokens)"
    return None
