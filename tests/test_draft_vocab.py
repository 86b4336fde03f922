"""Reduced draft vocabulary (``--draft-vocab N``): token choice, the d2t head, losslessness, bad input.

The head and ``d2t`` are read by llama.cpp's own dflash graph; these tests check that a drafter with
a reduced head (DFlash and DFlash2) only ever proposes chosen tokens, proposes the same token as the
full head wherever that token was kept, and that generation stays equal to plain decoding.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.convert import PairError, check_pair, convert_pair, load_manifest
from dflash_gguf.convert import draft_vocab as dv

REPO = Path(__file__).resolve().parent.parent


def _vocab(tokens, types=None, scores=None, merges=None, special=None) -> dv.Vocab:
    return dv.Vocab(model="gpt2" if merges else "llama", tokens=list(tokens),
                    types=np.asarray(types if types is not None else [dv.NORMAL] * len(tokens)),
                    scores=None if scores is None else np.asarray(scores, dtype=float), merges=merges,
                    special=special or {}, chat_template=None)


# ---------------------------------------------------------------- ranking and choice (no model needed)
def test_bpe_merge_rank_and_base_symbols():
    v = _vocab(["a", "b", "c", "z", "ab", "abc", "<ctl>", "[PAD]"],
               types=[1, 1, 1, 1, 1, 1, dv.CONTROL, dv.UNUSED], merges=["a b", "ab c"])
    r = dv.tokenizer_rank(v)
    assert r[4] == 0 and r[5] == 1                     # merged tokens: merge order
    assert r[0] < r[4] and r[1] < r[4] and r[2] < r[5]  # base symbols: before the first merge using them
    assert r[3] > r[5]                                 # a symbol no merge uses comes after the merges
    assert np.isinf(r[6]) and np.isinf(r[7])           # control / unused are never ranked (control is forced)


def test_sentencepiece_characters_are_not_last():
    # SentencePiece BPE: merges first (score = -merge order), its character alphabet at the end
    toks = ["<unk>", "<s>", "</s>", "<0x00>", "▁▁", "se", "▁t", "▁", "s", "e", "t", "q"]
    types = [dv.UNKNOWN, dv.CONTROL, dv.CONTROL, dv.BYTE] + [1] * 8
    scores = [0, 0, 0, 0, 0, -1, -2, -3, -4, -5, -6, -7]
    v = _vocab(toks, types, scores, special={"bos_token_id": 1, "eos_token_id": 2})
    r = dv.tokenizer_rank(v)
    assert r[toks.index("▁")] < r[toks.index("se")]    # '▁' is in '▁▁' (rank 0)
    assert r[toks.index("s")] < r[toks.index("▁t")]
    assert r[toks.index("q")] > r[toks.index("▁t")]    # never merged: its own (last) rank
    assert r[toks.index("<0x00>")] > r.max(initial=0, where=np.isfinite(r) & (v.types == 1))
    c = dv.choose(v, 5)
    assert {1, 2} <= set(c.ids.tolist())               # control tokens always kept
    assert toks.index("▁") in c.ids and toks.index("▁▁") in c.ids
    assert c.method == "tokenizer-rank" and c.n_required == 2 and list(c.ids) == sorted(c.ids)


@pytest.mark.parametrize("value, msg", [("abc", "takes a number"), ("1.5", "takes a number"), ("-3", "takes a number"),
                                        ("0", "at least 1"), ("12", "not smaller than the target vocabulary"),
                                        ("99", "not smaller")])
def test_bad_sizes(value, msg):
    with pytest.raises(PairError, match=msg):
        dv.resolve_size(dv.parse_size(value), 12)


def test_auto_and_off():
    assert dv.resolve_size("auto", 4096) is None
    assert dv.resolve_size("auto", 151936) == dv.AUTO_SIZE
    assert dv.resolve_size("off", 151936) is None
    assert dv.resolve_size(dv.parse_size(" 1024 "), 151936) == 1024


def test_choice_errors():
    v = _vocab(["<s>", "</s>", "a", "b", "ab"], types=[dv.CONTROL, dv.CONTROL, 1, 1, 1], merges=["a b"])
    with pytest.raises(PairError, match="smaller than the 2 tokens"):
        dv.choose(v, 1)
    with pytest.raises(PairError, match="selector_top_k"):
        dv.choose(v, 3, min_size=4)
    # 'a' and 'b' rank just before 'ab', the first merge using them (a symbol is at least that frequent)
    assert dv.choose(v, 3).ids.tolist() == [0, 1, 2]
    assert dv.choose(v, 4).ids.tolist() == [0, 1, 2, 3]
    with pytest.raises(PairError, match="needs a reduced head|--draft-vocab N"):
        dv.precheck("off", ["x.txt"], 512)
    with pytest.raises(PairError, match="no such file"):
        dv.precheck(64, ["/nonexistent/corpus.txt"], 512)


# ---------------------------------------------------------------- the head in llama.cpp
def _engine_pair(target: Path, drafter: Path):
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    tm, dm = Model(target), Model(drafter)
    opts = ContextOptions(n_ctx=512, n_threads=1)
    tctx = Context(tm, opts)
    dctx = Context(dm, opts, other=tctx)
    return tm, dm, tctx, dctx


def _proposals(target: Path, drafter: Path, prompt_len: int = 24, steps: int = 6,
               ids: bool = True, logits: list | None = None) -> list[list[int]]:
    """The drafter's raw block proposals at a few positions of a plain run (no proposer hook); with
    ``ids=False``, ``logits`` (a list) receives each block's rows of logits as the drafter gave them."""
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.decoding import DFlashDecoder

    tm, dm, tctx, dctx = _engine_pair(target, drafter)
    try:
        dec = DFlashDecoder(tctx, dctx)
        if not ids:   # the decoder's default is argmax ids from the drafter's graph (patch 0013)
            assert B.lib.llama_dflash_set_draft_ids(dctx.cptr, False) == 1
        prompt = tm.tokenize(b"def parse(argv):\n    parser = argparse.ArgumentParser(")[:prompt_len]
        out = []
        buf = np.zeros(16, dtype=np.int32)
        n = dec.n_draft
        for k in range(steps):
            dec.reset()
            toks = list(dec.generate(prompt, 1 + 3 * k, stop_tokens=[]))
            pos, pending = len(prompt) + len(toks) - 1, toks[-1]
            dec.features.flush()   # rows kept on the host: what the decoder's next draft injects first
            got = B.check(B.lib.llama_dflash_draft(dctx.cptr, 0, pos, pending, n, B.ffi.from_buffer("llama_token[]", buf)),
                          "draft")
            out.append(buf[:got].tolist())
            if logits is not None:
                n_vocab = tm.n_vocab
                logits.append(np.array([np.frombuffer(B.ffi.buffer(B.lib.llama_get_logits_ith(dctx.cptr, 1 + i),
                                                                   4 * n_vocab), dtype=np.float32)
                                        for i in range(got)]))
            # ids mode leaves no logits to read; a DFlash block's logits scan leaves them
            if ids or dec.info.kind == "dflash":
                assert (B.lib.llama_get_logits_ith(dctx.cptr, 1) == B.ffi.NULL) == ids
        return out
    finally:
        dctx.close(), tctx.close(), dm.close(), tm.close()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_draft_ids_from_the_graph_equal_the_logits_scan(models, tmp_path, kind):
    """patches/0013: the drafter's in-graph argmax (what the decoder uses) proposes what scanning its
    logits on the host proposed, with the full head and with a reduced head (ids after the d2t scatter)."""
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.errors import NotADrafterError

    p = models.pair("qwen3", kind, 8)
    v = dv.read_vocab(p.target)
    red = tmp_path / f"{kind}-reduced.gguf"
    ids = np.array(sorted(set(range(0, v.n_vocab, 3)) | set(range(200))))[:1024]
    dv.write_reduced_drafter(p.drafter, p.target, ids, red)
    for drafter in (p.drafter, red):
        by_ids, by_scan = _proposals(p.target, drafter), _proposals(p.target, drafter, ids=False)
        assert by_ids == by_scan and any(by_ids), drafter.name
    with Model(p.target) as tm, Context(tm, ContextOptions(n_ctx=64)) as tctx:
        with pytest.raises(NotADrafterError):
            B.check(B.lib.llama_dflash_set_draft_ids(tctx.cptr, True), "ids on a target")


