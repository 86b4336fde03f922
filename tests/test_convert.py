"""python -m dflash_gguf.convert: pair validation, conversion, quantization, manifest, --check.

Conversions run the real upstream converter on the tiny HF checkpoints of the ``models``
fixture (a few seconds each); the failure-path tests replace the converter by a copy of the
fixture's GGUFs so they stay fast.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tiny
from dflash_gguf.convert import (ConvertError, ManifestError, OutputError, PairError, check_pair, convert_pair,
                                 load_manifest, validate_pair)
from dflash_gguf.convert import manifest as mf
from dflash_gguf.convert import pipeline, upstream

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- helpers / fixtures
@pytest.fixture(scope="module")
def pairs(models, tmp_path_factory):
    """Converted pair directories, made once per module: pairs(arch, kind, **convert_kw)."""
    root = tmp_path_factory.mktemp("pairs")
    cache = {}

    def get(arch="qwen3", kind="dflash", **kw):
        kw.setdefault("outtype", "f32")
        key = (arch, kind, tuple(sorted(kw.items())))
        if key not in cache:
            p = models.pair(arch, kind, 8)
            out = root / "-".join([arch, kind] + [f"{k}_{v}" for k, v in sorted(kw.items())])
            cache[key] = (convert_pair(p.target_hf, p.drafter_hf, out, threads=1, **kw), p)
        return cache[key]
    return get


@pytest.fixture
def hf(models, tmp_path):
    """Writable copies of the tiny HF folders: hf(kind) -> (target_dir, drafter_dir)."""
    def get(kind="dflash"):
        p = models.pair("qwen3", kind, 8)
        t, d = tmp_path / "target", tmp_path / f"drafter-{kind}"
        if not t.exists():
            shutil.copytree(p.target_hf, t)
        shutil.copytree(p.drafter_hf, d)
        return t, d
    return get


def edit_config(folder: Path, fn) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    fn(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


def assert_nothing_written(out: Path, keep: set[str] | None = None) -> None:
    """No partial pair: OUT is absent (or unchanged) and no staging directory is left next to it."""
    if keep is None:
        assert not out.exists(), f"{out} was left behind"
    else:
        assert {p.name for p in out.iterdir()} == keep
    if out.parent.exists():
        left = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
        assert not left, f"staging left behind: {left}"


def run_cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_gguf.convert", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def fake_converter(monkeypatch, models):
    """Replace the upstream converter by a copy of the fixture's (already converted) GGUFs."""
    p = models.pair("qwen3", "dflash", 8)

    def fake(hf_dir, out_file, outtype, *, target_dir=None, threads=None, what="model"):
        shutil.copyfile(p.drafter if target_dir is not None else p.target, out_file)
    monkeypatch.setattr(upstream, "run_converter", fake)
    return p


# ---------------------------------------------------------------- good pairs
@pytest.mark.parametrize("arch,kind", [("qwen3", "dflash"), ("llama", "dflash"), ("qwen3", "dflash2")])
def test_convert_pair_manifest_and_load(pairs, arch, kind):
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import Model

    m, p = pairs(arch, kind)
    assert (m.kind, m.block_size, m.target_layers) == (kind, 8, [1, 3])
    assert m.mask_token_id == tiny.mask_token_id(p.target_hf / "tokenizer.model")
    assert m.data["hf_target_layer_ids"] == [0, 2]
    assert (m.target.type, m.drafter.type) == ("f32", "f32")
    assert m.data["target"]["source"] == str(p.target_hf.resolve())
    assert m.data["drafter"]["source"] == str(p.drafter_hf.resolve())
    conv = m.data["converter"]
    assert conv["llama_cpp_python_sdist"] == "0.3.36" and len(conv["patch_series"]) == 64 and conv["dflash_gguf"]
    assert sorted(x.name for x in m.dir.iterdir()) == sorted([m.target.path.name, m.drafter.path.name, "pair.json"])
    again = load_manifest(m.dir, verify=True)
    assert again.target.sha256 == mf.sha256_file(m.target.path) and again.target.size == m.target.path.stat().st_size
    # upstream's converter did the work: byte-identical to converting with it directly
    assert mf.sha256_file(m.target.path) == mf.sha256_file(p.target)
    assert mf.sha256_file(m.drafter.path) == mf.sha256_file(p.drafter)
    with Model(m.target.path) as t, Model(m.drafter.path) as d:
        assert t.arch == arch and d.arch == "dflash"
        info = B.ffi.new("struct llama_dflash_drafter_info *")
        B.check(B.lib.llama_dflash_get_drafter_info(d.cptr, info), "drafter info")
        assert list(info.target_layers[0:info.n_target_layers]) == m.target_layers
        assert (info.block_size, info.mask_token, info.n_embd) == (8, m.mask_token_id, t.n_embd)
        assert info.kind == {"dflash": 1, "dflash2": 2}[kind]


