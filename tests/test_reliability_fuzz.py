"""Hostile model files: no mutated GGUF or pair manifest makes a loader crash or raise an untyped error.

The fuzzer (``python -m dflash_gguf.reliability.fuzz``) runs every case in a child process, so an
abort or a segfault shows as a crash instead of killing the test run. CI runs a bounded sample;
RELIABILITY.md has the full run. The targeted tests below pin each class of file that crashed the
process before the Python pre-validation (``dflash_gguf.native.gguf_check``) existed.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflash_gguf.errors import ModelFileError, PairMismatchError
from dflash_gguf.native.gguf_check import T_STRING, T_UINT32, check_gguf, check_manifest, parse_gguf
from dflash_gguf.reliability import fuzz, mutate

pytestmark = [pytest.mark.reliability, pytest.mark.slow]

DEMO = Path(fuzz.DEMO_DIR)


def _run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def _with_kv(src: Path, dst: Path, key: str, raw: bytes | None) -> Path:
    """``src`` with key ``key`` replaced by the raw entry ``raw`` (removed when None; added when absent)."""
    data = src.read_bytes()
    h = parse_gguf(src)
    kvs = [data[kv.start:kv.end] for kv in h.kv_list if kv.key != key]
    if raw is not None:
        kvs.append(raw)
    dst.write_bytes(mutate.rebuild(data, h, kvs, [data[t.start:t.end] for t in h.tensors]))
    return dst


def test_fuzz_sample_no_crash(models, tmp_path):
    """A bounded sample over every mutation class, on the demo pair and a tiny DFlash2 pair."""
    p = models.pair("qwen3", "dflash2", 8)
    bases = fuzz.default_bases() + [fuzz.Base("tiny-qwen3-dflash2-b8", p.target, p.drafter)]
    rep = fuzz.run(bases, 60, seed=1, timeout=120)
    print(fuzz.summary(rep))
    assert rep["cases"] == 60
    assert len(rep["per_class"]) >= 15, rep["per_class"]
    assert rep["verdicts"].get("crash", 0) == 0, fuzz.summary(rep)
    assert rep["verdicts"].get("timeout", 0) == 0, fuzz.summary(rep)
    assert rep["verdicts"].get("untyped", 0) == 0, fuzz.summary(rep)
    # the unmutated cases that must still work do: data flips load, sha256 mismatches are refused by verify
    assert rep["verdicts"].get("typed", 0) > 30


def test_fuzz_generates_300_cases():
    """The full run (--full) covers at least 300 mutated files on the demo pair alone."""
    cases = fuzz.build_cases(fuzz.default_bases(), seed=0, scale=3)
    assert len(cases) >= 300
    assert {"truncate-boundary", "truncate-random", "header", "kv-flip", "tensor-info-flip", "tensor-type",
            "tensor-shape", "absurd-count", "hparam", "kv-remove", "kv-retype", "dflash-field",
            "pair"} <= {c.cls for c in cases}


# ----------------------------------------------------------------------------- crash classes, one by one
# Each of these aborted the Python process inside llama.cpp (GGML_ASSERT in llama_model::load_hparams ->
# SIGABRT) before the pre-validation; now Model() and Llama() raise ModelFileError.
CRASHERS = {
    "block_count 0": ("target", "qwen3.block_count", lambda: mutate.kv_raw("qwen3.block_count", T_UINT32, 0)),
    "block_count 600": ("target", "qwen3.block_count", lambda: mutate.kv_raw("qwen3.block_count", T_UINT32, 600)),
    "drafter block_count 0": ("drafter", "dflash.block_count", lambda: mutate.kv_raw("dflash.block_count", T_UINT32, 0)),
    "expert_used_count without experts": ("target", "qwen3.expert_used_count",
                                          lambda: mutate.kv_raw("qwen3.expert_used_count", T_UINT32, 2)),
    "expert_count above the limit": ("target", "qwen3.expert_count",
                                     lambda: mutate.kv_raw("qwen3.expert_count", T_UINT32, 100000)),
    "unknown rope scaling type": ("target", "qwen3.rope.scaling.type",
                                  lambda: mutate.kv_raw("qwen3.rope.scaling.type", T_STRING, "cubic")),
    "more MTP layers than layers": ("target", "qwen3.nextn_predict_layers",
                                    lambda: mutate.kv_raw("qwen3.nextn_predict_layers", T_UINT32, 99)),
}


@pytest.mark.parametrize("name", sorted(CRASHERS))
def test_crasher_is_a_typed_error(name, tmp_path):
    role, key, raw = CRASHERS[name]
    d = tmp_path / "pair"
    d.mkdir()
    for r in ("target", "drafter"):
        src = DEMO / f"{r}.gguf"
        if r == role:
            _with_kv(src, d / f"{r}.gguf", key, raw())
        else:
            (d / f"{r}.gguf").write_bytes(src.read_bytes())
    with pytest.raises(ModelFileError):
        check_gguf(d / f"{role}.gguf", role=role)
    r = _run_child(f"""
        from dflash_gguf.errors import ModelFileError
        from dflash_gguf.native.engine import Model
        from dflash_gguf.api import Llama
        for fn in (lambda: Model({str(d / f'{role}.gguf')!r}),
                   lambda: Llama({str(d / 'target.gguf')!r}, draft_model_path={str(d / 'drafter.gguf')!r}, verbose=False)):
            try:
                fn()
            except ModelFileError as e:
                print("typed:", e)
            else:
                print("loaded")
    """)
    assert r.returncode == 0, f"child died with {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.count("typed:") == 2, r.stdout + r.stderr[-2000:]


def test_swapped_manifest_is_refused(tmp_path):
    from dflash_gguf.api import pair_files

    doc = json.loads((DEMO / "pair.json").read_text())
    d = tmp_path / "p"
    d.mkdir()
    for r in ("target", "drafter"):
        (d / f"{r}.gguf").write_bytes((DEMO / f"{r}.gguf").read_bytes())
    doc["target"]["file"], doc["drafter"]["file"] = "target.gguf", "drafter.gguf"
    doc["block_size"] = 16
    (d / "pair.json").write_text(json.dumps(doc))
    with pytest.raises(PairMismatchError, match="block_size"):
        pair_files(d)
    doc["block_size"] = 8
    doc["target"], doc["drafter"] = doc["drafter"], doc["target"]
    (d / "pair.json").write_text(json.dumps(doc))
    with pytest.raises(PairMismatchError, match="swapped"):
        pair_files(d)
    with pytest.raises(ModelFileError, match="drafter, not a target"):
        check_gguf(d / "drafter.gguf", role="target")
    with pytest.raises(ModelFileError, match="must be 'dflash'"):
        check_gguf(d / "target.gguf", role="drafter")
    check_manifest(json.loads((DEMO / "pair.json").read_text()), DEMO / "drafter.gguf")


def test_parser_bounds(tmp_path):
    """Absurd counts and lengths are refused by the parser without reading or allocating them."""
    data = (DEMO / "drafter.gguf").read_bytes()
    for off, val in ((8, 2 ** 63), (16, 2 ** 62)):
        f = tmp_path / f"m{off}.gguf"
        f.write_bytes(data[:off] + struct.pack("<Q", val) + data[off + 8:])
        with pytest.raises(ModelFileError, match="cannot fit"):
            parse_gguf(f)
    f = tmp_path / "short.gguf"
    f.write_bytes(data[:10])
    with pytest.raises(ModelFileError, match="truncated"):
        parse_gguf(f)
