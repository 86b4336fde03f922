"""Prompt lookup (n-gram) drafting is lossless: copied blocks verified by the target give exactly plain
decoding's tokens (greedy) and the target's distribution (sampled), with no drafter at all (any target,
hybrids included), in a batch (every sequence as alone), and beside a DFlash drafter, whose cache stays
exactly what drafting alone would leave (decoding.ngram, decoding.decoder).

The tiny targets are random: their text seldom repeats, so copies are proposed by an oracle in place of
the lookup (the plain continuation, one token wrong in every third proposal: copies kept whole, in part
and refused); the lookup itself is pinned by tests/test_ngram_rules.py and, on the trained demo target,
by the copies it gets right."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, Request, SpecOptions
from dflash_gguf.decoding.ngram import NgramIndex, NgramOptions
from dflash_gguf.decoding.policy import DraftPolicy
from support import llama_cpp_greedy
from test_sampling import ALPHA, K_TOKENS, SP, chi2_pvalue, exact_distribution

TEXTS = [b"def main(argv):\n    parser = argparse.ArgumentParser(",
         b"    for key, value in sorted(items):\n        if",
         b"class Config:\n    def __init__(self, path):\n        self.path = path\n        self."]
N_CTX = 512
NGRAM = NgramOptions(max_ngram=2, n_pred=6)


def opts(n_seq=1, n_rs_seq=0, n_batch=64) -> ContextOptions:
    return ContextOptions(n_ctx=N_CTX, n_batch=n_batch, n_ubatch=n_batch, n_seq=n_seq, n_rs_seq=n_rs_seq, n_threads=1)


def run(dec, prompt, n, **kw):
    st = GenerationStats()
    return list(dec.generate(prompt, n, stats=st, **kw)), st


def prompts_and_fulls(tm, plain, n=60) -> tuple[list[list[int]], list[list[int]]]:
    """Each text's tokens, and those followed by their plain continuation (what the oracle copies from)."""
    ps = [tm.tokenize(t) for t in TEXTS]
    return ps, [p + run(plain, p, n, stop_tokens=[])[0] for p in ps]


@pytest.fixture
def oracle(monkeypatch):
    """``oracle(fulls)``: the lookup proposes the plain continuation of whichever of ``fulls`` the context
    is on, one token wrong in every third proposal (``miss``: and no match at every ``miss``-th); off them
    (a sampled text), what the lookup finds."""
    lookup = NgramIndex.propose

    def install(fulls, miss=None):
        calls = [0]

        def propose(self, n):
            toks = self.tokens
            for full in fulls:
                if len(full) > len(toks) and full[:len(toks)] == toks:
                    calls[0] += 1
                    if miss and calls[0] % miss == 0:
                        return []
                    out = full[len(toks):len(toks) + n]
                    if calls[0] % 3 == 0:
                        j = calls[0] % len(out)
                        out[j] = (out[j] + 1) % 256
                    return out
            return lookup(self, n)
        monkeypatch.setattr(NgramIndex, "propose", propose)
    return install


def copied_both_ways(st: GenerationStats) -> bool:
    """Copies were verified, some tokens kept and some refused."""
    return st.copy_steps > 0 and 0 < st.copy_accepted < st.copied


@pytest.fixture(scope="module")
def qwen3(models):
    tm = Model(models.target("qwen3")[1])
    pc, tc = Context(tm, opts()), Context(tm, opts())
    plain, dec = DFlashDecoder(pc, None), DFlashDecoder(tc, None, SpecOptions(ngram=NGRAM))
    yield tm, plain, dec
    for c in (pc, tc):
        c.close()
    tm.close()


# ---------------------------------------------------------------------------- no drafter
@pytest.mark.parametrize("arch,n_rs_seq,rollback", [("qwen3", 0, "seq_rm"), ("llama", 0, "seq_rm"),
                                                    ("qwen35", 0, "checkpoint"), ("qwen35", 6, "snapshot")])
