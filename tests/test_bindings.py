"""The C API of patches/0001-0002 (include/llama-dflash.h), through the cffi bindings.

Layer-index convention under test: tap L is the INPUT of target layer L, which is Hugging Face's
``hidden_states[L]`` (the raw output of layer L-1; ``hidden_states[0]`` is the embeddings).
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import llama_cpp.llama_cpp as C
import numpy as np
import pytest

from dflash_gguf.native import _bindings as B
from dflash_gguf import paths
from dflash_gguf.native.engine import Context, ContextOptions, Model
from dflash_gguf.errors import (DFlashError, BufferTooSmallError, InvalidArgumentError, LayerError, NotADrafterError,
                                PairMismatchError, RowRangeError, TapDisabledError)

PROMPT = b"def parse(self, args):\n    for name in args:\n        yield name"


def _header_functions() -> list[str]:
    header = (paths.upstream_tree() / "include" / "llama-dflash.h").read_text()
    return re.findall(r"LLAMA_API\s+[\w\s\*]+?\b(llama_dflash_\w+)\s*\(", header)


def test_every_header_function_is_declared_and_resolves():
    names = _header_functions()
    assert len(names) >= 12, names
    cdef = (Path(B.__file__).parent / "_cffi" / "dflash.cdef").read_text()
    for name in names:
        assert re.search(rf"\b{name}\s*\(", cdef), f"{name} missing from dflash.cdef"
        assert callable(getattr(B.lib, name)), name


def test_stamp_and_version():
    assert B.lib.llama_dflash_api_version() == B.API_VERSION
    assert B.BUILD_STAMP == f"dflash-gguf;api={B.API_VERSION};series={paths.patch_series_hash()}"
    assert B.status_str(-4) == "row range outside the rows of the last decode"
    assert B.status_str(12345) == "unknown status"


def _hf_hidden_states(hf_dir: Path, tokens: list[int]) -> list[np.ndarray]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_taps_match_transformers_hidden_states(models, arch):
    hf, gguf = models.target(arch)
    with Model(gguf) as m, Context(m, ContextOptions(n_ctx=256, n_batch=64, n_ubatch=16)) as ctx:
        tokens = m.tokenize(PROMPT)
        layers = list(range(m.n_layer))          # every tappable layer, 0 = the embeddings
        B.check(B.lib.llama_dflash_set_taps(ctx.cptr, layers, len(layers), True), "set taps")
        for lid in layers:
            assert B.lib.llama_dflash_tap_enabled(ctx.cptr, lid) == 1
        # n_ubatch 16 < prompt: the taps of several ubatches must come back in batch order
        ctx.decode(np.array(tokens, np.int32), 0, out_row0=len(tokens))
        n = len(tokens)
        assert B.lib.llama_dflash_tap_rows(ctx.cptr) == n
        out = np.zeros((n, len(layers) * m.n_embd), np.float32)
        B.check(B.lib.llama_dflash_get_taps(ctx.cptr, layers, len(layers), 0, n,
                                            B.ffi.from_buffer("float[]", out), out.size), "get taps")
        ref = _hf_hidden_states(hf, tokens)
        # llama.cpp keeps K/V in f16 by default, so layers past the first differ from the float32
        # reference at the 1e-3 level; an off-by-one layer differs at the 1e-1 level.
        def rel(a, b):
            return float(np.linalg.norm(a - b) / np.linalg.norm(b))

        for k, lid in enumerate(layers):
            got = out[:, k * m.n_embd:(k + 1) * m.n_embd]
            assert rel(got, ref[lid]) < 5e-3, f"tap {lid} != hidden_states[{lid}] ({rel(got, ref[lid]):.2e})"
            if lid == 0:
                np.testing.assert_allclose(got, ref[0], rtol=1e-6, atol=1e-6)   # embeddings: exact
            assert rel(got, ref[lid + 1]) > 0.1, f"tap {lid} also matches hidden_states[{lid + 1}]"
        # a row range in the middle, one layer
        part = np.zeros((3, m.n_embd), np.float32)
        B.check(B.lib.llama_dflash_get_taps(ctx.cptr, [2], 1, 5, 3, B.ffi.from_buffer("float[]", part), part.size), "")
        np.testing.assert_array_equal(part, out[5:8, 2 * m.n_embd:3 * m.n_embd])


def test_direct_taps_read_the_graph(models):
    """patches/0010: direct taps give the copied taps' bytes for one-ubatch decodes, nothing for longer."""
    _, gguf = models.target("qwen3")
    layers = [1, 2, 3]
    with Model(gguf) as m, Context(m, ContextOptions(n_ctx=256, n_batch=64, n_ubatch=16)) as a, \
            Context(m, ContextOptions(n_ctx=256, n_batch=64, n_ubatch=16)) as b:
        tokens = np.array(m.tokenize(PROMPT), np.int32)
        assert len(tokens) > 16
        for ctx in (a, b):
            B.check(B.lib.llama_dflash_set_taps(ctx.cptr, layers, len(layers), True), "set taps")
        assert B.lib.llama_dflash_set_taps_direct(b.cptr, True) == 0     # returns the previous mode
        assert B.lib.llama_dflash_set_taps_direct(b.cptr, True) == 1

        def taps(ctx, row0, n):
            out = np.zeros((n, len(layers) * m.n_embd), np.float32)
            B.check(B.lib.llama_dflash_get_taps(ctx.cptr, layers, len(layers), row0, n,
                                                B.ffi.from_buffer("float[]", out), out.size), "get taps")
            return out

        # the prompt in one-ubatch chunks, then single rows: the same bytes either way
        for off in range(0, len(tokens), 16):
            chunk = tokens[off:off + 16]
            for ctx in (a, b):
                ctx.decode(chunk, off, out_row0=len(chunk))
            assert B.lib.llama_dflash_tap_rows(b.cptr) == len(chunk)
            np.testing.assert_array_equal(taps(b, 0, len(chunk)), taps(a, 0, len(chunk)))
            np.testing.assert_array_equal(taps(b, 2, 3), taps(a, 2, 3))
        # a decode of several ubatches: copied taps have every row, direct taps none (an error, not a wrong row)
        n = len(tokens)
        for ctx in (a, b):
            ctx.clear()
            ctx.decode(tokens, 0, out_row0=n)
        assert B.lib.llama_dflash_tap_rows(a.cptr) == n and B.lib.llama_dflash_tap_rows(b.cptr) == 0
        with pytest.raises(RowRangeError):
            taps(b, 0, 1)
        # back to copies: the next decode's rows are readable again, and equal
        assert B.lib.llama_dflash_set_taps_direct(b.cptr, False) == 1
        for ctx in (a, b):
            ctx.clear()
            ctx.decode(tokens, 0, out_row0=n)
        np.testing.assert_array_equal(taps(b, 0, n), taps(a, 0, n))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen35"])
