"""Long contexts: 16k and 32k tokens on tiny Qwen3, Llama and Qwen3.5 (hybrid) pairs.

For each target and context size the prompt fills the context up to a few tokens short of the end,
then the decoder generates to (and past) the limit:

* no crash, and the output is the target's plain greedy output token for token - with the real
  drafter and with an oracle proposer that makes blocks commit several tokens (accept + rollback
  at positions past 16k / 32k);
* the caches are the size llama.cpp was predicted to allocate (target KV for the whole context, the
  drafter's for its default window + one block, read from llama.cpp's own log), the drafter's cache
  holds exactly the last ``window`` positions after the run, and the process grows by no more than
  the buffers llama.cpp reported;
* at the context limit the caller gets a clear outcome, never an abort: a prompt longer than the
  context raises :class:`ContextOverflowError`, a generation that reaches the limit ends with
  ``finish == "context"`` after exactly the tokens that fit (and the same ones as plain decoding).

Runtime is dominated by the prefill (attention over the prompt); the tiny targets (hidden 64,
4 layers) keep a 32k prefill to seconds. One prefill per (target, size) serves both the plain and
the DFlash run: the second run reuses the prompt's cache (attention targets; a hybrid re-evaluates).
"""
from __future__ import annotations

import logging
import re
import sys
import time

import pytest

import tiny
from dflash_gguf.native.engine import DEFAULT_DRAFT_CACHE, Context, ContextOptions, Model
from dflash_gguf.errors import ContextFullError, ContextOverflowError
from dflash_gguf.decoding import DFlashDecoder, DrafterProposer, GenerationStats, OverrideProposer

pytestmark = pytest.mark.slow

SIZES = (16384, 32768)
ARCHS = ("qwen3", "llama", "qwen35")
N_GEN = 48          # tokens generated near the end of the context
ROOM = 40           # the prompt leaves this many positions free: the last blocks run into the limit
# tiny.make_target / make_hybrid_target defaults: 2 KV heads x 16 dims; qwen35 has 1 attention layer of 4
ATTN_LAYERS = {"qwen3": 4, "llama": 4, "qwen35": 1}
KV_ROW_BYTES = 2 * 2 * 16 * 2      # (K + V) x kv_heads x head_dim x f16
BLOCK = 8                          # the tiny drafters' block size
WINDOW = DEFAULT_DRAFT_CACHE - BLOCK   # the default drafter window


def pad256(n: int) -> int:
    return -(-n // 256) * 256      # llama.cpp pads a context's cells to a multiple of 256

log = logging.getLogger("dflash_gguf.tests.long_context")


class _Buffers(logging.Handler):
    """Collects llama.cpp's buffer-size log lines (routed to logging by conftest's set_log_handler)."""

    PAT = re.compile(r"(\w+)\s*:\s+(\S+) (KV|RS|compute|output) buffer size =\s+([0-9.]+) MiB")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str, float]] = []

    def emit(self, record):
        m = self.PAT.search(record.getMessage())
        if m:
            self.lines.append((m.group(1), m.group(3), float(m.group(4))))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def long_prompt(model: Model, n: int) -> list[int]:
    text = tiny._corpus(max_bytes=600_000).encode()
    toks = model.tokenize(text)
    while len(toks) < n:
        toks += model.tokenize(text, add_bos=False)
    return toks[:n]


