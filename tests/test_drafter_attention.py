"""Drafter configs as published: sliding windows and causality (dflash_gguf.convert.attention).

The nested config schema marks layers ``sliding_attention`` with a ``sliding_window`` size, with or
without ``use_sliding_window``; DFlash2 / Muse drafters say ``use_swa`` in ``dflash_config``. None of
these may be dropped silently, a window asked for is written to the drafter GGUF, and the engine's
default drafter window then follows it - with output still exactly the target's.
"""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from dflash_gguf.convert import attention, pipeline, upstream
from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.hf import read_checkpoint
from dflash_gguf.convert.validate import validate_pair

WINDOW = 12


def _drafter(models, tmp_path, **cfg_changes):
    p = models.pair("qwen3", "dflash", 8)
    d = tmp_path / "drafter"
    shutil.copytree(p.drafter_hf, d)
    cfg = json.loads((d / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    cfg.update({"layer_types": ["sliding_attention"] * n, "sliding_window": WINDOW})
    for k, v in cfg_changes.items():
        if v is None:
            cfg.pop(k, None)
        elif k == "dflash_config":
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return p, d


def _read(d, choice="auto"):
    ck = read_checkpoint(d, "drafter")
    return attention.read_attention(ck, ck.get("dflash_config") or {}, choice)


def test_window_without_use_sliding_window_is_never_silent(models, tmp_path, caplog):
    _, d = _drafter(models, tmp_path)
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.convert"):
        a = _read(d)
    assert a.sliding_window == 0 and a.overlay == {}
    assert any("use_sliding_window is not set" in n and "--drafter-sliding-window on" in n for n in a.notes)
    assert any("--drafter-sliding-window on" in r.getMessage() for r in caplog.records)
    on = _read(d, "on")
    assert (on.sliding_window, on.sliding_layers, on.overlay) == (WINDOW, 1, {"use_sliding_window": True})


def test_declared_window_is_kept_and_can_be_converted_away(models, tmp_path):
    _, d = _drafter(models, tmp_path, use_sliding_window=True, is_causal=False)
    a = _read(d)
    assert (a.sliding_window, a.overlay, a.causal, a.notes) == (WINDOW, {}, False, [])
    off = _read(d, "off")
    assert off.sliding_window == 0 and off.overlay == {"use_sliding_window": False}


def test_use_swa_covers_every_layer(models, tmp_path):
    _, d = _drafter(models, tmp_path, layer_types=None, sliding_window=None,
                    dflash_config={"use_swa": True, "swa_window_size": 2048}, is_causal=False)
    a = _read(d)
    assert (a.sliding_window, a.sliding_layers, a.overlay) == (2048, 1, {})
    off = _read(d, "off")
    assert off.overlay["dflash_config"]["use_swa"] is False and off.sliding_window == 0


def test_causality_note_only_where_readers_disagree(models, tmp_path):
    _, d = _drafter(models, tmp_path, use_sliding_window=True)
    assert any("no is_causal" in n and "lossless" in n for n in _read(d).notes)
    _, d2 = _drafter(models, tmp_path / "b", use_sliding_window=True, is_causal=True)
    a = _read(d2)
    assert a.causal is True and not a.notes


def test_on_without_sliding_layers_and_bad_sizes_are_refused(models, tmp_path):
    _, d = _drafter(models, tmp_path, layer_types=None, sliding_window=None)
    with pytest.raises(PairError, match="declares no sliding layers"):
        _read(d, "on")
    _, d2 = _drafter(models, tmp_path / "b", sliding_window=-4)
    with pytest.raises(PairError, match="not a positive integer"):
        _read(d2)
    with pytest.raises(ValueError, match="auto, on, off"):
        _read(d2, "yes")


def test_validate_pair_carries_the_reading_into_the_manifest(models, tmp_path, monkeypatch):
    p, d = _drafter(models, tmp_path)
    spec = validate_pair(p.target_hf, d, sliding_window="on")
    assert spec.attention.sliding_window == WINDOW
    seen = {}

    def fake(hf_dir, out_file, outtype, **kw):     # what the converter would read, without converting
        seen.setdefault("configs", []).append(json.loads((hf_dir / "config.json").read_text()))
        out_file.write_bytes(b"GGUF")
    monkeypatch.setattr(upstream, "run_converter", fake)
    monkeypatch.setattr(pipeline.dvocab, "apply", lambda *a, **k: None)
    monkeypatch.setattr(pipeline.mf, "load_manifest", lambda out: out)
    monkeypatch.setattr(pipeline, "summary", lambda m, seconds: "")
    out = tmp_path / "pair"
    pipeline.convert_pair(p.target_hf, d, out, outtype="f32", draft_vocab="off", sliding_window="on")
    target_cfg, drafter_cfg = seen["configs"]
    assert drafter_cfg["use_sliding_window"] is True
    assert target_cfg == json.loads((p.target_hf / "config.json").read_text())   # the target is read as it is
    assert "use_sliding_window" not in json.loads((d / "config.json").read_text())   # the source is untouched
    doc = json.loads((out / "pair.json").read_text())
    assert doc["drafter"]["sliding_window"] == WINDOW


def test_window_reaches_the_gguf_and_the_engine_and_output_stays_exact(models, tmp_path):
    """A real conversion with the window asked for: the GGUF carries it, the drafter's default window
    follows it (12 positions: much shorter than the prompt, so it matters), and DFlash == plain."""
    from dflash_gguf.native.engine import ContextOptions
    from dflash_gguf.native.gguf_check import parse_gguf
    from dflash_gguf.pair import open_pair

    p, d = _drafter(models, tmp_path, is_causal=False)
    a = _read(d, "on")
    out = tmp_path / "drafter-swa.gguf"
    with pipeline._config_overlay(d, a.overlay) as src:
        upstream.run_converter(src, out, "f32", target_dir=p.target_hf, what="drafter")
    h = parse_gguf(out)
    assert h.get("dflash.attention.sliding_window") == WINDOW
    with open_pair(p.target, out, ContextOptions(n_ctx=256)) as pair:
        assert pair.dctx.window == WINDOW
        prompt = pair.target.tokenize(b"def parse(text):\n    lines = text.split()\n    out = []\n" * 2)
        assert len(prompt) > 2 * WINDOW
        plain = list(pair.plain().generate(prompt, 40))
        dec = pair.decoder()
        got = list(dec.generate(prompt, 40))
    assert got == plain