def test_check_passes_on_good_pairs(pairs):
    for arch, kind in [("qwen3", "dflash"), ("llama", "dflash"), ("qwen3", "dflash2")]:
        m, _ = pairs(arch, kind)
        r = check_pair(m.dir, n_tokens=24, threads=1)
        assert r.ok and r.n_tokens == 24, r.message
        assert r.message.startswith("PASS") and "\n" not in r.message


# ---------------------------------------------------------------- llama.cpp vs an independent reference
def _llama_block_logits(m, tokens, block, flash_attn=None, out_row0=0):
    """Target prefill, feature injection, the noise block on the drafter, then a llama_dflash_draft.

    Returns (GGUF tap layers, taps [P, n_taps, H], logits of block rows out_row0.., drafted ids).
    """
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import Context, ContextOptions, Model

    with Model(m.target.path) as tm, Model(m.drafter.path) as dm:
        opts = ContextOptions(n_ctx=128, n_threads=1, flash_attn=flash_attn)
        with Context(tm, opts) as tc, Context(dm, opts, other=tc) as dc:
            info = B.ffi.new("struct llama_dflash_drafter_info *")
            B.check(B.lib.llama_dflash_prepare(tc.cptr, dc.cptr, info), "prepare")
            layers = list(info.target_layers[0:info.n_target_layers])
            P = len(tokens)
            tc.decode(np.asarray(tokens, np.int32), 0, out_row0=P)
            taps = np.zeros((P, len(layers) * tm.n_embd), np.float32)
            B.check(B.lib.llama_dflash_get_taps(tc.cptr, B.ffi.from_buffer("int32_t[]", np.asarray(layers, np.int32)),
                                                len(layers), 0, P, B.ffi.from_buffer("float[]", taps), taps.size),
                    "get taps")
            B.check(B.lib.llama_dflash_inject(dc.cptr, tc.cptr, 0, 0, 0, P), "inject")
            dc.decode(np.asarray(block, np.int32), P, out_row0=out_row0)
            logits = np.stack([dc.logits_row(i).copy() for i in range(out_row0, len(block))])
            dc.truncate(P)
            draft = np.zeros(len(block) - 1, np.int32)
            n = B.check(B.lib.llama_dflash_draft(dc.cptr, 0, P, block[0], len(block) - 1,
                                                 B.ffi.from_buffer("llama_token[]", draft)), "draft")
    return layers, taps.astype(np.float64).reshape(P, len(layers), -1), logits, draft[:n]


@pytest.fixture(scope="module")
def reference_case(pairs):
    from reference_dflash import DFlashReference, TargetHF

    def run(arch):
        m, p = pairs(arch, "dflash")
        ref = DFlashReference(p.drafter_hf)
        tgt = TargetHF(p.target_hf)
        tokens = [1] + np.random.default_rng(0).integers(4, tiny.VOCAB_SIZE, 15).tolist()
        block = [int(tokens[5])] + [ref.mask] * (m.block_size - 1)
        return m, p, ref, tgt, tokens, block
    return run


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_drafter_logits_match_reference(reference_case, arch):
    from reference_dflash import DFlashReference

    m, p, ref, tgt, tokens, block = reference_case(arch)
    hs = tgt.hidden_states(tokens)
    layers, taps, logits, _ = _llama_block_logits(m, tokens, block)     # every block row an output
    # 1. taps: GGUF layer i = input of layer i = HF hidden_states[i] (= output of HF layer i-1)
    assert layers == [t + 1 for t in ref.layer_ids]
    for j, li in enumerate(layers):
        scale = np.abs(hs[li]).max()
        err = np.abs(taps[:, j] - hs[li]).max()
        assert err < 1e-2 * scale, f"tap {li}: {err} vs scale {scale}"
        for wrong in (li - 1, li + 1):        # an off-by-one would be far away
            assert np.abs(taps[:, j] - hs[wrong]).max() > 20 * err
    # 2. end to end: HF hidden states -> reference drafter vs llama.cpp (F16 KV caches on both sides)
    want = ref.block_logits(ref.context(hs), block, tgt.embed, tgt.lm_head)
    scale = np.abs(want[1:]).max()
    err = np.abs(logits[1:] - want[1:]).max()
    assert err < 3e-3 * scale, f"block logits differ by {err} (scale {scale})"
    # 3. the drafter alone, tightly: same tap features, the F16 KV cache and F16 attention modelled
    exact = DFlashReference(p.drafter_hf, kv_dtype=np.float16)
    _, taps, logits_nofa, _ = _llama_block_logits(m, tokens, block, flash_attn=False)
    hs_llama = list(hs)
    for j, li in enumerate(layers):
        hs_llama[li] = taps[:, j]
    want = exact.block_logits(exact.context(hs_llama), block, tgt.embed, tgt.lm_head)
    err = np.abs(logits_nofa[1:] - want[1:]).max()
    assert err < 1e-4 * scale, f"drafter forward differs by {err} (scale {scale})"


