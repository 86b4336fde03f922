"""When a generation must take llama_cpp's plain path: the one home of that rule.

DFlash serves a generation only where its output is exactly what ``llama_cpp.Llama`` gives (the
same tokens greedy, the same distribution sampled); grammars and logits processors (``logit_bias``)
are applied on every verify row (:mod:`dflash_gguf.constraints`), and with ``logits_all=True`` the
prompt's and every kept token's logits rows fill llama_cpp's scores (its logprobs read them).
Everything else falls back to the plain path, and the reason is reported (the ``"dflash"`` object of
a response, ``Llama.last_dflash_stats``).
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_gguf.sampling import SamplingParams
from dflash_gguf.stopping import stop_token_ids


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