def oracle(full: list[int]):
    """Proposes the true continuation with a wrong token at a rotating offset (0..n accepted)."""
    step = [0]

    def propose(ctx, n):
        j = (0, 3, 99, 1, 6, 2)[step[0] % 6]
        step[0] += 1
        truth = list(full[len(ctx):len(ctx) + n]) + [0] * n
        truth = truth[:n]
        if j < n:
            truth[j] = (truth[j] + 1) % 500
        return truth
    return propose


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request, models):
    arch = request.param
    pair = models.pair(arch, "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    yield arch, tm, dm
    dm.close(), tm.close()


def _contexts(arch: str, tm: Model, dm: Model, n_ctx: int, grab: _Buffers):
    hybrid = arch in tiny.HYBRID_ARCHS
    root = logging.getLogger("dflash_gguf.llama_cpp")
    root.addHandler(grab)
    old = root.level
    root.setLevel(logging.DEBUG)
    try:
        # one thread: the models are tiny and ggml's thread pool crawls on a busy 2-core machine
        tc = Context(tm, ContextOptions(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=1,
                                        n_rs_seq=7 if hybrid else 0))
        dc = Context(dm, ContextOptions(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=1), other=tc)
    finally:
        root.removeHandler(grab)
        root.setLevel(old)
    return tc, dc


@pytest.mark.parametrize("n_ctx", SIZES)
def test_long_context_lossless_and_sized_as_predicted(arch_pair, n_ctx):
    arch, tm, dm = arch_pair
    rss0 = _rss_mib()
    grab = _Buffers()
    tc, dc = _contexts(arch, tm, dm, n_ctx, grab)
    try:
        # --- memory: KV caches as predicted (llama.cpp's own numbers), RSS growth within what it reported
        kv = [mib for _, kind, mib in grab.lines if kind == "KV"]
        want_t = n_ctx * KV_ROW_BYTES * ATTN_LAYERS[arch] / 2**20
        # the drafter: one layer, window + block cells (not the context's n_ctx)
        want_d = pad256(WINDOW + BLOCK) * KV_ROW_BYTES * 1 / 2**20
        assert len(kv) == 2 and kv[0] == pytest.approx(want_t, abs=0.01) and kv[1] == pytest.approx(want_d, abs=0.01), grab.lines
        reported = sum(mib for _, _, mib in grab.lines)

        prompt = long_prompt(tm, n_ctx - ROOM)
        dec = DFlashDecoder(tc, dc)
        t0 = time.perf_counter()
        plain = list(dec.generate(prompt, N_GEN, stop_tokens=[], use_draft=False))
        t_plain = time.perf_counter() - t0
        # the prompt fills all but ROOM positions: plain decoding stops at the limit, by itself (the
        # token predicted at the last position is the last one: ROOM + 1 tokens)
        assert len(plain) == ROOM + 1 and len(set(plain)) > 4

        st = GenerationStats()
        t0 = time.perf_counter()
        out = list(dec.generate(prompt, N_GEN, stats=st, stop_tokens=[]))
        t_dflash = time.perf_counter() - t0
        assert out == plain
        assert st.finish == "context" and st.steps > 0
        if arch not in tiny.HYBRID_ARCHS:
            assert st.n_reused == len(prompt) - 1          # the plain run's prompt cache was reused

        dec.proposer = OverrideProposer(oracle(prompt + plain))          # blocks that commit several tokens
        st2 = GenerationStats()
        out2 = list(dec.generate(prompt, N_GEN, stats=st2, stop_tokens=[]))
        assert out2 == plain
        assert st2.accepted > 0 and st2.accepted < st2.drafted and st2.finish == "context"
        # the drafter's cache slid with the context: exactly the last `window` committed positions (once the
        # rows of the last plain steps, kept on the host, are in: what the next draft does first)
        dec.features.flush()
        n_done = len(dec.cache)
        assert dc.pos_max() == n_done - 1
        assert dc.pos_min() == n_done - WINDOW
        grown = _rss_mib() - rss0
        log.info("%s n_ctx=%d: plain %.1f s, dflash %.1f s (with prefill), buffers %.1f MiB, RSS +%.1f MiB",
                 arch, n_ctx, t_plain, t_dflash, reported, grown)
        print(f"{arch} n_ctx={n_ctx}: plain run {t_plain:.1f} s, dflash run {t_dflash:.1f} s, "
              f"llama.cpp buffers {reported:.1f} MiB, RSS +{grown:.1f} MiB", file=sys.stderr)
        # the process grows by the buffers llama.cpp reported (KV, compute, output) plus small change
        assert grown <= reported + 32, (grown, reported, grab.lines)
    finally:
        dc.close(), tc.close()


def test_context_limit_errors(arch_pair):
    """At 16k: a prompt over the context raises ContextOverflowError (and the decoder stays usable);
    a prompt that leaves a few positions ends at the limit with finish == 'context'."""
    arch, tm, dm = arch_pair
    n_ctx = SIZES[0]
    tc, dc = _contexts(arch, tm, dm, n_ctx, _Buffers())
    try:
        dec = DFlashDecoder(tc, dc)
        too_long = long_prompt(tm, n_ctx + 1)
        with pytest.raises(ContextOverflowError, match=rf"{n_ctx + 1} tokens exceeds the context \({n_ctx}\)"):
            dec.generate(too_long, 8)
        # exactly full: one token fits, then the context is full
        st = GenerationStats()
        tail = list(dec.generate(too_long[:n_ctx], 8, stats=st, stop_tokens=[]))
        assert len(tail) == 1 and st.finish == "context"
        # a few positions left, with blocks that commit several tokens: drafting is clamped to the room
        # left (the same decoder: the cache of the run above is reused where the memory allows it)
        prompt = too_long[:n_ctx - 5]
        plain = list(dec.generate(prompt, 16, stop_tokens=[], use_draft=False))
        assert len(plain) == 6
        dec.proposer = OverrideProposer(oracle(prompt + plain))
        st = GenerationStats()
        assert list(dec.generate(prompt, 16, stats=st, stop_tokens=[])) == plain
        assert st.finish == "context" and st.accepted > 0
    finally:
        dc.close(), tc.close()


def test_api_rejects_a_prompt_over_the_context(models):
    """The llama_cpp.Llama drop-in: a prompt over n_ctx is a ValueError naming the sizes, not an abort."""
    from dflash_gguf import Llama

    pair = models.pair("qwen3", "dflash", 8)
    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), n_ctx=SIZES[0], n_batch=512,
                n_threads=1, n_threads_batch=1, verbose=False)
    try:
        toks = long_prompt(llm.decoder.target.model, SIZES[0] + 10)
        with pytest.raises(ValueError, match=str(SIZES[0])):
            llm.create_completion(toks, max_tokens=4, temperature=0)
        out = llm.create_completion(toks[:SIZES[0] - 100], max_tokens=4, temperature=0)
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["dflash"]["n_prompt"] == SIZES[0] - 100
    finally:
        llm.close()


