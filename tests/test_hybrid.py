"""Hybrid (gated delta-net) targets: DFlash stays lossless and the recurrent rollback is exact.

Qwen3.5 (``qwen35``) is on llama.cpp's partial-rollback list: with ``n_rs_seq >= n_draft`` the
verify pass keeps per-token recurrent snapshots and the decoder rolls back with ``seq_rm``
("snapshot"). With ``n_rs_seq = 0`` - and always on Qwen3-Next, which is not on that list - it
copies the recurrent state to the host before each verify and restores + replays the committed
rows ("checkpoint"). The random drafters accept almost nothing, so most tests also drive the loop
through the ``proposer`` hook with an oracle: it proposes the plain greedy continuation with its
first wrong token at a chosen offset, which gives every acceptance length 0..n, full blocks
included, while the drafter still receives every injection.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.errors import InvalidArgumentError
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, SpecOptions
from support import llama_cpp_greedy

PROMPTS = [b"def main(argv):\n    parser = argparse.ArgumentParser(",
           b"    for key, value in sorted(items):\n        if"]
N_CTX = 512
# (arch, rollback mode): Qwen3-Next is not on llama.cpp's rollback list, so it only has checkpoints
CASES = [("qwen35", "snapshot"), ("qwen35", "checkpoint"), ("qwen3next", "snapshot"), ("qwen3next", "checkpoint")]
# acceptance lengths the oracle proposer cycles through (clipped to n: >= n means a full block)
PATTERN = [0, 3, 99, 1, 5, 2, 6, 4]
# relative tolerance for recurrent states: replaying k rows as their own batch sums in another
# order than one batch over the whole prefix (measured max |diff| ~1e-5 on values up to ~30, for
# qwen35 and qwen3next; snapshot rollback was bit-exact); a state one token off differs by >= 6
STATE_RTOL = 1e-4


def opts(n_rs_seq: int = 0, n_batch: int = 64) -> ContextOptions:
    # one thread: the models are tiny, and ggml's spinning thread pool crawls on a busy 2-core box
    return ContextOptions(n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_rs_seq=n_rs_seq, n_threads=1)


class Hybrid:
    """One hybrid pair: decoders in a given rollback mode, plain references on fresh contexts."""

    def __init__(self, pair, mode: str, block: int):
        self.pair, self.mode, self.block = pair, mode, block
        self.tm, self.dm = Model(pair.target), Model(pair.drafter)
        self._ctxs: list[Context] = []
        self._ref = self._ctx(opts(n_batch=N_CTX))   # whole-prefix recomputes

    def _ctx(self, o, model=None, other=None) -> Context:
        c = Context(model or self.tm, o, other=other)
        self._ctxs.append(c)
        return c

    def decoder(self, *, proposer=None, drafter: bool = True) -> DFlashDecoder:
        """A decoder in this mode; ``drafter=False``: plain decoding on the same kind of target context."""
        tc = self._ctx(opts(self.block - 1 if self.mode == "snapshot" else 0))
        dc = self._ctx(opts(), self.dm, other=tc) if drafter else None
        dec = DFlashDecoder(tc, dc, SpecOptions(rollback=self.mode), OverrideProposer(proposer) if proposer else None)
        assert dec.rollback == self.mode
        if self.mode == "snapshot":
            assert tc.n_rs_seq == self.block - 1 > 0
        return dec

    def plain(self, prompt, n, **kw) -> list[int]:
        """Cold plain greedy run on a fresh context (no drafter)."""
        return list(DFlashDecoder(self._ctx(opts()), None).generate(prompt, n, **kw))

    def prefix_state(self, tokens) -> bytes:
        """Recurrent state after decoding ``tokens`` plainly, in one batch, on a fresh cache."""
        self._ref.clear()
        self._ref.decode(np.asarray(tokens, dtype=np.int32), 0, out_row0=len(tokens))
        return self._ref.save_seq()

    def close(self):
        for c in reversed(self._ctxs):
            c.close()
        self.dm.close()
        self.tm.close()


def oracle(full: list[int], pattern=PATTERN, record=None):
    """Proposer: the true continuation ``full[pos:]`` with its first wrong token at pattern[i]."""
    steps = itertools.count()

    def propose(ctx, n):
        if record is not None:
            record(ctx)
        j = pattern[next(steps) % len(pattern)]
        truth = list(full[len(ctx):len(ctx) + n])
        truth += [0] * (n - len(truth))
        if j < n:
            truth[j] = (truth[j] + 1) % 1000
        return truth
    return propose


def run(dec, prompt, n, **kw):
    st = GenerationStats()
    return list(dec.generate(prompt, n, stats=st, **kw)), st


def f32(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob[:len(blob) // 4 * 4], dtype=np.float32)


def assert_state_close(got: bytes, want: bytes):
    """Same layout; exactly equal, or equal as floats within STATE_RTOL of the state's scale."""
    assert len(got) == len(want)
    if got == want:
        return
    a, b = f32(got), f32(want)
    err, scale = float(np.max(np.abs(a - b))), float(np.max(np.abs(b)))
    assert err <= STATE_RTOL * scale, f"recurrent state differs by {err} (scale {scale})"