def test_draft_proposals_are_argmax_of_block_rows(reference_case):
    """Regression: llama_dflash_draft once flagged outputs for rows 1..n only, and the DFlash graph does
    not select output rows, so each proposal was the argmax of the row before (shifted by one)."""
    m, p, ref, tgt, tokens, block = reference_case("qwen3")
    _, _, logits, draft = _llama_block_logits(m, tokens, block)
    assert draft.tolist() == logits[1:].argmax(-1).tolist()


def test_drafter_decode_with_out_row0(reference_case):
    """llama_dflash_decode makes every row of a drafter block an output (the DFlash graph does not
    select output rows), so out_row0 > 0 still returns the rows asked for."""
    m, p, ref, tgt, tokens, block = reference_case("qwen3")
    _, _, all_rows, _ = _llama_block_logits(m, tokens, block, out_row0=0)
    _, _, from_1, _ = _llama_block_logits(m, tokens, block, out_row0=1)
    np.testing.assert_allclose(from_1, all_rows[1:], atol=1e-4)


# ---------------------------------------------------------------- quantized pairs
# quantized pairs crashed at the first decode with ggml's AMX path before patches/0006 (tests/test_amx.py)
@pytest.mark.parametrize("qtype,ftype", [("q4_0", 2)])
def test_quantized_pair_is_lossless(pairs, qtype, ftype):
    from dflash_gguf.native.engine import Model

    m, _ = pairs("qwen3", "dflash", quantize=qtype)
    assert (m.target.type, m.drafter.type) == (qtype, qtype)
    assert not [x for x in m.dir.iterdir() if x.name.startswith(".")], "intermediate file left"
    with Model(m.target.path) as t:
        assert t.meta("general.file_type") == str(ftype)
    r = check_pair(m.dir, n_tokens=32, threads=1)
    assert r.ok and r.n_tokens == 32, r.message