def test_capped_taps_keep_the_last_rows(models, arch):
    """patches/0011: a cap keeps the last rows of each ubatch's taps (the same bytes as the copies);
    earlier rows are an error, never a wrong row. The cap needs direct taps; turning those off drops it."""
    _, gguf = models.target(arch)
    layers = [1, 2, 3]
    cap = 5
    with Model(gguf) as m, Context(m, ContextOptions(n_ctx=256, n_batch=64, n_ubatch=16)) as a, \
            Context(m, ContextOptions(n_ctx=256, n_batch=64, n_ubatch=16)) as c:
        tokens = np.array(m.tokenize(PROMPT * 2), np.int32)
        assert len(tokens) > 34
        for ctx in (a, c):
            B.check(B.lib.llama_dflash_set_taps(ctx.cptr, layers, len(layers), True), "set taps")
        with pytest.raises(InvalidArgumentError):       # copies read every row: no cap without direct taps
            B.check(B.lib.llama_dflash_set_tap_rows_max(c.cptr, cap), "cap without direct taps")
        with pytest.raises(InvalidArgumentError):
            B.check(B.lib.llama_dflash_set_tap_rows_max(c.cptr, -1), "negative cap")
        B.lib.llama_dflash_set_taps_direct(c.cptr, True)
        assert B.lib.llama_dflash_set_tap_rows_max(c.cptr, cap) == 0     # returns the previous cap
        assert B.lib.llama_dflash_set_tap_rows_max(c.cptr, cap) == cap

        def taps(ctx, row0, n):
            out = np.zeros((n, len(layers) * m.n_embd), np.float32)
            B.check(B.lib.llama_dflash_get_taps(ctx.cptr, layers, len(layers), row0, n,
                                                B.ffi.from_buffer("float[]", out), out.size), "get taps")
            return out

        pos = 0
        for n in (16, 3, cap, 9, 1):          # longer and shorter than the cap
            chunk = tokens[pos:pos + n]
            for ctx in (a, c):
                ctx.decode(chunk, pos, out_row0=len(chunk))
            pos += len(chunk)
            k = min(cap, len(chunk))
            assert B.lib.llama_dflash_tap_rows(c.cptr) == len(chunk)
            np.testing.assert_array_equal(taps(c, len(chunk) - k, k), taps(a, len(chunk) - k, k))
            np.testing.assert_array_equal(taps(c, len(chunk) - 1, 1), taps(a, len(chunk) - 1, 1))
            if len(chunk) > cap:
                with pytest.raises(RowRangeError):
                    taps(c, len(chunk) - k - 1, 2)
                with pytest.raises(RowRangeError):
                    taps(c, 0, 1)
        # direct taps off: the cap goes with them, every row of the next decode is readable again
        assert B.lib.llama_dflash_set_taps_direct(c.cptr, False) == 1
        assert B.lib.llama_dflash_set_tap_rows_max(c.cptr, 0) == 0
        for ctx in (a, c):
            ctx.clear()
            ctx.decode(tokens[:16], 0, out_row0=16)
        np.testing.assert_array_equal(taps(c, 0, 16), taps(a, 0, 16))


