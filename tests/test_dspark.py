"""DSpark drafters run losslessly wherever DFlash drafters run.

A DSpark drafter is DFlash's block drafter plus a low-rank Markov head, which adds to each block row's
logits a bias ``markov_w2 @ markov_w1[prev]`` that depends on the token drafted before it (the
anchor for the first row), and optionally a confidence head, ``sigmoid(conf_proj @ [h; markov_w1[prev]])``:
the drafter's own estimate that the target accepts the row's token. Its layouts: anchor-first (DeepSpec's
``sample_from_anchor``: block ``[pending, mask x (n - 1)]``, row i drafts token i + 1, so a block
drafts up to ``block_size`` tokens) and DFlash's 1+N block (row 0 a bonus slot).

The drafter's proposals are checked against an independent numpy reference of the whole chain; every
entry point is checked token for token against plain decoding of the same target (greedy) or the
target's exact distribution (sampled).
"""
from __future__ import annotations

import contextlib
from collections import Counter

import llama_cpp
import numpy as np
import pytest

from dflash_gguf.native import _bindings as B
from dflash_gguf.native.engine import Context, ContextOptions, DrafterInfo, Model
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, Request, SpecOptions
from dflash_gguf.decoding.proposer import DrafterProposer as DFlashProposer
from support import KW, llama_cpp_greedy, serve
from test_sampling import ALPHA, K_TOKENS, SP, chi2_pvalue, exact_distribution
from test_spec import Rig

PROMPTS = [b"def main(argv):\n    parser = argparse.ArgumentParser(",
           b"    for key, value in sorted(items):\n        if"]
# the forms published drafters take: DeepSpec's anchor-first drafters with a confidence head, the
# speculators' 1+N exports, and a vanilla Markov head without a confidence head
LAYOUTS = {"anchor": {}, "bonus": {"anchor": False}, "no-conf": {"confidence": False}}


def dspark(models, arch="qwen3", block=8, layout="anchor"):
    return models.pair(arch, "dspark", block, **LAYOUTS[layout])


# ---------------------------------------------------------------- the drafter against a reference
def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _reference_rows(pair, taps: np.ndarray, layers: list[int], anchor: int, n: int, sample_from_anchor: bool):
    """The numpy reference (tests/reference_dflash.py, F16 KV cache modelled): the block's normed hidden
    rows and logits before the Markov bias, the drafting rows' indices and the reference's weights."""
    from reference_dflash import DFlashReference, TargetHF, rms_norm

    ref = DFlashReference(pair.drafter_hf, kv_dtype=np.float16)
    tgt = TargetHF(pair.target_hf)
    hs = [None] * (max(layers) + 1)
    for j, li in enumerate(layers):
        hs[li] = taps[:, j].astype(np.float64)
    ctx = ref.context(hs)
    block = [anchor] + [ref.mask] * (n - 1 if sample_from_anchor else n)
    P = len(ctx)
    pos = np.arange(P + len(block))
    h = tgt.embed[np.asarray(block)]
    for i in range(ref.cfg["num_hidden_layers"]):
        h = ref._layer(i, h, ctx, pos)
    hn = rms_norm(h, ref.w["norm.weight"], ref.eps)
    rows = range(0, n) if sample_from_anchor else range(1, n + 1)
    return hn, hn @ tgt.lm_head.T, rows, ref.w


def _reference_chain(pair, taps: np.ndarray, layers: list[int], anchor: int, n: int, sample_from_anchor: bool):
    """The reference with DeepSpec's Markov and confidence heads on top: drafted ids, confidences and the
    base rows' own argmax."""
    hn, base, rows, w = _reference_rows(pair, taps, layers, anchor, n, sample_from_anchor)
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    conf_w = w.get("confidence_head.proj.weight")
    ids, conf, prev = [], [], anchor
    for r in rows:
        logits = base[r] + w2 @ w1[prev]
        if conf_w is not None:
            conf.append(float(_sigmoid(conf_w @ np.concatenate([hn[r], w1[prev]]))[0]))
        prev = int(np.argmax(logits))
        ids.append(prev)
    return ids, conf, base[list(rows)].argmax(-1).tolist()


