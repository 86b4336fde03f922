"""The DFlash loop is lossless: token for token equal to plain decoding of the same target.

Plain references are (a) llama-cpp-python's own ``Llama`` greedy path and (b) the decoder with no
drafter (one token per step through the same C helpers).
"""
from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.errors import ContextOverflowError, InvalidArgumentError
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, SpecOptions
from support import llama_cpp_greedy

PROMPTS = [b"def main(argv):\n    parser = argparse.ArgumentParser(",
           b"    for key, value in sorted(items):\n        if"]
N_CTX = 512


class Rig:
    """A target + drafter pair with one DFlash decoder and one plain decoder (own contexts)."""

    def __init__(self, pair, n_draft=None, proposer=None, **spec):
        self.tm, self.dm = Model(pair.target), Model(pair.drafter)
        opts = ContextOptions(n_ctx=N_CTX, n_batch=64, n_ubatch=64)
        self.tc = Context(self.tm, opts)
        self.dc = Context(self.dm, opts, other=self.tc)
        self.dec = DFlashDecoder(self.tc, self.dc, SpecOptions(n_draft=n_draft, **spec),
                                 OverrideProposer(proposer) if proposer else None)
        self.pc = Context(self.tm, opts)
        self.plain = DFlashDecoder(self.pc, None)

    def run(self, dec, prompt, n, **kw):
        st = GenerationStats()
        out = list(dec.generate(prompt, n, stats=st, **kw))
        return out, st

    def close(self):
        for c in (self.dc, self.tc, self.pc):
            c.close()
        self.dm.close()
        self.tm.close()




@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("block", [4, 8, 16])
def test_greedy_equals_plain(models, arch, kind, block):
    pair = models.pair(arch, kind, block)
    rig = Rig(pair)
    try:
        assert rig.dec.n_draft == block - 1
        for text in PROMPTS:
            prompt = rig.tm.tokenize(text)
            ref, _ = rig.run(rig.plain, prompt, 48, stop_tokens=[])
            out, st = rig.run(rig.dec, prompt, 48, stop_tokens=[])
            assert out == ref
            assert st.steps > 0 and st.drafted >= st.accepted and st.n_generated == 48
            assert len(st.drafted_per_pos) == block - 1
        # the independent plain path: llama-cpp-python's own greedy generate (EOS included)
        prompt = rig.tm.tokenize(PROMPTS[0])
        ref = llama_cpp_greedy(pair.target, prompt, 40)
        out, _ = rig.run(rig.dec, prompt, len(ref))
        assert out == ref
    finally:
        rig.close()


@pytest.fixture(scope="module")
def rig(models):
    r = Rig(models.pair("qwen3", "dflash", 8))
    yield r
    r.close()


def drafter_covers(dc, feed) -> int:
    """Positions the drafter has features for: its cache, then the rows plain steps kept on the host
    (which must start right after it)."""
    n_cache = dc.pos_max() + 1
    if feed.n:
        assert feed.start == n_cache, (feed.start, n_cache)
    return n_cache + feed.n


def test_max_tokens_mid_block(rig):
    prompt = rig.tm.tokenize(PROMPTS[0])
    ref, _ = rig.run(rig.plain, prompt, 40, stop_tokens=[])
    for n in (1, 2, 3, 7, 8, 9, 13, 40):
        out, st = rig.run(rig.dec, prompt, n, stop_tokens=[])
        assert out == ref[:n], n
        assert st.finish == "length"
        # caches hold exactly prompt + output minus the last (pending) token, as plain decoding
        assert rig.dec.cache == prompt + out[:-1]
        assert rig.tc.pos_max() == len(prompt) + n - 2
        assert drafter_covers(rig.dc, rig.dec.features) == len(prompt) + n - 1


def test_stop_token_mid_block(rig):
    prompt = rig.tm.tokenize(PROMPTS[1])
    ref, _ = rig.run(rig.plain, prompt, 40, stop_tokens=[])
    for idx in (0, 3, 5, 11, 20):
        stop = ref[idx]
        first = ref.index(stop)
        out, st = rig.run(rig.dec, prompt, 40, stop_tokens=[stop])
        assert out == ref[:first + 1]
        assert st.finish == "stop"
        assert rig.dec.cache == prompt + out[:-1]