def test_tap_errors_are_codes_not_aborts(models):
    _, gguf = models.target("qwen3")
    with Model(gguf) as m, Context(m, ContextOptions(n_ctx=128, n_batch=32, n_ubatch=32)) as ctx:
        tokens = np.array(m.tokenize(PROMPT)[:10], np.int32)
        buf = np.zeros(64 * m.n_embd, np.float32)
        fb = B.ffi.from_buffer("float[]", buf)

        def get(layers, row0, n_rows, size=buf.size):
            B.check(B.lib.llama_dflash_get_taps(ctx.cptr, layers, len(layers), row0, n_rows, fb, size), "get taps")

        with pytest.raises(LayerError):
            B.check(B.lib.llama_dflash_set_taps(ctx.cptr, [m.n_layer], 1, True), "tap the final layer")
        with pytest.raises(LayerError):
            B.check(B.lib.llama_dflash_set_taps(ctx.cptr, [-1], 1, True), "negative layer")
        B.check(B.lib.llama_dflash_set_taps(ctx.cptr, [1, 2], 2, True), "set taps")
        with pytest.raises(RowRangeError):          # no decode yet
            get([1], 0, 1)
        ctx.decode(tokens, 0, out_row0=len(tokens))
        get([1, 2], 0, 10)
        with pytest.raises(RowRangeError):
            get([1], 5, 6)
        with pytest.raises(RowRangeError):
            get([1], -1, 2)
        with pytest.raises(TapDisabledError):
            get([3], 0, 1)
        with pytest.raises(LayerError):
            get([99], 0, 1)
        with pytest.raises(BufferTooSmallError):
            get([1, 2], 0, 10, size=10)
        # disabling works and is reported
        B.check(B.lib.llama_dflash_set_taps(ctx.cptr, [2], 1, False), "disable")
        assert B.lib.llama_dflash_tap_enabled(ctx.cptr, 2) == 0
        # a failed decode leaves no readable rows
        with pytest.raises(DFlashError):
            ctx.decode(np.array([10**6], np.int32), 10)
        assert B.lib.llama_dflash_tap_rows(ctx.cptr) in (0, 10)


def test_drafter_info_and_pair_checks(models):
    pair = models.pair("qwen3", "dflash", 8)
    import json
    cfg = json.loads((pair.drafter_hf / "config.json").read_text())
    with Model(pair.target) as tm, Model(pair.drafter) as dm:
        info = B.ffi.new("struct llama_dflash_drafter_info *")
        B.check(B.lib.llama_dflash_get_drafter_info(dm.cptr, info), "info")
        assert info.kind == 1 and info.block_size == 8 and info.causal == 0
        assert info.mask_token == cfg["dflash_config"]["mask_token_id"]
        taps = [info.target_layers[i] for i in range(info.n_target_layers)]
        assert taps == [t + 1 for t in cfg["dflash_config"]["target_layer_ids"]]   # the +1 convention
        with pytest.raises(NotADrafterError):
            B.check(B.lib.llama_dflash_get_drafter_info(tm.cptr, info), "target is no drafter")

        tc = Context(tm, ContextOptions(n_ctx=128, n_batch=32, n_ubatch=32))
        lone = Context(dm, ContextOptions(n_ctx=128, n_batch=32, n_ubatch=32), other=tc)
        B.check(B.lib.llama_dflash_prepare(tc.cptr, lone.cptr, B.ffi.NULL), "good pair")
        for lid in taps:
            assert B.lib.llama_dflash_tap_enabled(tc.cptr, lid) == 1
        with pytest.raises(NotADrafterError):
            B.check(B.lib.llama_dflash_prepare(lone.cptr, tc.cptr, B.ffi.NULL), "swapped")
        lone.close()
        tc.close()