def _llama_draft(pair, tokens: list[int], n: int, then=None):
    """Prefill the target, inject its taps into the drafter, draft one block after ``tokens``; ``then(dc)``
    (if given) runs on the drafter's context after the block, which is drafted by logits rows for it."""
    with Model(pair.target) as tm, Model(pair.drafter) as dm:
        opts = ContextOptions(n_ctx=128, n_threads=1, flash_attn=False)
        with Context(tm, opts) as tc, Context(dm, opts, other=tc) as dc:
            info = B.ffi.new("struct llama_dflash_drafter_info *")
            B.check(B.lib.llama_dflash_prepare(tc.cptr, dc.cptr, info), "prepare")
            layers = list(info.target_layers[0:info.n_target_layers])
            P = len(tokens) - 1
            tc.decode(np.asarray(tokens[:P], np.int32), 0, out_row0=P)
            taps = np.zeros((P, len(layers) * tm.n_embd), np.float32)
            B.check(B.lib.llama_dflash_get_taps(tc.cptr, B.ffi.from_buffer("int32_t[]", np.asarray(layers, np.int32)),
                                                len(layers), 0, P, B.ffi.from_buffer("float[]", taps), taps.size), "taps")
            B.check(B.lib.llama_dflash_inject(dc.cptr, tc.cptr, 0, 0, 0, P), "inject")
            ids = np.zeros(n, np.int32)
            conf = np.full(n, -1.0, np.float32)
            if then is not None:
                B.check(B.lib.llama_dflash_set_draft_ids(dc.cptr, False), "drafting by logits")
            i32 = "int32_t[]"
            args = (dc.cptr, 1, B.ffi.from_buffer(i32, np.zeros(1, np.int32)), B.ffi.from_buffer(i32, np.array([P], np.int32)),
                    B.ffi.from_buffer(i32, np.array([tokens[P]], np.int32)), n, B.ffi.from_buffer("llama_token[]", ids))
            if info.has_confidence:
                got = B.check(B.lib.llama_dflash_draft_seqs_conf(*args, B.ffi.from_buffer("float[]", conf)), "draft")
            else:
                with pytest.raises(Exception, match="unsupported"):   # no head: refused before any decode
                    B.check(B.lib.llama_dflash_draft_seqs_conf(*args, B.ffi.from_buffer("float[]", conf)), "draft")
                got = B.check(B.lib.llama_dflash_draft_seqs(*args), "draft")
            assert got == n
            assert dc.pos_max(0) == P - 1, "the noise block left the drafter's cache"
            if then is not None:
                then(dc, ids.copy())
            return DrafterInfo.from_c(info), layers, taps.reshape(P, len(layers), -1), ids.tolist(), conf.tolist()


@pytest.mark.parametrize("layout", ["anchor", "bonus", "no-conf"])
def test_drafts_follow_the_markov_chain_of_an_independent_reference(models, layout):
    pair = dspark(models, layout=layout)
    tokens = [1] + np.random.default_rng(3).integers(4, 500, 14).tolist()
    info, layers, taps, ids, conf = _llama_draft(pair, tokens, 6)
    assert info.kind == "dspark"
    assert info.sample_from_anchor == (layout != "bonus") and info.has_confidence == (layout != "no-conf")
    assert info.draft_max == (8 if info.sample_from_anchor else 7)
    want, want_conf, unbiased = _reference_chain(pair, taps, layers, tokens[-1], 6, info.sample_from_anchor)
    assert ids == want
    assert ids != unbiased, "the Markov bias should change some drafted token here (else this test shows nothing)"
    if info.has_confidence:
        np.testing.assert_allclose(conf, want_conf, atol=2e-3)
        assert all(0.0 < c < 1.0 for c in conf)


class _SecondBest:
    """A random generator whose draws pick, of each distribution, its second most likely outcome: every
    drawn token leaves the head's argmax chain."""
    def choice(self, k, p):
        return int(np.argsort(p)[-2])