def test_consumer_stops_early_like_a_stop_string(rig):
    """A consumer that breaks out mid-block (stop string) leaves the caches at what it consumed."""
    prompt = rig.tm.tokenize(PROMPTS[0])
    ref, _ = rig.run(rig.plain, prompt, 30, stop_tokens=[])
    for keep in (1, 4, 9):
        gen = rig.dec.generate(prompt, 30, stop_tokens=[])
        got = [next(gen) for _ in range(keep)]
        gen.close()
        assert got == ref[:keep]
        assert rig.dec.cache == prompt + got[:-1]
        assert rig.tc.pos_max() == len(prompt) + keep - 2
        # and the next call continues exactly where plain decoding would
        cont, _ = rig.run(rig.dec, prompt + got, 10, stop_tokens=[])
        ref2, _ = rig.run(rig.plain, prompt + got, 10, stop_tokens=[])
        assert cont == ref2


def test_continuation_and_prefix_reuse(rig):
    prompt = rig.tm.tokenize(PROMPTS[0])
    first, _ = rig.run(rig.dec, prompt, 20, stop_tokens=[])
    follow = prompt + first + rig.tm.tokenize(b"\n    return", add_bos=False)
    warm, st = rig.run(rig.dec, follow, 25, stop_tokens=[])
    assert st.n_reused == len(prompt) + len(first) - 1        # everything cached was reused
    rig.dec.reset()
    cold, st_cold = rig.run(rig.dec, follow, 25, stop_tokens=[])
    assert st_cold.n_reused == 0
    ref, _ = rig.run(rig.plain, follow, 25, stop_tokens=[])
    assert warm == cold == ref
    # a different prompt sharing a prefix truncates both caches and stays exact
    other = prompt[:5] + rig.tm.tokenize(b" lambda x:", add_bos=False)
    out, st = rig.run(rig.dec, other, 20, stop_tokens=[])
    assert st.n_reused == 5
    assert out == rig.run(rig.plain, other, 20, stop_tokens=[])[0]


def test_oracle_drafter_gives_full_blocks_and_bad_drafter_gives_one(models):
    pair = models.pair("qwen3", "dflash", 8)
    probe = Rig(pair)
    prompt = probe.tm.tokenize(PROMPTS[0])
    # the first token comes with the prompt's pass, then 8 blocks of 8 (7 drafted tokens and the target's)
    ref, _ = probe.run(probe.plain, prompt, 65, stop_tokens=[])
    probe.close()
    full = prompt + ref

    def oracle(ctx_tokens, n):           # the target's own greedy continuation
        i = len(ctx_tokens)
        return full[i:i + n]

    rig = Rig(pair, proposer=oracle)
    try:
        out, st = rig.run(rig.dec, prompt, 65, stop_tokens=[])
        assert out == ref
        assert st.steps == 8 and st.passes == 9 and st.accepted == 56 and st.tau == 8.0
        assert st.acceptance_rate_per_pos == [1.0] * 7
    finally:
        rig.close()

    def wrong(ctx_tokens, n):             # never the target's token
        i = len(ctx_tokens)
        return [(t + 1) % 512 for t in full[i:i + n]]

    rig = Rig(pair, proposer=wrong)
    try:
        out, st = rig.run(rig.dec, prompt, 65, stop_tokens=[])
        assert out == ref
        assert st.accepted == 0 and st.tau == 1.0 and st.steps == 63
    finally:
        rig.close()


def test_n_draft_is_clamped_and_budget_respected(models):
    pair = models.pair("qwen3", "dflash", 4)
    rig = Rig(pair, n_draft=50)
    try:
        assert rig.dec.n_draft == 3
        prompt = rig.tm.tokenize(PROMPTS[0])
        ref, _ = rig.run(rig.plain, prompt, 10, stop_tokens=[])
        out, st = rig.run(rig.dec, prompt, 10, stop_tokens=[])
        assert out == ref and st.n_generated == 10
    finally:
        rig.close()
    rig = Rig(pair, n_draft=1)
    try:
        out, st = rig.run(rig.dec, prompt, 10, stop_tokens=[])
        assert out == ref and st.drafted <= st.steps
    finally:
        rig.close()


def test_bad_input(rig):
    with pytest.raises(InvalidArgumentError):
        list(rig.dec.generate([], 5))
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        list(rig.dec.generate([1, 99999], 5))
    with pytest.raises(ContextOverflowError):
        list(rig.dec.generate([1] * (N_CTX + 1), 5))
    # the decoder still works after refusing
    prompt = rig.tm.tokenize(PROMPTS[0])
    assert rig.run(rig.dec, prompt, 5, stop_tokens=[])[0] == rig.run(rig.plain, prompt, 5, stop_tokens=[])[0]