def test_copies_with_no_drafter_equal_plain_decoding(models, oracle, arch, n_rs_seq, rollback):
    """Any target llama.cpp decodes plainly: no drafter, no taps, only the target's verify of copied blocks
    (a hybrid's recurrent state rolled back by host checkpoints or by snapshots)."""
    tm = Model(models.target(arch)[1])
    pc, tc = Context(tm, opts()), Context(tm, opts(n_rs_seq=n_rs_seq))
    try:
        plain, dec = DFlashDecoder(pc, None), DFlashDecoder(tc, None, SpecOptions(ngram=NGRAM))
        assert (dec.n_draft, dec.n_copy, dec.rollback) == (0, 6, rollback)
        total = GenerationStats()
        ps, fulls = prompts_and_fulls(tm, plain)
        oracle(fulls)
        for prompt in ps:
            ref, _ = run(plain, prompt, 40, stop_tokens=[])
            out, st = run(dec, prompt, 40, stop_tokens=[])
            assert out == ref
            assert dec.cache == prompt + out[:-1] and tc.pos_max() == len(prompt) + 38
            total.merge(st)
        assert copied_both_ways(total), total.as_dict()
        assert total.passes < total.n_generated            # copies gave several tokens a target pass
    finally:
        for c in (pc, tc):
            c.close()
        tm.close()


def test_max_tokens_stop_tokens_and_an_early_consumer_mid_copy(qwen3, oracle):
    tm, plain, dec = qwen3
    ps, fulls = prompts_and_fulls(tm, plain)
    oracle(fulls)
    prompt = ps[0]
    ref, _ = run(plain, prompt, 40, stop_tokens=[])
    for n in (1, 2, 3, 5, 9, 17):
        out, st = run(dec, prompt, n, stop_tokens=[])
        assert out == ref[:n] and st.finish == "length"
        assert dec.cache == prompt + out[:-1] and dec.target.pos_max() == len(prompt) + n - 2
    for idx in (0, 2, 5, 11):
        stop = ref[idx]
        out, st = run(dec, prompt, 40, stop_tokens=[stop])
        assert out == ref[:ref.index(stop) + 1] and st.finish == "stop"
        assert dec.cache == prompt + out[:-1]
    for keep in (1, 3, 8):          # a stop string: the consumer leaves mid-block
        gen = dec.generate(prompt, 40, stop_tokens=[])
        got = [next(gen) for _ in range(keep)]
        gen.close()
        assert got == ref[:keep] and dec.cache == prompt + got[:-1]
        assert dec.target.pos_max() == len(prompt) + keep - 2
        assert run(dec, prompt + got, 10, stop_tokens=[])[0] == ref[keep:keep + 10]


def test_without_the_speed_gate_copies_whole_matches_and_with_it_stays_exact(qwen3, oracle):
    """adaptive=False copies every match whole (as llama-cpp-python's LlamaPromptLookupDecoding); the
    speed gate copies what its measured costs and the copies' acceptance say pays - same tokens."""
    tm, plain, dec = qwen3
    gated = DFlashDecoder(Context(tm, opts()), None, SpecOptions(ngram=NGRAM, adaptive=True))
    try:
        ps, fulls = prompts_and_fulls(tm, plain)
        oracle(fulls)
        for prompt in ps:
            ref, _ = run(plain, prompt, 40, stop_tokens=[])
            out, st = run(dec, prompt, 40, stop_tokens=[])
            # every step copies (plain: the first, which decodes the prompt's tail, and one with a token
            # left), each the whole match of 6 tokens but the last two (max_tokens cuts them)
            assert out == ref and st.copy_steps == st.steps >= st.passes - 2 and st.copied == st.drafted
            assert st.drafted_per_pos[5] >= st.copy_steps - 2
            assert run(gated, prompt, 40, stop_tokens=[])[0] == ref
        # a prompt that never repeats: nothing to copy, plain steps only
        out, st = run(dec, [1, 2, 3], 1, stop_tokens=[])
        assert st.copy_steps == 0 and st.passes == 1
    finally:
        gated.target.close()


