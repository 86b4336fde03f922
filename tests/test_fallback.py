"""The rule for which generations DFlash serves (dflash_gguf.requests.served): every reason to fall back,
exactly, in its order; and everything else served by DFlash. (tests/test_api.py checks that Llama
reports these reasons on real calls.)"""
from __future__ import annotations

from dataclasses import replace

import pytest

from dflash_gguf.requests.served import Call, plain_reason
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.requests.stopping import StopOnTokens

pytestmark = pytest.mark.pure

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=3)
OK = Call(sampling=GREEDY)


def other_criterion(input_ids, logits):        # reads the logits: only the plain path can run it
    return False


CASES = [
    (dict(drafter=False), "no drafter loaded (draft_model_path)"),
    (dict(want=False), "dflash disabled for this call"),
    (dict(want=False, default=False), "dflash=False"),
    (dict(draft_model=True), "a llama_cpp draft_model is set"),
    (dict(reset=False), "generate(reset=False) continues llama_cpp's own state"),
    (dict(stopping_criteria=[StopOnTokens([3]), other_criterion]),
     "stopping_criteria that read more than token ids (use dflash_gguf.StopOnTokens)"),
]


@pytest.mark.parametrize("change, reason", CASES, ids=[r.split()[0] + str(i) for i, (_, r) in enumerate(CASES)])
def test_each_reason(change, reason):
    assert plain_reason(replace(OK, **change)) == reason


def test_the_first_reason_wins():
    """Reasons are checked in the order above: with every cause present, each one's removal reveals
    the next."""
    every = {}
    for change, _ in CASES[2:]:
        every.update(change)
    every.update(drafter=False)
    expect = ["no drafter loaded (draft_model_path)", "dflash=False"] + [r for _, r in CASES[3:]]
    call, seen = replace(OK, **every), []
    for field in ["drafter", "want", "draft_model", "reset", "stopping_criteria"]:
        seen.append(plain_reason(call))
        call = replace(call, **{field: getattr(OK, field)})
    assert seen == expect and plain_reason(call) is None


@pytest.mark.parametrize("served", [
    dict(), dict(sampling=SAMPLED), dict(stopping_criteria=[StopOnTokens([1, 2])]), dict(stopping_criteria=[]),
    dict(sampling=replace(SAMPLED, mirostat_mode=1)), dict(sampling=replace(SAMPLED, mirostat_mode=2)),
    dict(sampling=replace(GREEDY, typical_p=0.5)), dict(sampling=replace(SAMPLED, typical_p=0.5)),
    dict(sampling=replace(SAMPLED, repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2)),
    dict(sampling=replace(SAMPLED, temperature=-1.0, typical_p=0.5)),
], ids=["greedy", "sampled", "stop-tokens", "no-criteria", "mirostat-1", "mirostat-2", "greedy-typical", "sampled-typical",
        "penalties", "raw-distribution-typical"])
def test_what_dflash_serves(served):
    """Penalties, seeds, top-k/p, typical-p, min-p, token-id stops: the sampler implements the whole
    chain llama_cpp builds, mirostat v1 and v2 included."""
    assert plain_reason(replace(OK, **served)) is None