def test_context_full_stops_cleanly(models):
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=64, n_batch=64, n_ubatch=64)
    tc = Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    pc = Context(tm, opts)
    try:
        prompt = tm.tokenize(PROMPTS[0])
        st = GenerationStats()
        out = list(DFlashDecoder(tc, dc).generate(prompt, 1000, stats=st, stop_tokens=[]))
        ref = list(DFlashDecoder(pc, None).generate(prompt, 1000, stop_tokens=[]))
        assert out == ref and st.finish == "context"
        assert len(prompt) + len(out) - 1 == tc.n_ctx   # llama.cpp may round n_ctx up
    finally:
        for c in (dc, tc, pc):
            c.close()
        dm.close()
        tm.close()


def _propose(rig, pos, pending, ctx, n=7):
    """The drafter's proposal for one sequence (slot 0) at ``pos``."""
    out = np.zeros((1, n), dtype=np.int32)
    got = rig.dec.proposer.propose(rig.dc, np.array([0], dtype=np.int32), np.array([pos], dtype=np.int32),
                                   np.array([pending], dtype=np.int32), n, out, lambda i: ctx[:-1])
    return out[0, :got].tolist()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_plain_steps_keep_features_on_the_host(models, kind):
    """Rows of the prompt and of plain steps go to the host and reach the drafter in one call before the
    next draft:
    its cache then holds what injecting each row at once gives (same proposals), and DFlash after a
    plain stretch still equals plain decoding."""
    pair = models.pair("qwen3", kind, 8)
    rig, ref_rig = Rig(pair), Rig(pair)
    try:
        prompt = rig.tm.tokenize(PROMPTS[0])
        plain, _ = rig.run(rig.plain, prompt, 40, stop_tokens=[])
        # A: 20 plain steps (features kept on the host), then draft once
        gen = rig.dec.generate(prompt, 20, stop_tokens=[], use_draft=False)
        first = [next(gen) for _ in range(20)]
        # the prompt's rows and the plain steps', on the host: the drafter has run for none of them
        assert first == plain[:20] and rig.dec.features.n == len(prompt) - 1 + 19
        assert rig.dc.pos_max() == -1
        with pytest.raises(StopIteration):
            next(gen)
        # still on the host after the call: a request that decodes plainly to its end injects nothing
        assert rig.dec.features.n == len(prompt) - 1 + 20 and rig.dc.pos_max() == -1
        ctx = prompt + first
        pos, pending = len(ctx) - 1, ctx[-1]
        rig.dec.features.flush()                                   # what the next draft does first
        assert rig.dec.features.n == 0 and rig.dc.pos_max() == len(prompt) + 18
        a = _propose(rig, pos, pending, ctx)
        # B: the same tokens as a prompt (features injected as the prompt is decoded)
        ref_rig.run(ref_rig.dec, ctx, 1, stop_tokens=[])
        ref_rig.dec.keep_prefix(len(ctx) - 1)
        assert a == _propose(ref_rig, pos, pending, ctx)
        # and drafting resumes losslessly after the plain stretch (continuation of the same cache)
        rest, st = rig.run(rig.dec, ctx, 20, stop_tokens=[])
        assert rest == plain[20:40] and st.steps > 0 and st.n_reused == len(ctx) - 1
    finally:
        rig.close()
        ref_rig.close()


@pytest.mark.parametrize("cap", [None, 16])
def test_the_host_buffer_grows_then_injects_at_its_cap(models, cap):
    """Rows of a long plain stretch stay on the host past the buffer's first size (no drafter run mid-way:
    it would push a small target out of the caches); at the buffer's cap they are injected, the rest kept
    after them; either way the drafter then covers every position once, and drafting resumes losslessly."""
    from dflash_gguf.decoding import features
    pair = models.pair("qwen3", "dflash", 8)
    rig = Rig(pair)
    try:
        prompt = rig.tm.tokenize(PROMPTS[0])
        n = features.FIRST_ROWS + 36
        plain, _ = rig.run(rig.plain, prompt, n + 20, stop_tokens=[])
        feed = rig.dec.features
        if cap is not None:
            feed.max_rows = cap
        first, _ = rig.run(rig.dec, prompt, n, stop_tokens=[], use_draft=False)
        assert first == plain[:n]
        if cap is None:
            assert feed.n == len(prompt) - 1 + n and rig.dc.pos_max() == -1   # nothing injected yet
            assert len(feed.buf) == 2 * features.FIRST_ROWS
        else:
            assert 0 < feed.n <= cap                                        # injected at the cap, in order
            assert len(feed.buf) <= max(cap, len(prompt))     # (a prompt's chunk, or its tail with the first token, may pass it)
        assert drafter_covers(rig.dc, feed) == len(prompt) - 1 + n
        ctx = prompt + first
        rest, st = rig.run(rig.dec, ctx, 20, stop_tokens=[])
        assert rest == plain[n:n + 20] and st.steps > 0
    finally:
        rig.close()