@pytest.mark.parametrize("layout", ["anchor", "bonus"])
def test_sampled_proposals_follow_the_markov_head_given_the_drawn_tokens(models, layout):
    """At temperature > 0 a DSpark block is drawn through the Markov chain: row i's proposal q is the
    softmax of the block row's logits plus the bias of the token actually drawn for row i - 1 (not the
    argmax chain's), at the request's temperature, over the row's best candidates as the graph's chain
    ranked them. Checked against the
    independent reference along a chain that leaves the argmax at every row."""
    from dflash_gguf.decoding.proposer import MarkovProposer

    pair = dspark(models, layout=layout)
    tokens = [1] + np.random.default_rng(5).integers(4, 500, 14).tolist()
    n, temp, got = 5, 0.7, {}

    def sample(dc, chain):
        prop = MarkovProposer(pair.drafter, dc.model.n_vocab)
        out = np.zeros(n, np.int32)
        first = 0 if DrafterInfo.read(dc.model).sample_from_anchor else 1
        got["n"], got["qs"] = prop.propose(dc, first, chain, tokens[-1], n, out, _SecondBest(), temp)
        got["out"], got["chain"] = out.tolist(), chain.tolist()
    info, layers, taps, ids, _ = _llama_draft(pair, tokens, n, then=sample)
    assert got["n"] == n and got["out"] != got["chain"] and got["chain"] == ids
    hn, base, rows, w = _reference_rows(pair, taps, layers, tokens[-1], n, info.sample_from_anchor)
    w1, w2 = w["markov_head.markov_w1.weight"], w["markov_head.markov_w2.weight"]
    prev, graph_prev = tokens[-1], tokens[-1]
    for r, tok, chained, (q_ids, q) in zip(rows, got["out"], got["chain"], got["qs"]):
        logits = base[r] + w2 @ w1[prev]
        want = np.exp((logits[q_ids] - logits[q_ids].max()) / temp)
        np.testing.assert_allclose(q, want / want.sum(), atol=2e-3)
        # the candidates: the block row's best as the graph biased it (its own chain's previous token)
        # (up to near-ties at the edge: the graph's rows are not the reference's to the last bit)
        rank = np.argsort(base[r] + w2 @ w1[graph_prev])[::-1].tolist()
        k = MarkovProposer.CANDIDATES
        assert set(rank[:k - 4]) <= set(q_ids.tolist()) <= set(rank[:k + 4])
        prev, graph_prev = tok, chained


# ---------------------------------------------------------------- lossless, one sequence
def _equals_plain(rig, n: int) -> None:
    """Every prompt gives plain decoding's tokens, with blocks drafted."""
    for text in PROMPTS:
        prompt = rig.tm.tokenize(text)
        ref, _ = rig.run(rig.plain, prompt, n, stop_tokens=[])
        out, st = rig.run(rig.dec, prompt, n, stop_tokens=[])
        assert out == ref and st.drafted > 0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("layout,block", [("anchor", 8), ("bonus", 8), ("no-conf", 8), ("anchor", 4)])
def test_greedy_equals_plain(models, arch, layout, block):
    rig = Rig(dspark(models, arch, block, layout))
    try:
        assert rig.dec.info.kind == "dspark"
        assert rig.dec.n_draft == (block if layout != "bonus" else block - 1)   # anchor-first: a whole block
        for text in PROMPTS:
            prompt = rig.tm.tokenize(text)
            ref, _ = rig.run(rig.plain, prompt, 48, stop_tokens=[])
            out, st = rig.run(rig.dec, prompt, 48, stop_tokens=[])
            assert out == ref
            assert st.steps > 0 and st.drafted >= st.accepted and st.n_generated == 48
            # mid-block ends: max_tokens and a stop token
            out, _ = rig.run(rig.dec, prompt, 13, stop_tokens=[])
            assert out == ref[:13]
            out, _ = rig.run(rig.dec, prompt, 48, stop_tokens=[ref[10]])
            assert out == ref[:ref.index(ref[10]) + 1]
        prompt = rig.tm.tokenize(PROMPTS[0])
        ref = llama_cpp_greedy(dspark(models, arch, block, layout).target, prompt, 40)
        out, _ = rig.run(rig.dec, prompt, len(ref))
        assert out == ref
    finally:
        rig.close()