@pytest.mark.parametrize("order", ["increasing", "shuffled"])
def test_reduced_head_ids_equal_the_argmax_of_its_scattered_logits(models, tmp_path, order):
    """patches/0028: drafting by ids, a reduced head takes its argmax over its own rows and maps the row
    through d2t (increasing d2t) instead of scattering the block to the whole vocabulary first; a d2t that
    is not increasing keeps the scatter. Either way the ids equal the argmax of the full-vocabulary logits
    the same drafter gives by logits (-inf outside d2t, the head's logits on d2t), and greedy DFlash equals
    plain decoding."""
    p = models.pair("qwen3", "dflash", 8)
    v = dv.read_vocab(p.target)
    ids = np.array(sorted(set(range(0, v.n_vocab, 3)) | set(range(200))))[:1024]
    if order == "shuffled":
        ids = np.random.default_rng(0).permutation(ids)
        assert (np.diff(ids) < 0).any()
    red = tmp_path / f"reduced-{order}.gguf"
    dv.write_reduced_drafter(p.drafter, p.target, ids, red)
    rows: list[np.ndarray] = []
    by_ids = _proposals(p.target, red, steps=8)
    by_logits = _proposals(p.target, red, steps=8, ids=False, logits=rows)
    assert by_ids == by_logits and sum(map(len, by_ids)) >= 8
    off = np.ones(v.n_vocab, dtype=bool)
    off[ids] = False
    for block, r in zip(by_ids, rows):
        assert r.shape == (len(block), v.n_vocab)
        assert np.isneginf(r[:, off]).all() and np.isfinite(r[:, ids]).all()
        assert np.argmax(r, axis=1).tolist() == block
        # the head's own rows in d2t order: their argmax is the same token
        assert ids[np.argmax(r[:, ids], axis=1)].tolist() == block
    plain, spec, _ = _lossless(p.target, red)
    assert spec == plain