def test_cli_convert_q8_0_then_check(models, tmp_path):
    from dflash_gguf.native.engine import Model

    p = models.pair("qwen3", "dflash", 8)
    out = tmp_path / "q8"
    r = run_cli(p.target_hf, p.drafter_hf, "-o", out, "--outtype", "f32", "--quantize", "q8_0",
                "--drafter-outtype", "f16", "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert "pair written to" in r.stderr
    m = load_manifest(out, verify=True)
    assert (m.target.type, m.drafter.type) == ("q8_0", "f16")
    with Model(m.target.path) as t, Model(m.drafter.path) as d:
        assert (t.meta("general.file_type"), d.meta("general.file_type")) == ("7", "1")
    r = run_cli("--check", out, "--threads", "1", "--tokens", "16")   # a fresh process on the quantized pair
    assert r.returncode == 0 and r.stdout.startswith("PASS"), r.stdout + r.stderr


def test_cli_check_verdict(pairs):
    m, _ = pairs("qwen3", "dflash")
    r = run_cli("--check", m.dir, "--threads", "1", "--tokens", "16")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("PASS") and "16 tokens" in r.stdout and len(r.stdout.strip().splitlines()) == 1


def test_plan_recipes():
    t, d = pipeline.plan("f16", "q4_0", None)
    assert (t.convert_type, t.quantize_type, d) == ("f16", "q4_0", t)
    t, d = pipeline.plan("f32", "q4_k_m", "q8_0")
    assert (d.convert_type, d.quantize_type, d.final_type) == ("q8_0", None, "q8_0")
    t, d = pipeline.plan("f16", None, "q4_0")
    assert (t.quantize_type, d.convert_type, d.quantize_type) == (None, "f16", "q4_0")
    assert pipeline.plan("f16", "f16", None)[0].quantize_type is None
    with pytest.raises(ValueError, match="from --outtype q8_0"):
        pipeline.plan("q8_0", "q4_0", None)


# ---------------------------------------------------------------- --check failures
def test_check_fails_on_damaged_pairs(pairs, tmp_path):
    m, _ = pairs("qwen3", "dflash")
    good = tmp_path / "good"
    shutil.copytree(m.dir, good)

    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    f = truncated / m.drafter.path.name
    f.write_bytes(f.read_bytes()[:-1000])
    flipped = tmp_path / "flipped"
    shutil.copytree(good, flipped)
    f = flipped / m.target.path.name
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    missing = tmp_path / "missing"
    shutil.copytree(good, missing)
    (missing / m.target.path.name).unlink()
    no_manifest = tmp_path / "no-manifest"
    shutil.copytree(good, no_manifest)
    (no_manifest / "pair.json").unlink()

    for d, why in [(truncated, "truncated"), (flipped, "sha256"), (missing, "missing"), (no_manifest, "pair.json")]:
        r = check_pair(d)
        assert not r.ok and why in r.message, r.message
    r = run_cli("--check", flipped)
    assert r.returncode == 1 and r.stdout.startswith("FAIL"), r.stdout + r.stderr
    with pytest.raises(ManifestError, match="truncated"):
        load_manifest(truncated)
    load_manifest(flipped)                      # sizes match: only verify=True reads the bytes
    with pytest.raises(ManifestError, match="sha256"):
        load_manifest(flipped, verify=True)


# ---------------------------------------------------------------- bad inputs
def _rewrite_safetensors(folder: Path, fn) -> None:
    from safetensors.numpy import load_file, save_file

    f = folder / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


def _truncate(folder: Path, n: int = 100) -> None:
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-n])


def _patch_bytes(folder: Path, at: int, data: bytes) -> None:
    f = folder / "model.safetensors"
    b = bytearray(f.read_bytes())
    b[at:at + len(data)] = data
    f.write_bytes(bytes(b))


def _set(key, value, nested=False):
    def fn(cfg):
        (cfg["dflash_config"] if nested else cfg)[key] = value
    return fn


def _drop(key, nested=False):
    def fn(cfg):
        target = cfg["dflash_config"] if nested else cfg
        target.pop(key, None)
        if not nested:
            cfg.get("dflash_config", {}).pop(key, None)
    return fn