def test_an_oracle_fills_whole_anchor_first_blocks(models):
    """Anchor-first blocks really commit block_size + 1 tokens a step when every drafted token is right."""
    pair = dspark(models)
    rig = Rig(pair)
    try:
        prompt = rig.tm.tokenize(PROMPTS[0])
        ref, _ = rig.run(rig.plain, prompt, 46, stop_tokens=[])
        rig.dec.proposer = OverrideProposer(lambda ctx, n: ref[len(ctx) - len(prompt):][:n])
        out, st = rig.run(rig.dec, prompt, 46, stop_tokens=[])
        assert out == ref
        assert st.steps == 5 and st.accepted == 40    # the prefill's token, then 5 steps of 8 drafted + 1
    finally:
        rig.close()


@pytest.mark.parametrize("arch", ["qwen35"])
def test_hybrid_target_equals_plain(models, arch):
    rig = Rig(dspark(models, arch))
    try:
        _equals_plain(rig, 40)
    finally:
        rig.close()


@contextlib.contextmanager
def _sampling(pair):
    """A DSpark pair's target and drafter contexts, a plain context, a prompt and the exact distribution of
    the target's first K_TOKENS tokens after it (test_sampling's)."""
    tm, dm = Model(pair.target), Model(pair.drafter)
    opts = ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64)
    pc, tc = Context(tm, opts), Context(tm, opts)
    dc = Context(dm, opts, other=tc)
    try:
        prompt = tm.tokenize(PROMPTS[0])
        yield pc, tc, dc, prompt, exact_distribution(pc, prompt, SP)
    finally:
        for c in (dc, tc, pc):
            c.close()
        dm.close()
        tm.close()


@pytest.mark.parametrize("layout", ["anchor", "bonus"])
def test_sampling_keeps_the_target_distribution(models, layout):
    """At temperature > 0 the drafted block is drawn through the Markov head's chain, each token kept with
    probability min(1, p/q), else the residual max(0, p - q) is sampled; an oracle's block is a
    deterministic proposal (kept with p(token)). The samples follow the target's exact distribution."""
    with _sampling(dspark(models, layout=layout)) as (pc, tc, dc, prompt, exact):
        greedy = list(DFlashDecoder(pc, None).generate(prompt, K_TOKENS, stop_tokens=[]))
        # half the runs with the drafter's own blocks, half with an oracle's (accepted and rejected rows both)
        dec = DFlashDecoder(tc, dc, SpecOptions())
        oracle = DFlashDecoder(tc, dc, SpecOptions(),
                               OverrideProposer(lambda ctx, n: greedy[len(ctx) - len(prompt):][:n]))
        counts, st = Counter(), GenerationStats()
        for seed in range(1500):
            sp = SamplingParams(**{**SP.__dict__, "seed": seed})
            d = dec if seed % 2 else oracle
            counts[tuple(d.generate(prompt, K_TOKENS, sampling=sp, stats=st, stop_tokens=[]))] += 1
        assert st.drafted > 0 and 0 < st.accepted < st.drafted
        assert dec.markov is not None and oracle.markov is not None
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"DSpark samples do not follow the target distribution (p={p:.2e})"


def test_sampled_and_greedy_sequences_in_one_batch(models):
    """In a batch, the sampled sequences' blocks are drawn through the Markov chain (the drafter gives that
    step's logits rows) while the greedy ones beside them keep the graph's chain: the samples follow the
    target's exact distribution, the greedy requests give what they give alone."""
    from test_batch import BatchRig, _sampled_beside_greedy

    rig = BatchRig(dspark(models), 4)
    try:
        assert rig.dec.markov is not None
        _sampled_beside_greedy(rig, 1200, 20)
    finally:
        rig.close()