def _lossless(target: Path, drafter: Path, n: int = 48) -> tuple[list[int], list[int], float]:
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats

    tm, dm, tctx, dctx = _engine_pair(target, drafter)
    try:
        prompt = tm.tokenize(b"class Parser:\n    def __init__(self, prog=None):\n")
        plain = list(DFlashDecoder(tctx, None).generate(prompt, n, stop_tokens=[]))
        st = GenerationStats()
        spec = list(DFlashDecoder(tctx, dctx).generate(prompt, n, stop_tokens=[], stats=st))
        return plain, spec, st.tau
    finally:
        dctx.close(), tctx.close(), dm.close(), tm.close()


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_reduced_head_proposes_only_kept_tokens_and_stays_lossless(models, tmp_path, kind):
    p = models.pair("qwen3", kind, 8)
    v = dv.read_vocab(p.target)
    full = _proposals(p.target, p.drafter)
    proposed = sorted({t for block in full for t in block})
    # head A keeps (every other one of) the full head's proposals, head B drops all of them
    for label, keep, drop in (("A", proposed[::2], set(proposed[1::2])), ("B", [], set(proposed))):
        ids = np.array(sorted(keep + [t for t in range(v.n_vocab) if t not in drop and t not in keep][:256 - len(keep)]))
        out = tmp_path / f"{kind}-{label}.gguf"
        qtype, source = dv.write_reduced_drafter(p.drafter, p.target, ids, out)
        assert dv.draft_vocab_size(out) == 256 and source == "target token_embd.weight" and qtype == "F32"
        kept = set(ids.tolist())
        red = _proposals(p.target, out)
        flat = [t for block in red for t in block]
        assert flat and set(flat) <= kept, "the reduced head proposed a token outside d2t"
        if kind == "dflash":   # per-row argmax: the same token wherever the full head's choice was kept
            pairs = [(a, b) for fa, fb in zip(full, red) for a, b in zip(fa, fb)]
            assert all(a == b for a, b in pairs if a in kept)
            assert label == "B" or any(a in kept for a, _ in pairs)
        plain, spec, tau = _lossless(p.target, out)
        assert spec == plain


def test_reduced_head_of_an_untied_target(models, tmp_path):
    """Llama keeps a separate output.weight: the head rows come from it, not from token_embd."""
    p = models.pair("llama", "dflash", 8)
    v = dv.read_vocab(p.target)
    c = dv.choose(v, 200)
    out = tmp_path / "llama-dv200.gguf"
    _, source = dv.write_reduced_drafter(p.drafter, p.target, c.ids, out)
    assert source == "target output.weight"
    plain, spec, _ = _lossless(p.target, out)
    assert spec == plain
    # replacing a reduced head with another one reads the target's full head again
    c2 = dv.choose(v, 300)
    _, source2 = dv.write_reduced_drafter(out, p.target, c2.ids, out)
    assert source2 == "target output.weight" and dv.draft_vocab_size(out) == 300