@pytest.fixture
def hybrid(models):
    made = []

    def make(arch="qwen35", mode="snapshot", block=8):
        h = Hybrid(models.pair(arch, "dflash", block), mode, block)
        made.append(h)
        return h
    yield make
    for h in made:
        h.close()


# ----------------------------------------------------------------------------------- fixture
def test_qwen35_fixture(hybrid):
    """The tiny Qwen3.5 converts as a hybrid qwen35 GGUF, decodes non-degenerately, and its drafter
    ropes as M-RoPE (the converter writes rope sections for a drafter of an M-RoPE target)."""
    import llama_cpp.llama_cpp as C

    h = hybrid("qwen35")
    assert (h.tm.arch, h.tm.is_hybrid, h.tm.is_recurrent, h.tm.n_layer) == ("qwen35", True, False, 4)
    assert h.tm.meta("qwen35.full_attention_interval") == "4" and h.tm.meta("qwen35.nextn_predict_layers") == "1"
    assert C.llama_model_rope_type(h.tm.ptr) == C.LLAMA_ROPE_TYPE_IMROPE
    assert C.llama_model_rope_type(h.dm.ptr) == C.LLAMA_ROPE_TYPE_MROPE   # sections [head_dim/2, 0, 0, 0]
    prompt = h.tm.tokenize(PROMPTS[0])
    ref = h.plain(prompt, 48, stop_tokens=[])
    assert len(set(ref)) >= 24, "random target collapsed into repetition"
    assert llama_cpp_greedy(h.pair.target, prompt, 48) == ref