# ---------------------------------------------------------------- the front doors
def test_llama_batch_cli_and_server_serve_a_dspark_drafter(models, tmp_path):
    """``Llama``, ``Llama.from_pair``, ``BatchLlama``, the CLI and the server's slots: the same text as
    llama_cpp.Llama's, DSpark named in the ``dflash`` object."""
    import json
    import subprocess
    import sys

    import httpx

    from dflash_gguf import Llama
    from dflash_gguf.batch import BatchLlama
    from dflash_gguf.server import create_app

    pair = dspark(models)
    plain = llama_cpp.Llama(str(pair.target), **KW)
    prompts = ["def main(", "import os\n", "class Foo:\n    def"]
    want = [plain.create_completion(p, max_tokens=24, temperature=0)["choices"][0]["text"] for p in prompts]
    plain.close()

    llm = Llama(str(pair.target), draft_model_path=str(pair.drafter), draft_adaptive=False, **KW)
    try:
        for p, w in zip(prompts, want):
            out = llm.create_completion(p, max_tokens=24, temperature=0)
            assert out["choices"][0]["text"] == w
            assert out["dflash"]["enabled"] and out["dflash"]["steps"] > 0
        assert llm.dflash_info["kind"] == "dspark" and llm.dflash_info["n_draft"] == 8
        app = create_app(llm, "tiny", parallel=2)
        with serve(app) as url:
            for p, w in zip(prompts, want):
                r = httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0},
                               timeout=120)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == w
        app.state.server.slots.close()
    finally:
        llm.close()

    with BatchLlama(pair.target, pair.drafter, n_parallel=3, n_ctx=512, n_threads=1, draft_adaptive=False) as b:
        outs = b.generate(prompts, max_tokens=24, temperature=0)
        assert [o.text for o in outs] == want
        assert all(o.stats.drafted > 0 for o in outs)

    r = subprocess.run([sys.executable, "-m", "dflash_gguf", "generate", "--model", str(pair.target), "--draft",
                        str(pair.drafter), "--n-ctx", "512", "--threads", "1", "-n", "24", "--json", prompts[0]],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want[0] + "\n"
    stats = json.loads(r.stderr.strip().splitlines()[-1])
    assert stats["dflash"]["steps"] > 0


# ---------------------------------------------------------------- every published form, converted, runs
@pytest.mark.parametrize("form,kind,anchor", [
    ("deepspec", "dspark", True), ("deepspec-dflash", "dflash", True), ("speculators bonus slot", "dspark", False),
    ("speculators reduced vocab", "dspark", False), ("nested", "dspark", True)])
def test_each_published_form_converted_runs_losslessly(models, tmp_path, form, kind, anchor):
    """What ``python -m dflash_gguf.convert`` makes of each published form (tests/test_convert_dspark.py)
    drafts in its own layout - DeepSpec's DFlash drafters (no Markov head) anchor-first too - and gives
    plain decoding's tokens; a sampled request with a seeded stream, drawn through the Markov chain, repeats
    itself."""
    import tiny
    from test_convert_dspark import FORMS, RANK, deepspec

    from dflash_gguf.convert import convert_pair

    t, _ = models.target("qwen3")
    src = tiny.make_drafter(tmp_path / "zlab", t, kind="dspark", block_size=8, markov_rank=RANK)
    d = (deepspec(src, t, tmp_path / "dd", markov=False) if form == "deepspec-dflash"
         else FORMS[form][0](src, t, tmp_path))
    m = convert_pair(t, d, tmp_path / "pair", outtype="f32", threads=1)
    rig = Rig(type("P", (), {"target": m.target.path, "drafter": m.drafter.path})())
    try:
        info = rig.dec.info
        assert (info.kind, info.sample_from_anchor) == (kind, anchor)
        assert rig.dec.n_draft == info.draft_max == (8 if anchor else 7)
        _equals_plain(rig, 30)
        if kind == "dspark":    # sampled: drawn through the Markov chain (a reduced head: its d2t rows)
            # (from the same caches: the Markov chain's draws follow the drafter's rows, which a prompt
            # decoded with the first step and one already cached give in other roundings)
            sp, prompt = SamplingParams(temperature=0.8, seed=7, repeatable=False), rig.tm.tokenize(PROMPTS[0])
            rig.dec.reset()
            first, st = rig.run(rig.dec, prompt, 30, sampling=sp)
            rig.dec.reset()
            assert st.drafted > 0 and rig.run(rig.dec, prompt, 30, sampling=sp)[0] == first
            # a repeatable request (point-mass drafts, each token its position's draw) repeats from any cache
            sp = SamplingParams(temperature=0.8, seed=7)
            first = rig.run(rig.dec, prompt, 30, sampling=sp)[0]
            assert rig.run(rig.dec, prompt, 30, sampling=sp)[0] == first
    finally:
        rig.close()


# ---------------------------------------------------------------- verify lengths from the confidence
class _Confident(OverrideProposer):
    """The drafter runs (its cost paid), then an oracle's block, one token in three blocks made wrong, with a
    confidence that knows it: high up to the wrong token, low from there on."""

    confidence = True

    def __init__(self, refs):
        self.refs, self.calls = refs, 0

    def propose(self, drafter, seqs, pos, pending, n, out, context, conf=None):
        n = DFlashProposer.propose(self, drafter, seqs, pos, pending, n, out, context, conf)
        for i in range(len(seqs)):
            self.calls += 1
            ctx = context(i) + [int(pending[i])]
            ref = next((r for r in self.refs if r[:len(ctx)] == ctx), ctx)
            block = (list(ref[len(ctx):len(ctx) + n]) + [0] * n)[:n]
            wrong = self.calls % n if self.calls % 3 == 0 else n
            if wrong < n:
                block[wrong] = (block[wrong] + 1) % 50
            out[i, :n] = block
            if conf is not None:
                conf[i, :n] = [0.95 if j < wrong else 0.03 for j in range(n)]
        return n


def test_blocks_cut_by_confidence_stay_lossless_alone_and_batched(models, monkeypatch):
    """With the speed gate on, each step verifies only the rows the calibrated confidence says pay: here
    the rows from a planted wrong token on are left out (``unverified``), and every sequence, alone or in a
    batch, still gives plain decoding's tokens. The gate's own choice follows this machine's timings (on a
    pair this small it may rightly decode plainly): here it drafts whole blocks, and a verify row costs a
    tenth of a plain step."""
    from test_batch import TEXTS, BatchRig

    from dflash_gguf.decoding.gate import DraftLength

    monkeypatch.setattr(DraftLength, "choose", lambda self: self.n_max)
    monkeypatch.setattr(DraftLength, "step_cost",
                        lambda self: np.array([1.0] + [1.2 + 0.1 * k for k in range(1, self.n_max + 1)]))

    pair = dspark(models)
    ref_rig = BatchRig(pair, 1)
    prompts = [ref_rig.tm.tokenize(t) for t in TEXTS[:4]]
    refs = [ref_rig.alone(Request(p, 40, stop_tokens=[])) for p in prompts]
    ref_rig.close()
    fulls = [p + r for p, r in zip(prompts, refs)]
    for n_seq in (1, 3):
        rig = BatchRig(pair, n_seq, adaptive=True)
        rig.dec.proposer = _Confident(fulls)
        try:
            assert rig.dec.confidence is not None
            reqs = [Request(p, 40, stop_tokens=[]) for p in prompts]
            for r in reqs:
                r.stats = GenerationStats()
            for _ in range(3):        # the gate and the calibration learn over calls, as a Llama's do
                assert rig.dec.generate_batch(reqs) == refs
            st = GenerationStats()
            for r in reqs:
                st.merge(r.stats)
            assert st.unverified > 0 and st.accepted > 0
        finally:
            rig.close()


def test_gated_sampling_with_confidence_cuts_keeps_the_target_distribution(models):
    """Unseeded sampled requests are gated, so their blocks are cut by the confidence too (with a
    calibration of their own): still the target's exact distribution."""
    with _sampling(dspark(models)) as (pc, tc, dc, prompt, exact):
        greedy = list(DFlashDecoder(pc, None).generate(prompt, 40, stop_tokens=[]))
        dec = DFlashDecoder(tc, dc, SpecOptions(adaptive=True))
        dec.proposer = _Confident([prompt + greedy])
        counts, st = Counter(), GenerationStats()
        for _ in range(1500):
            counts[tuple(dec.generate(prompt, K_TOKENS, sampling=SP, stats=st, stop_tokens=[]))] += 1
        assert st.drafted > 0 and dec.confidence[False].tries.sum() > 0
        p = chi2_pvalue(counts, exact)
        assert p > ALPHA, f"gated DSpark samples do not follow the target distribution (p={p:.2e})"