def test_corpus_choice_counts_tokens(models, tmp_path):
    p = models.pair("qwen3", "dflash", 8)
    v = dv.read_vocab(p.target)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("return self.value\n" * 200 + "while True:\n    pass\n" * 50)
    c = dv.choose(v, 64, [corpus])
    assert c.method == "corpus" and c.corpus_tokens > 0 and c.corpus_coverage == pytest.approx(1.0)
    from dflash_gguf.convert.draft_vocab import VocabTokenizer

    with VocabTokenizer(p.target) as tok:
        used = set(tok.tokenize(b"return self.value\nwhile True:\n    pass\n"))
    assert used <= set(c.ids.tolist())
    assert c.manifest()["corpus"][0]["file"] == "corpus.txt"
    b = dv.choose(v, 64, builtin=True)
    assert b.method == "builtin-corpus" and len(b.corpus) >= 10 and b.corpus_tokens > 100_000
    assert dv.choose(v, 64, [corpus], builtin=True).method == "corpus"     # given files win


# ---------------------------------------------------------------- convert integration
def test_convert_with_draft_vocab_records_and_checks(models, tmp_path):
    p = models.pair("qwen3", "dflash2", 8)
    out = tmp_path / "pair"
    convert_pair(p.target_hf, p.drafter_hf, out, outtype="f32", threads=1, draft_vocab="128")
    m = load_manifest(out)
    rec = m.data["draft_vocab"]
    assert rec["size"] == 128 and rec["of"] == 512 and rec["method"] == "tokenizer-rank"
    assert rec["head_type"] == "F32" and dv.draft_vocab_size(m.drafter.path) == 128
    r = check_pair(out, n_tokens=24, threads=1)
    assert r.ok, r.message
    assert r.draft_vocab == 128 and "draft head 128 of 512" in r.message
    # pair.json and the drafter must agree: a full-head drafter under a reduced-head record fails --check
    doc = json.loads((out / "pair.json").read_text())
    doc["draft_vocab"]["size"] = 64
    (out / "pair.json").write_text(json.dumps(doc))
    bad = check_pair(out, n_tokens=8, threads=1, verify=False)
    assert not bad.ok and "draft head has 128 rows, pair.json says 64" in bad.message


def test_default_auto_keeps_small_vocabularies_full(models, tmp_path):
    p = models.pair("qwen3", "dflash", 8)
    out = tmp_path / "pair"
    convert_pair(p.target_hf, p.drafter_hf, out, outtype="f32", threads=1)
    rec = load_manifest(out).data["draft_vocab"]
    assert rec["size"] is None and rec["why"].startswith("auto")
    assert dv.draft_vocab_size(out / load_manifest(out).drafter.path.name) is None


def test_reduce_existing_pair(models, tmp_path):
    p = models.pair("qwen3", "dflash", 8)
    src = tmp_path / "src"
    convert_pair(p.target_hf, p.drafter_hf, src, outtype="f32", threads=1, draft_vocab="off")
    r = subprocess.run([sys.executable, "-m", "dflash_gguf.convert.draft_vocab", str(src), "--draft-vocab", "200",
                        "-o", str(tmp_path / "dst")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = load_manifest(tmp_path / "dst", verify=True)
    assert m.data["draft_vocab"]["size"] == 200
    assert check_pair(tmp_path / "dst", n_tokens=16, threads=1).ok
    assert dv.draft_vocab_size(load_manifest(src).drafter.path) is None      # the source pair is untouched


@pytest.mark.parametrize("args, msg", [
    (["--draft-vocab", "lots"], "takes a number of tokens"),
    (["--draft-vocab", "0"], "at least 1"),
    (["--draft-vocab", "512"], "not smaller than the target vocabulary (512"),
    (["--draft-vocab", "2"], "below the minimum of 4"),                          # DFlash2 selector top-k 4
    (["--draft-vocab", "100", "--vocab-corpus", "/nonexistent.txt"], "no such file"),
    (["--vocab-corpus", "README.md"], "pass --draft-vocab N"),
])
def test_cli_bad_draft_vocab(models, tmp_path, args, msg):
    p = models.pair("qwen3", "dflash2", 8)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dflash_gguf.convert", str(p.target_hf), str(p.drafter_hf), "-o",
                        str(out), *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert msg in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
