"""The DFlash block draft-verify loop, in small parts.

:mod:`.decoder` sequences one step (of one sequence or a batch of them): :mod:`.proposer` drafts, the
target verifies, :mod:`.acceptance` decides what is kept, :mod:`.rollback` trims the target's memory, :mod:`.stats` records it;
:mod:`.prompts` brings a prompt into a slot's caches, :mod:`.scheduling` runs many requests on the slots.
:mod:`.ngram` proposes blocks copied from the prompt and the text so far (prompt lookup).
:mod:`.policy` chooses each step's draft and verify lengths, from the speed gate (:mod:`.gate`: draft lengths
from measured step costs and acceptance; :mod:`.history`: acceptance kept per pair) and a DSpark drafter's
calibrated confidence (:mod:`.confidence`); :mod:`.calibration` measures this machine's step costs once per
pair, the gate's starting point; :mod:`.batch_costs` scales them to a batch of sequences.
Every verify row is judged under a request's rules: :mod:`.sampling` (llama.cpp's sampler chain, lossless
rejection sampling) and :mod:`.constraints` (its grammar and logits processors).
:mod:`.acceptance`, :mod:`.batch_costs` and :mod:`.stats` need no native library; the names below load on first use.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "DFlashDecoder": "decoder", "SpecOptions": "decoder", "Request": "sequence", "common_prefix_len": "decoder",
    "DrafterProposer": "proposer", "OverrideProposer": "proposer", "Proposer": "proposer",
    "GenerationStats": "stats", "acceptance_length": "stats",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dflash_gguf.decoding' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dflash_gguf.decoding.{module}"), name)
    globals()[name] = value
    return value