class _Lines(logging.Handler):
    """Collects llama.cpp's log lines (routed to logging by conftest's set_log_handler)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _load_logged(path: Path) -> tuple[Model, str]:
    lg = logging.getLogger("dflash_gguf.llama_cpp")
    h, old = _Lines(), lg.level
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG)
    try:
        m = Model(path)
    finally:
        lg.removeHandler(h)
        lg.setLevel(old)
    return m, "\n".join(h.lines)


def test_drafter_vocab_is_ids_only(models):
    """patches/0009: a drafter's vocabulary keeps ids, texts and special ids, not a tokenizer."""
    pair = models.pair("qwen35", "dflash", 8)       # the GPT-2 byte-level BPE: 50,000 merges
    tm, tlog = _load_logged(pair.target)
    dm, dlog = _load_logged(pair.drafter)
    with tm, dm:
        merges = lambda log: [int(x) for x in re.findall(r"n_merges\s*=\s*(\d+)", log)]  # noqa: E731
        assert merges(tlog) == [50000] and merges(dlog) == [0]
        assert dm.n_vocab == tm.n_vocab
        # what pair checks compare (upstream's included): texts, attributes and special ids
        for fn in (C.llama_vocab_bos, C.llama_vocab_eos):
            assert fn(dm.vocab) == fn(tm.vocab)
        for t in range(0, tm.n_vocab, 97):
            assert C.llama_vocab_get_text(dm.vocab, t) == C.llama_vocab_get_text(tm.vocab, t)
            assert C.llama_vocab_get_attr(dm.vocab, t) == C.llama_vocab_get_attr(tm.vocab, t)
        # without a piece cache, pieces are made from the token's text: same bytes as the target
        for t in tm.tokenize(b" parse(self, args):\n", add_bos=False):
            assert dm.token_bytes(t) == tm.token_bytes(t)
        # patches/0012: its text -> id map is released after loading; tokenizing gives no tokens, not an abort
        assert tm.tokenize(b" parse(self, args):\n", add_bos=False)
        assert dm.tokenize(b" parse(self, args):\n", add_bos=False) == []


def test_prepare_refuses_drafter_of_other_hidden_size(models, tmp_path):
    import tiny

    other_t = tiny.make_target(tmp_path / "t96", models.tok, "qwen3", hidden=96, head_dim=24)
    other_d = tiny.make_drafter(tmp_path / "d96", other_t)
    d_gguf = tiny.upstream_convert(other_d, tmp_path / "d96.gguf", target_dir=other_t)
    _, t_gguf = models.target("qwen3")
    with Model(t_gguf) as tm, Model(d_gguf) as dm:
        tc = Context(tm, ContextOptions(n_ctx=64, n_batch=32, n_ubatch=32))
        # refused before llama.cpp creates the drafter context (it would abort the process)
        with pytest.raises(PairMismatchError, match="hidden size 96.*dflash_gguf.convert"):
            Context(dm, ContextOptions(n_ctx=64, n_batch=32, n_ubatch=32), other=tc)
        tc.close()


@pytest.mark.parametrize("field, delta", [("n_vocab", -1), ("n_vocab", 1), ("n_embd", -32), ("n_embd", 32)],
                         ids=["smaller vocabulary", "larger vocabulary", "narrower", "wider"])
def test_a_drafter_of_another_vocabulary_or_width_is_refused(monkeypatch, field, delta):
    """A drafter whose vocabulary (its tokenizer's: a reduced draft head maps into it by d2t) or hidden size
    is not the target's is refused before any context exists, smaller as well as larger."""
    from dataclasses import replace

    from dflash_gguf.native.engine import DrafterInfo, check_compatible

    with Model(paths.DEMO_DIR / "target.gguf") as tm, Model(paths.DEMO_DIR / "drafter.gguf") as dm:
        real = DrafterInfo.read(dm)
        check_compatible(tm, dm)
        other = replace(real, **{field: getattr(real, field) + delta})
        monkeypatch.setattr(DrafterInfo, "read", classmethod(lambda cls, m: other))
        what = "vocabulary" if field == "n_vocab" else "hidden size"
        with pytest.raises(PairMismatchError, match=f"{what}.*{getattr(other, field)}.*dflash_gguf.convert"):
            check_compatible(tm, dm)