# ------------------------------------------------------------------------- rollback selection
def test_rollback_kind_selection(models):
    pair = models.pair("qwen35", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    ctxs = []

    def dec(n_rs_seq, **spec):
        tc = Context(tm, opts(n_rs_seq))
        dc = Context(dm, opts(), other=tc)
        ctxs.extend([dc, tc])
        return DFlashDecoder(tc, dc, SpecOptions(**spec))
    try:
        d = dec(7)
        assert d.target.n_rs_seq == 7 and d.n_draft == 7 and d.rollback == "snapshot"
        assert dec(0).rollback == "checkpoint"
        assert dec(3).rollback == "checkpoint"                    # fewer snapshots than drafted rows
        assert dec(7, rollback="checkpoint").rollback == "checkpoint"
        assert dec(3, n_draft=3).rollback == "snapshot"
        with pytest.raises(InvalidArgumentError):
            dec(3, rollback="snapshot")
        with pytest.raises(InvalidArgumentError):
            dec(7, rollback="seq_rm")
        with pytest.raises(InvalidArgumentError):
            dec(0, rollback="seq_rm")
        # llama.cpp keeps the last n_rs_seq + 1 tokens in one ubatch (it aborts otherwise)
        with pytest.raises(InvalidArgumentError, match="n_ubatch"):
            Context(tm, ContextOptions(n_ctx=N_CTX, n_batch=8, n_ubatch=8, n_rs_seq=7, n_threads=1))
    finally:
        for c in ctxs:
            c.close()
        dm.close()
        tm.close()

    # an attention-only target: llama.cpp clamps n_rs_seq to 0 (not on its rollback list)
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    try:
        tc = Context(tm, opts(7))
        dc = Context(dm, opts(), other=tc)
        assert tc.n_rs_seq == 0
        assert DFlashDecoder(tc, dc).rollback == "seq_rm"
        dc.close()
        tc.close()
    finally:
        dm.close()
        tm.close()


def test_qwen3next_gets_snapshot_rollback(hybrid):
    """Qwen3-Next (MoE + gated delta-net) keeps n_rs_seq snapshots with patches/0005 (upstream clamps
    it to 0), so the decoder rolls back in place; without snapshots it takes host checkpoints."""
    h = hybrid("qwen3next", "checkpoint")
    assert (h.tm.arch, h.tm.is_hybrid, h.tm.n_layer) == ("qwen3next", True, 4)
    tc = h._ctx(opts(7))
    dc = h._ctx(opts(), h.dm, other=tc)
    assert tc.n_rs_seq == 7
    assert DFlashDecoder(tc, dc).rollback == "snapshot"
    with pytest.raises(InvalidArgumentError):
        DFlashDecoder(tc, dc, SpecOptions(rollback="seq_rm"))
    t0 = h._ctx(opts(0))
    d0 = h._ctx(opts(), h.dm, other=t0)
    assert t0.n_rs_seq == 0
    assert DFlashDecoder(t0, d0).rollback == "checkpoint"
    with pytest.raises(InvalidArgumentError):
        DFlashDecoder(t0, d0, SpecOptions(rollback="snapshot"))
    prompt = h.tm.tokenize(PROMPTS[0])
    ref = h.plain(prompt, 48, stop_tokens=[])
    assert len(set(ref)) >= 24, "random target collapsed into repetition"
    assert llama_cpp_greedy(h.pair.target, prompt, 48) == ref


# ------------------------------------------------------------------------------- lossless
@pytest.mark.parametrize("arch,mode,block", [(a, m, b) for a, m in CASES for b in (4, 8) if a == "qwen35" or b == 8])
def test_greedy_equals_plain(hybrid, arch, mode, block):
    h = hybrid(arch, mode, block)
    n = block - 1
    for text in PROMPTS:
        prompt = h.tm.tokenize(text)
        ref = h.plain(prompt, 64, stop_tokens=[])
        full = prompt + ref
        # the real (random) drafter: almost every block is rejected at its first row
        out, st = run(h.decoder(), prompt, 48, stop_tokens=[])
        assert out == ref[:48]
        assert st.steps > 0 and st.accepted < st.drafted and len(st.drafted_per_pos) == n
        # oracle drafts: every acceptance length 0..n
        out, st = run(h.decoder(proposer=oracle(full)), prompt, 48, stop_tokens=[])
        assert out == ref[:48]
        assert 0 < st.accepted < st.drafted and st.accepted_per_pos[-1] > 0

    prompt = h.tm.tokenize(PROMPTS[0])
    ref = h.plain(prompt, 64, stop_tokens=[])
    full = prompt + ref
    full_blocks = oracle(full, pattern=[99])

    # max_tokens ending mid-block: the last block is cut short, and the caches stay consistent
    m = block + 3
    dec = h.decoder(proposer=full_blocks)
    out, st = run(dec, prompt, m, stop_tokens=[])
    assert out == ref[:m] and st.finish == "length"
    more = h.tm.tokenize(b" return value")
    prompt2 = prompt + out + more
    out2, st2 = run(dec, prompt2, 24, stop_tokens=[])
    assert st2.n_reused == len(prompt) + m - 1                 # continued, not re-evaluated
    assert out2 == h.plain(prompt2, 24, stop_tokens=[])

    # a stop token in the middle of a full block (its first occurrence in the output)
    k = next(i for i in range(block + 1, len(ref)) if i % block not in (0, block - 1) and ref[i] not in ref[:i])
    for d in (h.decoder(proposer=full_blocks), h.decoder()):
        out, st = run(d, prompt, 48, stop_tokens=[ref[k]])
        assert out == ref[:k + 1] and st.finish == "stop"
        prompt2 = prompt + out + more
        out2, _ = run(d, prompt2, 24, stop_tokens=[])
        assert out2 == h.plain(prompt2, 24, stop_tokens=[])

    # the consumer stops iterating in the middle of a block
    dec = h.decoder(proposer=full_blocks)
    gen = dec.generate(prompt, 48, stop_tokens=[])
    got = [next(gen) for _ in range(block + 2)]
    gen.close()
    assert got == ref[:block + 2]
    prompt2 = prompt + got + more
    out2, st2 = run(dec, prompt2, 24, stop_tokens=[])
    assert st2.n_reused == len(prompt) + len(got) - 1
    assert out2 == h.plain(prompt2, 24, stop_tokens=[])

    # a one-token prompt: the first verify (and its rollback) starts at position 0
    one = prompt[:1]
    ref1 = h.plain(one, 24, stop_tokens=[])
    out, _ = run(h.decoder(proposer=oracle(one + ref1 + [0] * 8)), one, 24, stop_tokens=[])
    assert out == ref1

    # llama-cpp-python's own greedy path (EOS included)
    ref = llama_cpp_greedy(h.pair.target, prompt, 40)
    out, _ = run(h.decoder(proposer=oracle(prompt + ref + [0] * 8)), prompt, len(ref))
    assert out == ref


# --------------------------------------------------------------- rollback == prefix recompute
@pytest.mark.parametrize("arch,mode", CASES)
def test_recurrent_rollback_equals_prefix_recompute(hybrid, arch, mode):
    """After every block (partial, zero or full acceptance) the target's recurrent state equals a
    fresh plain decode of exactly the committed tokens; so do the next-token logits at the end.

    Compared as the bytes of ``save_seq`` (recurrent part only; it reads the pending snapshot slot
    after a snapshot rollback): exactly equal, or equal as float32 within STATE_RTOL of the state's
    magnitude - the checkpoint path replays the committed rows as their own batch, which changes
    the summation order (~1e-5 here) but nothing else. A control shows that a state one token off
    is far outside that tolerance.
    """
    h = hybrid(arch, mode, 8)
    prompt = h.tm.tokenize(PROMPTS[1])
    ref = h.plain(prompt, 80, stop_tokens=[])
    full = prompt + ref
    checked = []

    def check(ctx):   # called before each draft: the target holds ctx[:-1], ctx[-1] is pending
        got = dec.target.save_seq()
        assert_state_close(got, h.prefix_state(ctx[:-1]))
        off = f32(h.prefix_state(ctx[:-2]))
        assert float(np.max(np.abs(off - f32(got)))) > 100 * STATE_RTOL * float(np.max(np.abs(off)))
        checked.append(len(ctx))

    for n_tok in (37, 40):   # end on a partial block (rollback pending) and on a full one
        dec = h.decoder(proposer=oracle(full, record=check))
        checked.clear()
        out, st = run(dec, prompt, n_tok, stop_tokens=[])
        assert out == ref[:n_tok]
        assert 0 < st.accepted < st.drafted and len(checked) == st.steps
        committed = prompt + out[:-1]
        assert dec.cache == committed
        assert_state_close(dec.target.save_seq(), h.prefix_state(committed))
        # next-token logits from the rolled-back target vs the fresh recompute
        pend = np.asarray(out[-1:], dtype=np.int32)
        dec.target.decode(pend, len(committed), out_row0=0)
        got = dec.target.logits_row(0).copy()
        h.prefix_state(committed)
        h._ref.decode(pend, len(committed), out_row0=0)
        want = h._ref.logits_row(0)
        assert int(np.argmax(got)) == int(np.argmax(want)) == ref[n_tok]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * float(np.max(np.abs(want))))


