"""The catalogue of known pairs (``convert/*.json``): every entry passes the converter's validation on
synthetic checkpoints of its shapes (config.json + safetensors headers over sparse files, no
downloads), and ``--list`` / ``--recipe`` work from the command line."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.recipes import Recipe, catalogue, catalogue_dir, check_against
from dflash_gguf.convert.validate import validate_pair
from support import pair  # noqa: F401 (fixture)

CATALOGUE = catalogue()


def write_safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A valid safetensors file whose data is a hole: the header is real, the bytes are never written."""
    header, off = {}, 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + off)


def synthetic(recipe: Recipe, root: Path, **drafter_overrides) -> tuple[Path, Path]:
    """Target and drafter folders with the recipe's shapes; fields it does not know get plausible values."""
    t = recipe.target
    hidden, vocab, n_layer = t.hidden_size, t.vocab_size, t.num_hidden_layers
    tdir, ddir = root / "target", root / "drafter"
    tdir.mkdir(parents=True)
    ddir.mkdir(parents=True)
    (tdir / "config.json").write_text(json.dumps({"architectures": [t.architecture], "hidden_size": hidden,
                                                  "num_hidden_layers": n_layer, "vocab_size": vocab}))
    (tdir / "tokenizer.json").write_text("{}")
    write_safetensors(tdir / "model.safetensors", {"model.embed_tokens.weight": [vocab, hidden]})
    n_draft = recipe.drafter.num_hidden_layers or 5
    ids = recipe.target_layer_ids or [1 + i * (n_layer - 4) // 4 for i in range(5)]
    cfg = {"architectures": [recipe.drafter.architecture], "hidden_size": hidden, "vocab_size": vocab,
           "num_hidden_layers": n_draft, "num_target_layers": n_layer, "block_size": recipe.block_size or 16,
           "dflash_config": {"mask_token_id": recipe.mask_token_id if recipe.mask_token_id is not None else vocab - 1,
                             "target_layer_ids": ids}}
    cfg.update(drafter_overrides)
    (ddir / "config.json").write_text(json.dumps(cfg))
    shapes = {"fc.weight": [hidden, len(ids) * hidden], "hidden_norm.weight": [hidden], "norm.weight": [hidden]}
    for i in range(n_draft):
        for s in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            shapes[f"layers.{i}.{s}.weight"] = [hidden]
        for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"):
            shapes[f"layers.{i}.{s}.weight"] = [hidden, hidden]
    write_safetensors(ddir / "model.safetensors", shapes)
    return tdir, ddir


def test_catalogue_has_entries_with_sources():
    assert catalogue_dir().name == "convert" and (catalogue_dir() / "README.md").is_file()
    assert len(CATALOGUE) >= 3
    for r in CATALOGUE.values():
        assert r.sources and r.target.repo.count("/") == 1 and r.drafter.repo.count("/") == 1
        assert r.target.hidden_size and r.target.vocab_size and r.target.num_hidden_layers
        assert r.name in (catalogue_dir() / "README.md").read_text(), f"{r.name} missing from convert/README.md"


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_every_entry_passes_validation(name, tmp_path):
    r = CATALOGUE[name]
    spec = validate_pair(*synthetic(r, tmp_path))
    check_against(r, spec)
    assert spec.kind == r.kind and max(spec.gguf_target_layers) <= spec.n_layer - 1
    if r.block_size is not None:
        assert spec.block_size == r.block_size


def test_a_checkpoint_that_contradicts_its_recipe_is_refused(tmp_path):
    r = CATALOGUE["qwen3-8b-dflash-b16"]
    spec = validate_pair(*synthetic(r, tmp_path, block_size=8))
    with pytest.raises(PairError, match="block_size: recipe 16, checkpoint 8"):
        check_against(r, spec)


def _convert(args, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_gguf.convert", *args], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, **env))


def test_list_and_recipe_from_local_folders(pair, tmp_path):
    r = _convert(["--list"])
    assert r.returncode == 0, r.stderr
    for name in CATALOGUE:
        assert name in r.stdout
    assert "unknown:" in r.stdout
    # the tiny test pair is not Qwen3-8B: refused before any conversion, naming the differences
    r = _convert(["--recipe", "qwen3-8b-dflash-b16", str(pair.target_hf), str(pair.drafter_hf), "-o",
                  str(tmp_path / "out")])
    assert r.returncode == 1 and "do not match recipe qwen3-8b-dflash-b16" in r.stderr, r.stderr
    assert "hidden_size: recipe 4096" in r.stderr and not (tmp_path / "out").exists()
    r = _convert(["--recipe", "no-such-pair", "-o", str(tmp_path / "out")])
    assert r.returncode == 2 and "no recipe 'no-such-pair'" in r.stderr


def test_recipe_from_the_hub_offline_says_what_is_missing(tmp_path):
    r = _convert(["--recipe", "qwen3-8b-dflash-b16", "-o", str(tmp_path / "out")],
                 HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty-cache"))
    assert r.returncode == 1 and "Qwen/Qwen3-8B" in r.stderr and "HF_HUB_OFFLINE=1" in r.stderr, r.stderr