def _import_in_subprocess(tmp_path: Path, prelude: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(prelude) + "\nimport dflash_gguf.native._bindings\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))


def test_import_refuses_unpatched_library(tmp_path):
    # a stand-in llama_cpp whose "libllama" is a library without the llama_dflash_* API
    other = next(Path(B.LIBRARY_PATH).parent.glob("libggml-base*"))
    pkg = tmp_path / "llama_cpp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "llama_cpp.py").write_text(f"class _L:\n    _name = {str(other)!r}\n_lib = _L()\n")
    r = _import_in_subprocess(tmp_path, "")
    assert r.returncode != 0
    assert "BuildMismatchError" in r.stderr and "unpatched" in r.stderr
    assert "python -m dflash_gguf.build" in r.stderr


def test_import_refuses_stale_patch_series(tmp_path):
    r = _import_in_subprocess(tmp_path, """
        import dflash_gguf.paths as p
        p.patch_series_hash = lambda: "0" * 64
    """)
    assert r.returncode != 0
    assert "another patch series" in r.stderr and "python -m dflash_gguf.build" in r.stderr


def test_decode_argmax_ids_are_each_rows_first_largest_logit():
    """llama_dflash_decode's (and decode_seqs') argmax ids (patch 0021: block maxima, then the one block
    that holds the row's maximum scanned in order) are numpy's argmax of the same logits rows: the
    first index of the largest value, on the demo target's 4,096 logits (8 blocks) and every row of a
    16-row decode, one sequence and two."""
    from dflash_gguf.demo import demo_pair

    tm = Model(demo_pair()[0])
    try:
        ctx = Context(tm, ContextOptions(n_ctx=256, n_batch=64, n_ubatch=64, n_seq=2, n_threads=1))
        toks = np.array(tm.tokenize(PROMPT, add_bos=False)[:16], dtype=np.int32)
        assert tm.n_vocab == 4096 and len(toks) == 16
        ids = np.full(16, -1, dtype=np.int32)
        ctx.decode(toks, 0, out_row0=0, argmax=ids, seq=0)
        want = [int(np.argmax(ctx.logits_row(i))) for i in range(16)]
        assert ids.tolist() == want and len(set(want)) > 3
        ids2 = np.full(24, -1, dtype=np.int32)
        ctx.decode_seqs(np.array([0, 1], dtype=np.int32), np.array([16, 0], dtype=np.int32),
                        np.array([8, 16], dtype=np.int32), np.concatenate([toks[:8], toks]), ids2)
        assert ids2.tolist() == [int(np.argmax(ctx.logits_row(i))) for i in range(24)]
        assert ids2[8:].tolist() == want          # sequence 1 saw what sequence 0 saw alone
        ctx.close()
    finally:
        tm.close()


def test_a_handle_is_freed_after_the_handles_that_use_it(models):
    """Closing (or collecting: a reference cycle's objects, a script's globals at exit, are finalized
    in no set order) a model before its contexts, or a target context before the drafter context
    that borrows its tensors, only marks it: it is freed with the last handle that uses it, and
    those keep working until then."""
    pair = models.pair("qwen3", "dflash", 8)
    tm, dm = Model(pair.target), Model(pair.drafter)
    tc = Context(tm, ContextOptions(n_ctx=128, n_batch=32, n_ubatch=32))
    dc = Context(dm, ContextOptions(n_ctx=128, n_batch=32, n_ubatch=32), other=tc)
    B.check(B.lib.llama_dflash_prepare(tc.cptr, dc.cptr, B.ffi.NULL), "pair")
    tm.close()
    tc.close()
    assert tm.ptr is not None and tc.ptr is not None, "freed while a context (and a drafter) still use them"
    toks = np.array(tm.tokenize(PROMPT), dtype=np.int32)
    am = np.zeros(len(toks), dtype=np.int32)
    B.check(B.lib.llama_dflash_decode(tc.cptr, 0, 0, B.ffi.from_buffer("llama_token[]", toks), len(toks), 0,
                                      B.ffi.from_buffer("llama_token[]", am)), "decode on a closed-early target")
    assert (am >= 0).all() and (am < tm.n_vocab).all()
    dc.close()   # the last user: the target context goes, then its model
    assert dc.ptr is None and tc.ptr is None and tm.ptr is None
    assert dm.ptr is not None   # nothing closed it
    dm.close()
    assert dm.ptr is None
    tm.close(), tc.close()   # closing again is a no-op