# ---------------------------------------------------------------------- prompt reuse
@pytest.mark.parametrize("arch,mode", CASES)
def test_diverging_prompt_equals_cold_run(hybrid, arch, mode):
    """A second prompt that leaves the cached tokens a few positions back must not reuse a stale
    recurrent snapshot (llama.cpp accepts any removal within n_rs_seq, but only the rows of the
    last decode have snapshots): the decoder re-evaluates and matches a cold run."""
    h = hybrid(arch, mode, 8)
    prompt = h.tm.tokenize(PROMPTS[0])
    ref = h.plain(prompt, 40, stop_tokens=[])
    for dec in (h.decoder(proposer=oracle(prompt + ref + [0] * 8)), h.decoder(), h.decoder(drafter=False)):
        for back in (2, 3, 5, 12):
            dec.reset()
            out, _ = run(dec, prompt, 20, stop_tokens=[])
            assert out == ref[:20]
            prompt2 = prompt + out[:20 - back] + h.tm.tokenize(b" else")
            out2, _ = run(dec, prompt2, 16, stop_tokens=[])
            assert out2 == h.plain(prompt2, 16, stop_tokens=[])


# ------------------------------------------------------------------------------- memory cap
def test_choose_for_memory_rules():
    from dflash_gguf.decoding.rollback import choose_for_memory

    mib = 2**20
    assert choose_for_memory(10 * mib, 15, None) == "snapshot"            # no cap: snapshots
    assert choose_for_memory(10 * mib, 15, 150 * mib) == "snapshot"       # 15 copies fit exactly
    assert choose_for_memory(10 * mib, 15, 149 * mib) == "checkpoint"     # they do not: one host copy
    assert choose_for_memory(10 * mib, 3, 40 * mib) == "snapshot"         # a smaller block fits
    assert choose_for_memory(10 * mib, 0, 1) == "checkpoint"              # nothing drafted: no snapshots
    with pytest.raises(InvalidArgumentError, match="at least 10"):
        choose_for_memory(10 * mib, 15, 9 * mib)