@pytest.mark.parametrize("window", (1, 100, 1000))
def test_drafter_window_bounds_the_cache_and_stays_lossless(models, window):
    """draft_window=W: the drafter's context is W + block cells (padded by llama.cpp) whatever n_ctx,
    a 6000-token prompt injects only its last W positions, the cache slides as tokens are committed
    (never more than W + block cells) and the output is plain decoding's."""
    pair = models.pair("qwen3", "dflash", 8)
    with Model(pair.target) as tm, Model(pair.drafter) as dm:
        tc = Context(tm, ContextOptions(n_ctx=SIZES[0], n_batch=512, n_threads=1))
        dc = Context(dm, ContextOptions(n_ctx=SIZES[0], n_batch=512, n_threads=1, draft_window=window), other=tc)
        try:
            assert dc.n_ctx == pad256(window + BLOCK) and dc.window == window and dc.n_ubatch == BLOCK
            prompt = long_prompt(tm, 6000)
            plain = list(DFlashDecoder(tc, None).generate(prompt, 40, stop_tokens=[]))
            dec = DFlashDecoder(tc, dc)
            dec.proposer = OverrideProposer(oracle(prompt + plain))
            st = GenerationStats()
            assert list(dec.generate(prompt, 40, stats=st, stop_tokens=[])) == plain
            assert 0 < st.accepted < st.drafted
            dec.features.flush()   # rows of plain steps kept on the host: the next draft's first work
            n_done = len(dec.cache)
            assert dc.pos_max() == n_done - 1 and dc.pos_min() == n_done - window
            # the real drafter on the same windowed cache: still exact
            dec.proposer = DrafterProposer()
            assert list(dec.generate(prompt, 40, stop_tokens=[])) == plain
        finally:
            dc.close(), tc.close()


def test_drafter_context_smaller_than_the_prompt_is_a_clear_error(models):
    """Without a window (draft_window=0), a drafter context shorter than the target's fills first:
    ContextFullError naming the drafter injection (no abort), both caches are cleared, and a prompt
    that fits still decodes losslessly."""
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    tc = Context(tm, ContextOptions(n_ctx=SIZES[0], n_batch=512, n_threads=1))
    dc = Context(dm, ContextOptions(n_ctx=4096, n_batch=512, n_threads=1, draft_window=0), other=tc)
    try:
        dec = DFlashDecoder(tc, dc)
        prompt = long_prompt(tm, 6000)
        with pytest.raises(ContextFullError, match="into the drafter.*no KV slot"):
            list(dec.generate(prompt, 8))
        assert dec.cache == [] and tc.pos_max() == -1 and dc.pos_max() == -1
        short = prompt[:3000]
        assert list(dec.generate(short, 16, stop_tokens=[])) == \
            list(DFlashDecoder(tc, None).generate(short, 16, stop_tokens=[]))
    finally:
        dc.close(), tc.close(), dm.close(), tm.close()