BAD = {
    # name: (drafter kind, mutate(target_dir, drafter_dir) -> (target_dir, drafter_dir), message)
    "target missing": ("dflash", lambda t, d: (t / "nope", d), "does not exist"),
    "drafter is a file": ("dflash", lambda t, d: (t, d / "config.json"), "not a directory"),
    "no config.json": ("dflash", lambda t, d: ((d / "config.json").unlink(), (t, d))[1], "no config.json"),
    "config not JSON": ("dflash", lambda t, d: ((t / "config.json").write_text("{oops"), (t, d))[1], "not valid JSON"),
    "unsupported target": ("dflash", lambda t, d: (edit_config(t, _set("architectures", ["GPT2LMHeadModel"])), (t, d))[1],
                           "cannot feed a DFlash drafter"),
    "dspark of another backbone": ("dflash", lambda t, d: (edit_config(d, _set("architectures",
                                                                              ["DeepseekV4DSparkModel"])), (t, d))[1],
                                   "DeepSeek-V4 backbone"),
    "unknown drafter": ("dflash", lambda t, d: (edit_config(d, _set("architectures", ["EagleModel"])), (t, d))[1],
                        "not supported"),
    "swapped folders": ("dflash", lambda t, d: (d, t), "holds a drafter"),
    "target as drafter": ("dflash", lambda t, d: (t, t), "holds a target model"),
    "no tokenizer": ("dflash", lambda t, d: ((t / "tokenizer.model").unlink(), (t, d))[1], "no tokenizer"),
    "truncated safetensors": ("dflash", lambda t, d: (_truncate(d), (t, d))[1], "truncated"),
    "truncated target": ("dflash", lambda t, d: (_truncate(t, 5000), (t, d))[1], "truncated"),
    "bad header length": ("dflash", lambda t, d: (_patch_bytes(d, 0, b"\xff" * 8), (t, d))[1],
                          "not a valid safetensors"),
    "garbage header": ("dflash", lambda t, d: (_patch_bytes(d, 8, b"\x00\x01garbage"), (t, d))[1], "not valid JSON"),
    "trailing bytes": ("dflash", lambda t, d: ((d / "model.safetensors").open("ab").write(b"x" * 64), (t, d))[1],
                       "after the last tensor"),
    "missing tensor": ("dflash", lambda t, d: (_rewrite_safetensors(d, lambda w: w.pop("layers.0.mlp.up_proj.weight")),
                                               (t, d))[1], "lacks tensor 'layers.0.mlp.up_proj.weight'"),
    "vocab mismatch": ("dflash", lambda t, d: (edit_config(d, _set("vocab_size", 1024)), (t, d))[1], "vocab_size"),
    "hidden mismatch": ("dflash", lambda t, d: (edit_config(d, _set("hidden_size", 128)), (t, d))[1], "hidden_size"),
    # a drafter narrower than its target is as wrong as a wider one
    "smaller vocab": ("dflash", lambda t, d: (edit_config(d, _set("vocab_size", 256)), (t, d))[1],
                      "drafter vocab_size 256 != target vocab_size 512"),
    "smaller hidden": ("dflash", lambda t, d: (edit_config(d, _set("hidden_size", 32)), (t, d))[1],
                       "drafter hidden_size 32 != target hidden_size 64"),
    "tap of the last layer": ("dflash", lambda t, d: (edit_config(d, _set("target_layer_ids", [0, 3], True)), (t, d))[1],
                              "outside 0..2"),
    "negative tap": ("dflash", lambda t, d: (edit_config(d, _set("target_layer_ids", [-1, 2], True)), (t, d))[1],
                     "outside 0..2"),
    "no taps": ("dflash", lambda t, d: (edit_config(d, _drop("target_layer_ids")), (t, d))[1], "no target_layer_ids"),
    "mask outside vocab": ("dflash", lambda t, d: (edit_config(d, _set("mask_token_id", 512, True)), (t, d))[1],
                           "outside the vocabulary"),
    "no mask": ("dflash", lambda t, d: (edit_config(d, _drop("mask_token_id", True)), (t, d))[1], "mask_token_id"),
    "block size 1": ("dflash", lambda t, d: (edit_config(d, _set("block_size", 1, True)), (t, d))[1], "outside [2, 64]"),
    "block size 65": ("dflash", lambda t, d: (edit_config(d, _set("block_size", 65, True)), (t, d))[1],
                      "outside [2, 64]"),
    "fc shape": ("dflash", lambda t, d: (edit_config(d, _set("target_layer_ids", [0, 1, 2], True)), (t, d))[1],
                 "fc.weight has shape"),
    "dflash2 field missing": ("dflash2", lambda t, d: (edit_config(d, _drop("selector_top_k", True)), (t, d))[1],
                              "selector_top_k"),
    "dflash2 group": ("dflash2", lambda t, d: (edit_config(d, _set("conv_group_size", 48, True)), (t, d))[1],
                      "not a multiple of conv_group_size"),
    "dflash2 top_k": ("dflash2", lambda t, d: (edit_config(d, _set("selector_top_k", 8, True)), (t, d))[1],
                      "too large"),
    "dflash2 no selector": ("dflash2", lambda t, d: (_rewrite_safetensors(
        d, lambda w: w.pop("candidate_selector.successor_codebook")), (t, d))[1], "successor_codebook"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_before_any_work(hf, tmp_path, monkeypatch, case):
    kind, mutate, message = BAD[case]
    t, d = mutate(*hf(kind))
    monkeypatch.setattr(upstream, "run_converter", lambda *a, **k: pytest.fail("converter ran on a bad pair"))
    out = tmp_path / "out" / "pair"
    with pytest.raises(PairError, match=re.escape(message)) as e:
        convert_pair(t, d, out)
    assert isinstance(e.value, ValueError)
    assert_nothing_written(out)


def test_good_copies_validate(hf):
    for kind in ("dflash", "dflash2"):
        spec = validate_pair(*hf(kind))
        assert (spec.kind, spec.gguf_target_layers, spec.n_layer) == (kind, [1, 3], 4)


def test_cli_reports_bad_input(hf, tmp_path):
    t, d = hf("dflash")
    out = tmp_path / "out"
    r = run_cli(d, t, "-o", out)
    assert r.returncode == 1 and "error: " in r.stderr and "holds a drafter" in r.stderr, r.stderr
    assert_nothing_written(out)
    r = run_cli(t, d)
    assert r.returncode == 2 and "-o OUT_DIR" in r.stderr


# ---------------------------------------------------------------- output directory and failures
def test_output_under_a_regular_file(hf, tmp_path, fake_converter):
    t, d = hf("dflash")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = blocker / "sub" / "pair"
    with pytest.raises(OutputError, match="cannot create"):
        convert_pair(t, d, out)
    assert blocker.read_text() == "x"
    with pytest.raises(OutputError, match="not a directory"):
        convert_pair(t, d, blocker)


def test_output_not_empty_or_existing_pair(hf, tmp_path, fake_converter):
    t, d = hf("dflash")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(OutputError, match="not empty"):
            convert_pair(t, d, busy, force=force)
    assert_nothing_written(busy, keep={"notes.txt"})

    out = tmp_path / "pair"
    first = convert_pair(t, d, out)
    with pytest.raises(OutputError, match="already holds a pair"):
        convert_pair(t, d, out)
    second = convert_pair(t, d, out, force=True)
    assert second.data["created"] >= first.data["created"]
    assert_nothing_written(out, keep={"pair.json", first.target.path.name, first.drafter.path.name})
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_pair(t, d, empty)
    load_manifest(empty, verify=True)


def test_disk_full_leaves_nothing(hf, tmp_path, monkeypatch, fake_converter):
    t, d = hf("dflash")
    disk = {"full": True}
    real_write = mf.write_manifest

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(*a, **k):
        return full() if disk["full"] else real_write(*a, **k)
    monkeypatch.setattr(mf, "write_manifest", write)
    out = tmp_path / "new"
    with pytest.raises(OutputError, match="disk full") as e:
        convert_pair(t, d, out)
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
    assert_nothing_written(out)

    # an existing pair survives a failed --force replacement (here the quantizer's write fails)
    disk["full"] = False
    old = convert_pair(t, d, tmp_path / "old")
    before = {p.name: p.read_bytes() for p in old.dir.iterdir()}
    monkeypatch.setattr(pipeline, "quantize_file", full)
    with pytest.raises(OutputError, match="disk full"):
        convert_pair(t, d, old.dir, force=True, quantize="q4_0")
    assert {p.name: p.read_bytes() for p in old.dir.iterdir()} == before
    assert_nothing_written(old.dir, keep=set(before))


def test_a_failed_final_rename_keeps_the_old_pair(hf, tmp_path, monkeypatch, fake_converter):
    """--force swaps the new pair in by renames: when the last one (the new pair into place) fails, the old
    pair is back where it was, byte for byte, and nothing else is left beside it."""
    t, d = hf("dflash")
    old = convert_pair(t, d, tmp_path / "pair")
    before = {p.name: p.read_bytes() for p in old.dir.iterdir()}
    rename = os.rename

    def failing(src, dst, *a, **k):
        if Path(src).name.startswith(".pair.partial-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return rename(src, dst, *a, **k)
    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OutputError, match="nothing was left behind"):
        convert_pair(t, d, old.dir, force=True)
    assert {p.name: p.read_bytes() for p in old.dir.iterdir()} == before
    assert_nothing_written(old.dir, keep=set(before))
    load_manifest(old.dir, verify=True)


def test_space_precheck(hf, tmp_path, monkeypatch, fake_converter):
    t, d = hf("dflash")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(1 << 30, 1 << 30, 1000))
    out = tmp_path / "pair"
    with pytest.raises(OutputError, match="not enough disk space"):
        convert_pair(t, d, out)
    assert_nothing_written(out)


def test_converter_failure_leaves_nothing(hf, tmp_path, monkeypatch):
    t, d = hf("dflash")
    script = tmp_path / "convert_hf_to_gguf.py"
    script.write_text("import sys\nprint('loading model')\nprint('OSError: [Errno 28] No space left on device')\n"
                      "open(sys.argv[sys.argv.index('--outfile') + 1], 'wb').write(b'GGUF partial')\nsys.exit(1)\n")
    monkeypatch.setattr(upstream, "converter_script", lambda: script)
    out = tmp_path / "pair"
    with pytest.raises(ConvertError, match="(?s)failed on the target.*disk is full.*No space left"):
        convert_pair(t, d, out)
    assert_nothing_written(out)
