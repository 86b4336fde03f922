"""Scale benchmark pieces: random quant blocks, synthetic GGUF pairs, the acceptance-replay proposer.

The real shapes (0.6B-8B) are too large for a test; a small Shape with the same real vocabulary
exercises the same writer (Q4_0 / Q8_0 matrices, Q6_K head, tokenizer copy, drafter metadata).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_gguf.bench.scale import synth
from dflash_gguf.bench.scale.replay import PROFILES, ReplayBook, ReplayProposer, expected_tau, parse_profile


@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "q6_k"])
def test_random_blocks_have_the_requested_std(kind):
    import gguf
    from gguf.quants import dequantize

    qname, make = synth.QUANT[kind]
    b = make(np.random.default_rng(0), 64, 512, 0.05)
    x = dequantize(b, gguf.GGMLQuantizationType[qname])
    assert x.shape == (64, 512) and np.isfinite(x).all()
    assert x.std() == pytest.approx(0.05, rel=0.05)


def test_taps_follow_zlab_spread():
    assert synth.build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]     # Qwen3-8B-DFlash-b16's ids
    assert synth.build_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    assert synth.SHAPES["1.7b"].params == pytest.approx(1.72e9, rel=0.01)


def test_profiles():
    assert expected_tau(PROFILES["strong"], 15) == pytest.approx(7.46, abs=0.01)
    assert expected_tau(PROFILES["none"], 15) == 1.0
    assert PROFILES["demo"][:7] == [0.78, 0.68, 0.61, 0.56, 0.51, 0.46, 0.42]
    assert parse_profile("0.9,0.5")[1] == [0.9, 0.5]
    for bad in ("0.5,0.9", "1.5", "nonsense", ""):
        with pytest.raises(ValueError):
            parse_profile(bad)


def test_replay_matches_the_profile():
    ref = list(range(1000, 1400))
    cum = [0.9, 0.7, 0.4, 0.1]
    prop = ReplayProposer(ref, cum, n_vocab=5000, seed=1)
    hits = np.zeros(4)
    n = 4000
    for _ in range(n):
        L = 100
        out = prop(ref[:L], 4)
        truth = ref[L:L + 4]
        a = next((i for i in range(4) if out[i] != truth[i]), 4)
        hits[:a] += 1
    assert np.allclose(hits / n, cum, atol=0.03)
    assert prop.diverged == 0
    # a context that left the reference gets wrong proposals (and is counted)
    assert prop([1, 2, 3], 3) == [4, 4, 4] and prop.diverged == 1


def test_a_replay_book_serves_several_prompts_at_once():
    """One book for a server's requests: each context is matched to the reference it starts (two
    sequences' calls interleaved, at lengths of their own), every position of each is right as often
    as the profile says, and a context of neither gets a wrong block, counted."""
    refs = [[7, 8] + list(range(1000, 1300)), [9] + list(range(2000, 2300))]
    cum = [0.9, 0.6, 0.3]
    book = ReplayBook(refs, cum, n_vocab=5000, seed=3)
    hits = {0: np.zeros(3), 1: np.zeros(3)}
    n = 3000
    for k in range(n):
        for r, L in ((0, 40 + k % 50), (1, 17 + k % 80)):
            out = book(refs[r][:L], 3)
            truth = refs[r][L:L + 3]
            a = next((i for i in range(3) if out[i] != truth[i]), 3)
            assert out[:a] == truth[:a] and (a == 3 or out[a] == truth[a] + 1)
            hits[r][:a] += 1
    for r in (0, 1):
        assert np.allclose(hits[r] / n, cum, atol=0.03), r
    assert book.diverged == 0 and book.steps == 2 * n
    assert book([7, 9, 1000], 2) == [1001, 1001] and book.diverged == 1        # no reference starts so
    assert len(book(refs[1], 3)) == 3 and book.diverged == 1                    # at a reference's end: filler


SMALL = synth.Shape("test", 256, 8, 2, 1, 512, True)


@pytest.fixture(scope="module")
def small_pairs(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setitem(synth.SHAPES, "test", SMALL)
    root = tmp_path_factory.mktemp("scale")
    return {t: synth.make_pair("test", t, root=root) for t in synth.TYPES}


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_synthetic_pair_files(small_pairs):
    import gguf

    d = small_pairs["q4_0"]
    doc = json.loads((d / "pair.json").read_text())
    assert doc["kind"] == "dflash" and doc["block_size"] == 16 and doc["target_layers"] == [2, 3, 4, 5, 6]
    t = {x.name: x for x in gguf.GGUFReader(str(d / "target.gguf")).tensors}
    assert t["token_embd.weight"].tensor_type.name == "Q6_K" and t["blk.0.ffn_up.weight"].tensor_type.name == "Q4_0"
    assert list(t["token_embd.weight"].shape) == [256, synth.VOCAB_SIZE]
    from dflash_gguf.native.engine import Model, check_compatible

    with Model(d / "target.gguf") as tm, Model(d / "drafter.gguf") as dm:
        check_compatible(tm, dm)                                             # llama.cpp accepts the pair
        assert tm.n_vocab == synth.VOCAB_SIZE and dm.n_layer == synth.DRAFT_LAYERS
    assert synth.make_pair("test", "q4_0", root=d.parent) == d          # cached


@pytest.mark.parametrize("wtype", synth.TYPES)
def test_replayed_run_is_lossless_and_hits_the_profile(small_pairs, wtype):
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, OverrideProposer, SpecOptions

    d = small_pairs[wtype]
    with Model(d / "target.gguf") as tm, Model(d / "drafter.gguf") as dm:
        opts = ContextOptions(n_ctx=512, n_threads=1)
        with Context(tm, opts) as tctx, Context(dm, opts, other=tctx) as dctx:
            prompt = tm.tokenize(b"def f(x):\n    return", add_bos=False)
            plain = list(DFlashDecoder(tctx, None).generate(prompt, 96, stop_tokens=[]))
            assert len(plain) == 96
            prop = ReplayProposer(prompt + plain, PROFILES["strong"], tm.n_vocab, seed=0)
            st = GenerationStats()
            dec = DFlashDecoder(tctx, dctx, SpecOptions(), OverrideProposer(prop))
            got = list(dec.generate(prompt, 96, stop_tokens=[], stats=st))
    assert got == plain
    assert prop.diverged == 0
    assert 4.0 < st.tau < 12.0       # 7.46 expected; few steps, so a wide band


def test_reduced_head_on_synthetic_pair_and_run_case(small_pairs, tmp_path):
    from dflash_gguf.bench.scale.__main__ import markdown
    from dflash_gguf.bench.scale.run import run_case
    from dflash_gguf.convert import draft_vocab

    d = small_pairs["q4_0"]
    red = draft_vocab.reduce_pair(d, 4096, out_dir=tmp_path / "dv")
    assert draft_vocab.draft_vocab_size(red / "drafter.gguf") == 4096
    case = {"name": "test", "target": str(d / "target.gguf"),
            "drafters": {"full": str(d / "drafter.gguf"), "dv4096": str(red / "drafter.gguf")},
            "profiles": ["strong", "none"], "tokens": 24, "trials": 1, "repeats": 1, "threads": 1, "gate": False}
    r = run_case(case)
    assert set(r["drafters"]) == {"full", "dv4096"}
    for lab, x in r["drafters"].items():
        c = x["costs"]
        assert sorted(int(k) for k in c["verify_ms"]) == list(range(1, 17)) and c["draft_ms"] > 0
        assert set(x["runs"]) == {"strong", "none", "own"}
        assert all(run["exact"] for run in x["runs"].values()), lab
        assert x["runs"]["none"]["tau"] == 1.0
    r["name"] = "test"
    md = markdown([r], {"command": "test", "cpu": "cpu", "cores": 1, "load_start": "0", "load_end": "0",
                        "threads": 1, "tokens": 24, "trials": 1})
    assert "| test |" in md and "synthetic random weights, replayed acceptance" in md
    # --gate-only: the gated columns alone, with the draws the fixed columns would have had
    g = run_case(dict(case, drafters={"full": case["drafters"]["full"]}, profiles=["strong", "none"], own=False,
                      gate="only"))
    runs = g["drafters"]["full"]["runs"]
    assert set(runs) == {"strong+gate", "none+gate"}
    assert all(run["exact"] for run in runs.values()) and runs["none+gate"]["tau"] == 1.0
    # --gate-warm: one gated decoder across trials (as a Llama keeps its gate): fresh caches every
    # trial, so every trial is exact; the first (cold) trial is reported apart from the median
    w = run_case(dict(case, drafters={"full": case["drafters"]["full"]}, profiles=["strong"], own=False,
                      gate="only", gate_warm=True, trials=2))
    run = w["drafters"]["full"]["runs"]["strong+gate warm"]
    assert run["exact"] and len(run["tps"]) == 2
    assert run["tps_cold"] == round(run["tps"][0], 3) and run["tps_median"] == round(run["tps"][1], 3)
