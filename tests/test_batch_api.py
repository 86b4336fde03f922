"""The batch API (dflash_gguf.batch.BatchLlama): many prompts at once, each completion what
llama_cpp.Llama gives for that prompt alone (text, stop strings, finish reason, chat template)."""
from __future__ import annotations

import llama_cpp
import pytest

from dflash_gguf.batch import BatchLlama
from dflash_gguf.demo import DEMO_DIR
from dflash_gguf.errors import InvalidArgumentError
from chat_templates import QWEN3, token_mid_answer, with_chat_template

TARGET, DRAFTER = DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf"
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import json\n\ndef load(path):\n",
           "for i in range(10):\n", "def add(a, b):\n    return", "# sort a list\n"]
PLAIN_KW = dict(n_ctx=512, n_threads=2, seed=0, verbose=False)


@pytest.fixture(scope="module")
def plain():
    llm = llama_cpp.Llama(str(TARGET), **PLAIN_KW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def batch():
    # blocks pinned: the speed gate (tests/test_batch.py) may rightly decode the demo pair plainly here
    with BatchLlama(TARGET, DRAFTER, n_parallel=3, n_ctx=512, n_threads=2, draft_adaptive=False) as b:
        yield b


def _plain_text(plain, prompt, **kw):
    out = plain.create_completion(prompt, temperature=0, **kw)["choices"][0]
    return out["text"], out["finish_reason"]


def test_completions_equal_llama_cpp_alone(plain, batch):
    want = [_plain_text(plain, p, max_tokens=40) for p in PROMPTS]
    got = batch.generate(PROMPTS, max_tokens=40)
    assert [(c.text, c.finish_reason) for c in got] == want
    assert all(c.prompt_tokens == len(plain.tokenize(p.encode())) for c, p in zip(got, PROMPTS))
    st = [c.stats for c in got]
    assert sum(s.steps for s in st) > 0 and sum(s.accepted for s in st) > 0, "the trained drafter drafts"
    # plain decoding in the same engine (dflash=False): the same text
    assert [c.text for c in batch.generate(PROMPTS, max_tokens=40, dflash=False)] == [w[0] for w in want]


def test_stop_strings_cut_like_llama_cpp(plain, batch):
    full = [_plain_text(plain, p, max_tokens=48)[0] for p in PROMPTS]
    stops = []
    for text in full:   # a piece of each reference, past its start, as a stop string
        piece = text[len(text) // 2:len(text) // 2 + 3]
        stops.append(piece if piece.strip() else "\n")
    for p, s in zip(PROMPTS, stops):
        want = _plain_text(plain, p, max_tokens=48, stop=[s])
        (c,) = batch.generate([p], max_tokens=48, stop=[s])
        assert (c.text, c.finish_reason) == want, (p, s)
    got = batch.generate(PROMPTS, max_tokens=48, stop=stops[:1] + ["\n\n\n"])
    for p, c in zip(PROMPTS, got):
        assert (c.text, c.finish_reason) == _plain_text(plain, p, max_tokens=48, stop=stops[:1] + ["\n\n\n"])


def test_seeded_sampling_repeats():
    """The same seeded batch on a fresh BatchLlama gives the same text (same slots, same steps); which
    text a seed gives is not tied to the batch around it (drafts, hence the random numbers a step uses,
    depend on it), while its distribution is (tests/test_batch.py)."""
    runs = []
    for _ in range(2):
        with BatchLlama(TARGET, DRAFTER, n_parallel=3, n_ctx=512, n_threads=2) as b:
            runs.append([c.tokens for c in b.generate(PROMPTS[:4], max_tokens=24, temperature=0.8, seed=7)])
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 4


def test_repeated_prompts_of_a_seeded_batch_sample_with_seeds_of_their_own():
    """Prompt ``i`` of a seeded batch samples with ``seed + i``: the same prompt four times in one sampled
    batch gives four completions of their own, not one completion four times."""
    with BatchLlama(TARGET, DRAFTER, n_parallel=4, n_ctx=512, n_threads=2) as b:
        got = b.generate([PROMPTS[0]] * 4, max_tokens=24, temperature=0.8, seed=7)
    assert len({tuple(c.tokens) for c in got}) == 4, [c.text for c in got]


def test_a_prompt_takes_the_free_slot_that_holds_its_longest_prefix():
    """Admission puts a prompt on the free slot whose cache shares the longest prefix with it: a prompt that
    continues one of three cached completions reuses everything that completion's slot holds (its prompt
    and its tokens but the last, never decoded), and the same prompt right after reuses all of itself but
    its last token, whichever slot each was cached in."""
    with BatchLlama(TARGET, DRAFTER, n_parallel=3, n_ctx=512, n_threads=2) as b:
        first = b.generate(PROMPTS[:3], max_tokens=8)
        assert [c.finish_reason for c in first] == ["length"] * 3
        ids = [b.model.tokenize(p.encode(), add_bos=True, special=True) for p in PROMPTS[:3]]
        more = b.model.tokenize(b"\n# more", add_bos=False, special=True)
        for i in (2, 0, 1):
            follow = ids[i] + first[i].tokens + more
            (c,) = b.generate([follow], max_tokens=4)
            assert c.stats.n_reused == len(ids[i]) + len(first[i].tokens) - 1, i
            (again,) = b.generate([follow], max_tokens=4)
            assert again.stats.n_reused == len(follow) - 1, i


@pytest.mark.parametrize("eos", ["template", "mid-answer"])
def test_chat_uses_the_gguf_template(models, tmp_path, eos):
    """The GGUF's template and end of turn; "mid-answer": the end-of-turn token is an ordinary token of the
    greedy answer whose vocabulary entry is not its text (so the template's stop string never matches):
    the reply ends on it, without its text, as llama_cpp's does."""
    pair = models.pair("qwen3", "dflash", 8)
    target = with_chat_template(pair.target, tmp_path / "chat.gguf", QWEN3)
    convs = [[{"role": "user", "content": "def add(a, b):"}],
             [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]]
    ref = llama_cpp.Llama(str(target), **PLAIN_KW, chat_format=None)
    try:
        if eos == "mid-answer":
            n = ref.create_chat_completion(convs[0], max_tokens=60, temperature=0)["usage"]["prompt_tokens"]
            eot = token_mid_answer(ref, ref.input_ids[n:ref.n_tokens].tolist(), unlike_its_name=True)
            assert eot is not None
            ref.close()
            target = with_chat_template(pair.target, tmp_path / "chat-eot.gguf", QWEN3, eos_token_id=eot)
            ref = llama_cpp.Llama(str(target), **PLAIN_KW, chat_format=None)
        want = [ref.create_chat_completion(m, max_tokens=24, temperature=0)["choices"][0] for m in convs]
    finally:
        ref.close()
    with BatchLlama(target, pair.drafter, n_parallel=2, n_ctx=512) as b:
        got = b.chat(convs, max_tokens=24)
    assert [c.text for c in got] == [w["message"]["content"] for w in want]
    assert [c.finish_reason for c in got] == [w["finish_reason"] for w in want]
    if eos == "mid-answer":
        assert want[0]["finish_reason"] == "stop"


def test_bad_arguments(models):
    pair = models.pair("qwen3", "dflash", 8)
    with pytest.raises(InvalidArgumentError, match="n_parallel"):
        BatchLlama(pair.target, pair.drafter, n_parallel=0)
    with BatchLlama(pair.target, None, n_parallel=1, n_ctx=128) as b:
        with pytest.raises(InvalidArgumentError, match="chat template"):
            b.chat([[{"role": "user", "content": "hi"}]])
        with pytest.raises(InvalidArgumentError, match="max_tokens"):
            b.generate(["x"], max_tokens=-1)


HYBRID_PROMPTS = ["def main(argv):\n    parser = argparse.ArgumentParser(", "    for key, value in sorted(items):\n",
                  "import os\n", "x = [i * i for i in range("]


def test_a_hybrid_target_batches_with_snapshots_or_host_checkpoints(models):
    """A hybrid target (Qwen3.5's gated delta-net) in a batch: by default every sequence rolls back by
    recurrent snapshots (n_rs_seq = the tokens drafted); a rollback_memory_mb below all sequences'
    snapshots takes host checkpoints; either way each completion is llama_cpp's for the prompt alone."""
    from dflash_gguf.decoding.rollback import recurrent_state_bytes
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    pair = models.pair("qwen35", "dflash", 8)
    plain = llama_cpp.Llama(str(pair.target), n_ctx=256, n_batch=64, n_threads=1, seed=0, verbose=False)
    try:
        want = [_plain_text(plain, p, max_tokens=24) for p in HYBRID_PROMPTS]
    finally:
        plain.close()
    tm = Model(pair.target)
    try:
        c = Context(tm, ContextOptions(n_ctx=64, n_batch=64, n_ubatch=64, n_threads=1))
        state = recurrent_state_bytes(c)
        c.close()
    finally:
        tm.close()
    kw = dict(n_parallel=3, n_ctx=256, n_batch=64, n_threads=1, draft_adaptive=False)
    for cap, kind in [(None, "snapshot"), (state * 7 * 3 / 2**20, "snapshot"), ((state * 7 * 3 - 1) / 2**20, "checkpoint")]:
        with BatchLlama(pair.target, pair.drafter, rollback_memory_mb=cap, **kw) as b:
            assert b.decoder.rollback == kind and b.decoder.n_draft == 7
            assert b.target.n_rs_seq == (7 if kind == "snapshot" else 0)
            got = b.generate(HYBRID_PROMPTS, max_tokens=24)
            assert [(g.text, g.finish_reason) for g in got] == want, kind
            assert sum(g.stats.drafted for g in got) > 0