def test_snapshot_memory_is_n_copies_of_the_state(models):
    """llama.cpp's recurrent buffer grows by one state copy per snapshot: the cost model the cap uses."""
    import logging
    import re

    from dflash_gguf.decoding.rollback import recurrent_state_bytes

    pair = models.pair("qwen35", "dflash", 8)
    lines: list[float] = []

    class Grab(logging.Handler):
        def emit(self, record):
            m = re.search(r"RS buffer size =\s+([0-9.]+) MiB", record.getMessage())
            if m:
                lines.append(float(m.group(1)))
    lg = logging.getLogger("dflash_gguf.llama_cpp")
    grab, old = Grab(), lg.level
    lg.addHandler(grab)
    lg.setLevel(logging.DEBUG)
    try:
        with Model(pair.target) as tm:
            sizes = {}
            for n_rs in (0, 3, 7):
                lines.clear()
                with Context(tm, opts(n_rs)) as tc:
                    sizes[n_rs] = lines[-1]
                    state = recurrent_state_bytes(tc)
                    assert tc.pos_max() == -1            # the probe leaves the memory empty
    finally:
        lg.removeHandler(grab)
        lg.setLevel(old)
    # llama.cpp prints MiB with two decimals: compare within that rounding (two values, 0.005 each)
    assert sizes[0] * 2**20 == pytest.approx(state, abs=0.0051 * 2**20), (sizes, state)
    for n_rs in (3, 7):
        extra = (sizes[n_rs] - sizes[0]) * 2**20
        assert extra == pytest.approx(n_rs * state, abs=0.0101 * 2**20), (sizes, state)


def test_rollback_memory_mb_picks_the_kind_and_stays_lossless(models):
    """Llama(rollback_memory_mb=): snapshots while n_draft copies of the state fit, a host checkpoint
    when they do not, a clear error below one copy; the text is plain decoding's every time."""
    from dflash_gguf import Llama
    from dflash_gguf.decoding.rollback import recurrent_state_bytes

    pair = models.pair("qwen35", "dflash", 8)
    with Model(pair.target) as tm, Context(tm, opts(0)) as tc:
        state_mib = recurrent_state_bytes(tc) / 2**20
    kw = dict(n_ctx=N_CTX, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, verbose=False,
              draft_adaptive=False)
    text = PROMPTS[0].decode()
    ref = None
    for cap, want in ((None, "snapshot"), (7 * state_mib * 1.001, "snapshot"), (6.5 * state_mib, "checkpoint"),
                      (1.5 * state_mib, "checkpoint")):
        llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), rollback_memory_mb=cap, **kw)
        try:
            assert llm.dflash_info["rollback"] == want, cap
            assert llm.decoder.target.n_rs_seq == (7 if want == "snapshot" else 0)
            out = llm.create_completion(text, max_tokens=32, temperature=0)["choices"][0]["text"]
            if ref is None:
                ref = llm.create_completion(text, max_tokens=32, temperature=0, dflash=False)["choices"][0]["text"]
            assert out == ref
        finally:
            llm.close()
    with pytest.raises(InvalidArgumentError, match="rollback_memory_mb"):
        Llama(str(pair.target), draft_model_path=str(pair.drafter), rollback_memory_mb=0.5 * state_mib, **kw)