def test_a_seeded_sampled_request_gives_the_same_text_however_much_is_copied(qwen3, oracle, monkeypatch):
    """Its tokens are its positions' own draws, whatever is copied: with the gate at costs where copying
    never pays (a short probe now and then) and without it (whole matches), the same text for the same
    seed."""
    from dflash_gguf.decoding.ngram import StepCosts

    tm, plain, dec = qwen3
    ps, fulls = prompts_and_fulls(tm, plain)
    monkeypatch.setattr(StepCosts, "record", lambda self, rows, seconds: None)
    gated = DFlashDecoder(Context(tm, opts()), None, SpecOptions(ngram=NGRAM, adaptive=True))
    gated.policy.copy_costs.cost = {1: 1.0, 7: 50.0}
    try:
        for seed in range(3):
            sp = SamplingParams(**{**SP.__dict__, "seed": seed})
            texts, stats = [], []
            for d in (gated, dec):
                oracle(fulls)             # the same proposals for both (the oracle counts its calls)
                out, st = run(d, ps[0], 30, sampling=sp, stop_tokens=[])
                texts.append(out)
                stats.append(st.copied)
            assert texts[0] == texts[1] and stats[1] > stats[0]
        # greedy, the gate at these costs copies only a short probe now and then
        assert run(gated, ps[0], 30, stop_tokens=[])[1].copied <= 2 * (30 // DraftPolicy.COPY_PROBE)
    finally:
        gated.target.close()


def test_the_speed_gate_stops_verifying_copies_that_are_never_right(qwen3, oracle, monkeypatch):
    """At fixed step costs (a row adds a tenth of a plain step), copies the target keeps refusing stop being
    verified after a few, but for a short copy every few declined matches (is the text copying again?)."""
    from dflash_gguf.decoding.ngram import StepCosts

    tm, plain, _ = qwen3
    ps, fulls = prompts_and_fulls(tm, plain)
    oracle([f[:len(p)] + [(t + 1) % 256 for t in f[len(p):]] for p, f in zip(ps, fulls)])   # every token wrong
    monkeypatch.setattr(StepCosts, "record", lambda self, rows, seconds: None)
    gated = DFlashDecoder(Context(tm, opts()), None, SpecOptions(ngram=NGRAM, adaptive=True))
    gated.policy.copy_costs.cost = {1: 1.0, 7: 1.6}
    try:
        ref, _ = run(plain, ps[0], 60, stop_tokens=[])
        out, st = run(gated, ps[0], 60, stop_tokens=[])
        assert out == ref and st.copy_accepted == 0
        assert 0 < st.copy_steps <= 3 + 60 // DraftPolicy.COPY_PROBE and st.copied < 3 * 6 + 60 // 4
    finally:
        gated.target.close()


def test_sampled_copies_keep_the_target_distribution(qwen3, oracle):
    """A copy is a point-mass proposal: kept with probability p(token), else the residual is drawn."""
    tm, plain, dec = qwen3
    ps, fulls = prompts_and_fulls(tm, plain, 4)
    oracle(fulls)                         # copies propose the greedy tokens while the sample follows them
    prompt = ps[0]
    exact = exact_distribution(plain.target, prompt, SP)
    plain.reset()
    counts, st = Counter(), GenerationStats()
    for seed in range(1500):
        sp = SamplingParams(**{**SP.__dict__, "seed": seed})
        counts[tuple(dec.generate(prompt, K_TOKENS, sampling=sp, stats=st, stop_tokens=[]))] += 1
    assert copied_both_ways(st), st.as_dict()
    p = chi2_pvalue(counts, exact)
    assert p > ALPHA, f"copied samples do not follow the target distribution (p={p:.2e}): {counts} vs {exact}"


def test_sampled_copies_beside_a_lattice_drafter_keep_the_target_distribution(models, oracle):
    """Beside a DFlash2 drafter drawing its blocks from its lattice (q: the lattice's distribution), a
    copied block is a point-mass proposal: either way the target's distribution."""
    pair = models.pair("qwen3", "dflash2", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    o = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    pc, tc = Context(tm, o), Context(tm, o)
    dc = Context(dm, o, other=tc)
    try:
        plain = DFlashDecoder(pc, None)
        dec = DFlashDecoder(tc, dc, SpecOptions(ngram=NGRAM))
        assert dec.lattice is not None
        ps, fulls = prompts_and_fulls(tm, plain, 4)
        oracle(fulls, miss=2)             # every other step the drafter's lattice proposes
        prompt = ps[0]
        exact = exact_distribution(pc, prompt, SP)
        counts, st = Counter(), GenerationStats()
        for seed in range(1500):   # (seeded streams, not repeatable requests: those draft point masses)
            sp = SamplingParams(**{**SP.__dict__, "seed": seed, "repeatable": False})
            counts[tuple(dec.generate(prompt, K_TOKENS, sampling=sp, stats=st, stop_tokens=[]))] += 1
        assert copied_both_ways(st) and st.steps > st.copy_steps, st.as_dict()
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"samples do not follow the target distribution (p={p:.2e}): {counts} vs {exact}"
    finally:
        for c in (dc, pc, tc):
            c.close()
        dm.close()
        tm.close()


@pytest.mark.parametrize("arch,n_rs_seq", [("qwen3", 0), ("qwen35", 0), ("qwen35", 6)])
def test_every_sequence_of_a_batch_equals_itself_alone(models, oracle, arch, n_rs_seq):
    """Copied blocks of several sequences in one verify (a hybrid's padded to the longest), beside plain
    ones, mid-block max_tokens and stop tokens, a request joining a freed slot."""
    tm = Model(models.target(arch)[1])
    pc, tc = Context(tm, opts()), Context(tm, opts(n_seq=3, n_rs_seq=n_rs_seq))
    try:
        plain = DFlashDecoder(pc, None)
        dec = DFlashDecoder(tc, None, SpecOptions(ngram=NGRAM))
        ps, fulls = prompts_and_fulls(tm, plain)
        oracle(fulls)
        long = [f[len(p):] for p, f in zip(ps, fulls)]
        reqs = [Request(ps[0], 37, stop_tokens=[]),
                Request(ps[1], 40, stop_tokens=[long[1][13]]),
                Request(ps[2], 5, stop_tokens=[]),
                Request(ps[1], 30, stop_tokens=[], use_draft=False),     # plain, beside copying ones
                Request(ps[2], 1, stop_tokens=[]),
                Request(ps[0] + long[0][:9], 23, stop_tokens=[])]
        refs = [run(plain, r.prompt, r.max_tokens, stop_tokens=r.stop_tokens)[0] for r in reqs]
        for r in reqs:
            r.stats = GenerationStats()
        assert dec.generate_batch(reqs) == refs
        total = GenerationStats()
        for r in reqs:
            total.merge(r.stats)
        assert copied_both_ways(total), total.as_dict()
        assert reqs[3].stats.copy_steps == 0
    finally:
        for c in (pc, tc):
            c.close()
        tm.close()


# ---------------------------------------------------------------------------- beside a drafter
def _propose(dec, pos, pending, n):
    out = np.zeros((1, n), dtype=np.int32)
    got = dec.proposer.propose(dec.drafter, np.array([0], dtype=np.int32), np.array([pos], dtype=np.int32),
                               np.array([pending], dtype=np.int32), n, out, lambda i: [])
    return out[0, :got].tolist()


@pytest.mark.parametrize("kind,adaptive", [("dflash", False), ("dflash", True), ("dspark", False)],
                         ids=["fixed", "gated", "dspark"])
def test_beside_a_drafter_copies_and_drafted_blocks_stay_exact_and_the_drafter_sees_every_token(models, oracle,
                                                                                                 kind, adaptive):
    """Per step a copy or the drafter's block (whichever is expected to give more); a copied step runs no
    draft, and its rows' features reach the drafter as a plain step's do (kept on the host, injected
    before the next draft): after a run of both, the drafter's cache gives the proposal it gives after
    the same tokens as a prompt."""
    pair = models.pair("qwen3", kind, 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    o = replace(opts(), n_threads=None)
    pc, tc, rc = Context(tm, o), Context(tm, o), Context(tm, o)
    dc, rdc = Context(dm, o, other=tc), Context(dm, o, other=rc)
    try:
        plain = DFlashDecoder(pc, None)
        dec = DFlashDecoder(tc, dc, SpecOptions(ngram=NgramOptions(n_pred=10), adaptive=adaptive))
        ref_dec = DFlashDecoder(rc, rdc, SpecOptions())
        assert dec.n_copy == dec.n_draft == (7 if kind == "dflash" else 8)   # (anchor-first DSpark: its block)
        total = GenerationStats()
        ps, fulls = prompts_and_fulls(tm, plain)
        oracle(fulls, miss=4)          # where a match is missing the drafter proposes
        for prompt in ps:
            ref, _ = run(plain, prompt, 40, stop_tokens=[])
            for n in (40, 13):
                out, st = run(dec, prompt, n, stop_tokens=[])
                assert out == ref[:n]
                total.merge(st)
                feed = dec.features
                covered = dc.pos_max() + 1 + feed.n
                assert covered == len(prompt) + n - 1 and (not feed.n or feed.start == dc.pos_max() + 1)
            ctx = prompt + out
            feed.flush()
            run(ref_dec, ctx, 1, stop_tokens=[])
            ref_dec.keep_prefix(len(ctx) - 1)
            ref_dec.features.flush()          # (its 1-token run drafted nothing: the rows are on the host)
            n_d = dec.n_draft
            assert _propose(dec, len(ctx) - 1, ctx[-1], n_d) == _propose(ref_dec, len(ctx) - 1, ctx[-1], n_d)
        assert total.copy_steps > 0 and total.copy_accepted > 0
        if not adaptive:
            assert total.steps > total.copy_steps   # the drafter's own blocks too
    finally:
        for c in (dc, rdc, pc, tc, rc):
            c.close()
        dm.close()
        tm.close()


# ---------------------------------------------------------------------------- front doors
def _oracle_on(llm, oracle, prompts, n=60):
    """The oracle copying each prompt's plain continuation, as a plain llama_cpp.Llama gives it."""
    fulls = []
    for p in prompts:
        ids = llm.tokenize(p.encode())
        fulls.append(ids + llama_cpp_greedy(llm.model_path, ids, n))
    oracle(fulls)


def test_llama_prompt_lookup_and_llama_cpps_draft_model_are_served_by_the_engine(models, oracle):
    """``Llama(prompt_lookup=True)`` with no drafter, and llama_cpp's own
    ``draft_model=LlamaPromptLookupDecoding(...)`` (its settings taken), give llama_cpp's completions with
    stop strings and max_tokens mid-copy, and report the copies in the response's dflash object."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from dflash_gguf import Llama
    from support import KW

    target = str(models.target("qwen3")[1])
    ref = llama_cpp.Llama(target, **{**KW, "flash_attn": True})
    prompts = ["def main(", "import os\n"]
    for llm in (Llama(target, prompt_lookup=True, prompt_lookup_num_pred_tokens=6, draft_adaptive=False, **KW),
                Llama(target, draft_model=LlamaPromptLookupDecoding(max_ngram_size=3, num_pred_tokens=5),
                      draft_adaptive=False, **KW)):
        try:
            d = llm.decoder
            assert d is not None and d.drafter is None and d.opts.ngram.max_ngram in (2, 3)
            assert llm.dflash_info["kind"] == "ngram" and llm.dflash_info["n_draft"] in (5, 6)
            _oracle_on(llm, oracle, prompts)
            copied = 0
            for p in prompts:
                want = ref(p, max_tokens=30, temperature=0)["choices"][0]["text"]
                got = llm(p, max_tokens=30, temperature=0)
                assert got["choices"][0]["text"] == want
                assert got["dflash"]["enabled"] is True
                copied += got["dflash"]["copy_accepted"]
                for cut in (3, 11):
                    assert llm(p, max_tokens=cut, temperature=0)["choices"][0]["text"] == \
                        ref(p, max_tokens=cut, temperature=0)["choices"][0]["text"]
                stop = want[7:10]
                if stop.strip():
                    assert llm(p, max_tokens=30, temperature=0, stop=[stop])["choices"][0]["text"] == \
                        ref(p, max_tokens=30, temperature=0, stop=[stop])["choices"][0]["text"]
            assert copied > 0
        finally:
            llm.close()
    ref.close()


def test_llama_prompt_lookup_on_a_hybrid_target(models, oracle):
    """A hybrid target with no drafter (llama_cpp's context: no recurrent snapshots, host checkpoints)."""
    import llama_cpp

    from dflash_gguf import Llama
    from support import KW

    target = str(models.target("qwen35")[1])
    ref = llama_cpp.Llama(target, **{**KW, "flash_attn": True})
    llm = Llama(target, prompt_lookup=True, prompt_lookup_num_pred_tokens=6, draft_adaptive=False,
                **{**KW, "flash_attn": True})
    try:
        assert llm.decoder.rollback == "checkpoint"
        _oracle_on(llm, oracle, ["def main(", "import os\n"])
        kept = 0
        for p in ("def main(", "import os\n"):
            got = llm(p, max_tokens=24, temperature=0)
            assert got["choices"][0]["text"] == ref(p, max_tokens=24, temperature=0)["choices"][0]["text"]
            kept += got["dflash"]["copy_accepted"]
        assert kept > 0
    finally:
        llm.close()
        ref.close()


def test_batch_llama_with_prompt_lookup_gives_each_prompt_what_it_gives_alone(models, oracle):
    from dflash_gguf.batch import BatchLlama

    target = models.target("qwen3")[1]
    with BatchLlama(target, n_parallel=2, n_ctx=256, n_batch=64, n_threads=1, prompt_lookup=True,
                    prompt_lookup_num_pred_tokens=6, draft_adaptive=False) as b:
        assert b.decoder.n_copy == 6
        ps = [b.model.tokenize(t) for t in TEXTS]
        fulls = [p + llama_cpp_greedy(target, p, 40) for p in ps]
        oracle(fulls)
        got = b.generate(ps, max_tokens=30)
        assert [c.tokens for c in got] == [f[len(p):len(p) + 30] for p, f in zip(ps, fulls)]
        assert sum(c.stats.copy_accepted for c in got) > 0


def test_the_command_line_takes_llama_servers_ngram_flags():
    import argparse

    from dflash_gguf.options import add_model_args, spec_kwargs

    ap = argparse.ArgumentParser()
    add_model_args(ap)
    args = ap.parse_args(["-m", "t.gguf", "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                          "--spec-ngram-simple-size-m", "8"])
    assert spec_kwargs(args) == dict(prompt_lookup=True, prompt_lookup_max_ngram_size=3,
                                     prompt_lookup_num_pred_tokens=8)
    assert spec_kwargs(ap.parse_args(["-m", "t.gguf"])) == {}
    with pytest.raises(SystemExit):
        spec_kwargs(ap.parse_args(["-m", "t.gguf", "--spec-type", "ngram-mod"]))


@pytest.mark.parametrize("parallel", [None, 2], ids=["one-at-a-time", "slots"])
def test_the_server_copies_on_the_trained_target_and_answers_as_llama_cpp(parallel):
    """The demo target (a small trained code model) with prompt lookup and no drafter, served one request at
    a time (the Llama) and in --parallel slots: input-grounded prompts (an edit of a given function, a
    class restated) get copies right, and every answer is llama_cpp's alone, stop strings included."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import llama_cpp

    from dflash_gguf import Llama
    from dflash_gguf.bench.ngram import PROMPTS
    from dflash_gguf.demo import DEMO_DIR
    from dflash_gguf.server import create_app
    from support import serve

    kw = dict(n_ctx=512, n_threads=2, seed=0, verbose=False, chat_format="chatml")
    plain = llama_cpp.Llama(str(DEMO_DIR / "target.gguf"), **kw)
    llm = Llama(str(DEMO_DIR / "target.gguf"), prompt_lookup=True, draft_adaptive=False, **kw)
    app = create_app(llm, "demo", parallel=parallel)
    try:
        with serve(app) as url:
            def complete(p, **extra):
                r = httpx.post(f"{url}/v1/completions", json={"prompt": p, "temperature": 0, "max_tokens": 48, **extra},
                               timeout=120)
                assert r.status_code == 200, r.text
                return r.json()
            want = [plain.create_completion(p, max_tokens=48, temperature=0)["choices"][0] for p in PROMPTS]
            with ThreadPoolExecutor(3) as pool:
                got = list(pool.map(complete, PROMPTS))
            for w, g in zip(want, got):
                assert (g["choices"][0]["text"], g["choices"][0]["finish_reason"]) == (w["text"], w["finish_reason"])
                assert g["dflash"]["enabled"] is True
            assert sum(g["dflash"]["copy_accepted"] for g in got) > 10
            stop = want[0]["text"][20:23]
            ref = plain.create_completion(PROMPTS[0], max_tokens=48, temperature=0, stop=[stop])["choices"][0]
            assert complete(PROMPTS[0], stop=[stop])["choices"][0]["text"] == ref["text"]
    finally:
        if parallel:
            app.state.server.slots.close()
        llm.close()
        plain.close()


def test_the_prompt_lookup_benchmark_checks_every_column_against_plain_decoding(tmp_path):
    """``python -m dflash_gguf.bench.ngram``: ours (prompt lookup alone, with the drafter, gated or not),
    llama-cpp-python's ``LlamaPromptLookupDecoding`` and, where the reference tools are built, upstream's
    n-gram modes all give plain decoding's text; the prompt lookup needs fewer target passes than plain
    decoding on these input-grounded prompts, and so does upstream's ngram-simple."""
    import json
    import subprocess
    import sys

    from dflash_gguf import paths

    out = tmp_path / "rows.json"
    p = subprocess.run([sys.executable, "-m", "dflash_gguf.bench.ngram", "-n", "24", "-t", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert {"plain", "ngram", "dflash+ngram+gate", "llama_cpp", "llama_cpp+lookup"} <= set(rows)
    assert rows["ngram"]["passes"] < rows["plain"]["passes"] == rows["llama_cpp"]["passes"]
    tools = paths.tools_dir()
    if tools is not None and (tools / "llama-speculative-simple").exists():
        assert all(rows[m]["same"] for m in ("upstream ngram-simple", "upstream ngram-map-k", "upstream ngram-mod"))
        assert rows["upstream ngram-simple"]["passes"] < rows["plain"]["passes"]


def test_the_lookup_table_says_what_prompt_lookup_proposes_along_a_text():
    """bench.ngram's ``copy_table``: after every prefix of the text, the plain scan's match length and how
    many of its tokens the text goes on with."""
    from dflash_gguf.bench.ngram import copy_table
    from dflash_gguf.decoding.ngram import find_candidate

    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(0, 6, 40)]
    text = [int(t) for t in rng.integers(0, 6, 30)]
    for k, (m, a) in enumerate(copy_table(prompt, text, 2, 5)):
        match = find_candidate(prompt + text[:k], 2, 5)
        assert m == len(match)
        assert match[:a] == text[k:k + a] and (a == len(match) or k + a == len(text) or match[a] != text[k + a])


def test_replayed_lookups_copy_as_recorded_and_stay_exact(qwen3):
    """A decoder whose copies come from bench.ngram's ``CopyBook``: matches as long as the table says, right
    for as many tokens as it says (or none), and the text is still plain decoding's."""
    from dflash_gguf.bench.ngram import CopyBook

    tm, plain, _ = qwen3
    prompt = tm.tokenize(TEXTS[2])
    ref = prompt + run(plain, prompt, 40, stop_tokens=[])[0]
    dec = DFlashDecoder(plain.target, None, SpecOptions(ngram=NGRAM))
    table = [(4, 2)] * 20 + [(0, 0)] * 20       # no match near the end, where max_tokens would shorten one
    for wrong in (False, True):
        dec.copy_index = CopyBook([ref], [len(prompt)], [table], tm.n_vocab, never_right=wrong)
        dec.reset()
        got, st = run(dec, prompt, 30, stop_tokens=[])
        assert got == ref[len(prompt):len(prompt) + 30]
        assert st.copy_steps > 0 and st.copied == 4 * st.copy_steps
        assert st.copy_accepted == (0 if wrong else 2 * st.copy_steps)
