"""The catalogue of known pairs (``convert/*.json``): every entry passes the converter's validation on
synthetic checkpoints of its shapes (config.json + safetensors headers over sparse files, no
downloads), and ``--list`` / ``--recipe`` work from the command line."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.recipes import (DRAFTER_ARCHS, DSPARK_SCHEMAS, SCHEMAS, Recipe, catalogue, catalogue_dir,
                                         check_against, load)
from dflash_gguf.convert.targets import supported_targets
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


STAND_IN_TARGET = "Qwen3ForCausalLM"     # for entries whose target class no public source confirmed
DSPARK_RANK = 256                        # DeepSpec's released DSpark drafters


def drafter_config(recipe: Recipe, hidden: int, vocab: int, n_layer: int, schema: str | None) -> dict:
    """A drafter config.json with the key set of ``schema`` (legacy, nested-2026-06, dflash2) and the
    recipe's values; fields the recipe does not know get plausible ones."""
    n_draft = recipe.drafter.num_hidden_layers or 5
    ids = recipe.target_layer_ids or [1 + i * (n_layer - 4) // 4 for i in range(5)]
    mask = recipe.mask_token_id if recipe.mask_token_id is not None else vocab - 1
    block = recipe.block_size or 16
    arch = recipe.drafter.architecture or DRAFTER_ARCHS[recipe.kind][0]
    cfg = {"architectures": [arch], "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_draft,
           "num_target_layers": n_layer}
    window = recipe.drafter.sliding_window
    if schema == "legacy":
        cfg.update(block_size=block, dflash_config={"mask_token_id": mask, "target_layer_ids": ids})
    elif schema == "nested-2026-06":
        cfg.update(dflash_config={"block_size": block, "mask_token_id": mask, "target_layer_ids": ids},
                   rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
                   layer_types=["sliding_attention"] * (n_draft - 1) + ["full_attention"],
                   sliding_window=window or 4096, use_sliding_window=True)
    elif schema == "deepspec-flat":       # DeepSpec's build_draft_config: the target's config plus these
        cfg.update(architectures=[recipe.drafter.architecture or "Qwen3DSparkModel"], block_size=block,
                   target_layer_ids=ids, mask_token_id=mask, num_anchors=512, enable_confidence_head=True,
                   confidence_head_with_markov=True, markov_rank=DSPARK_RANK, markov_head_type="vanilla",
                   tie_word_embeddings=False)
    elif schema == "speculators":         # speculators' DSparkSpeculatorConfig
        cfg = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "block_size": block,
               "draft_vocab_size": vocab, "aux_hidden_state_layer_ids": [i + 1 for i in ids], "mask_token_id": mask,
               "sample_from_anchor": True, "markov_rank": DSPARK_RANK, "markov_head_type": "vanilla",
               "enable_confidence_head": True, "confidence_head_with_markov": True,
               "transformer_layer_config": {"model_type": "qwen3", "hidden_size": hidden, "vocab_size": vocab,
                                            "num_hidden_layers": n_draft}}
    elif schema == "dspark-nested":       # DSparkDraftModel with the DSpark fields in dflash_config
        cfg.update(architectures=["DSparkDraftModel"], block_size=block,
                   dflash_config={"mask_token_id": mask, "target_layer_ids": ids, "projector_type": "dspark",
                                  "markov_rank": DSPARK_RANK, "markov_head_type": "vanilla",
                                  "enable_confidence_head": True, "confidence_head_with_markov": True})
    elif schema == "dflash2":
        cfg.update(dflash_config={"block_size": block, "mask_token_id": mask, "target_layer_ids": ids,
                                  "conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 256,
                                  "selector_top_k": 16, "output_multiplier": 1.0,
                                  "final_logit_softcapping": 30.0},
                   layer_types=["sliding_attention"] * n_draft, sliding_window=window or 2048,
                   use_sliding_window=True)
    else:
        raise ValueError(schema)
    return cfg


def synthetic(recipe: Recipe, root: Path, schema: str | None = None, **drafter_overrides) -> tuple[Path, Path]:
    """Target and drafter folders with the recipe's shapes and its drafter config schema (or ``schema``)."""
    t = recipe.target
    ids = recipe.target_layer_ids or []
    hidden = t.hidden_size or 1024
    vocab = t.vocab_size or max(1000, (recipe.mask_token_id or 0) + 1)
    n_layer = t.num_hidden_layers or max([36] + [i + 2 for i in ids])
    schema = schema or recipe.schema or ("dflash2" if recipe.kind == "dflash2" else
                                         "nested-2026-06" if recipe.drafter.sliding_window else "legacy")
    tdir, ddir = root / "target", root / "drafter"
    tdir.mkdir(parents=True)
    ddir.mkdir(parents=True)
    (tdir / "config.json").write_text(json.dumps({"architectures": [t.architecture or STAND_IN_TARGET],
                                                  "hidden_size": hidden, "num_hidden_layers": n_layer,
                                                  "vocab_size": vocab}))
    (tdir / "tokenizer.json").write_text("{}")
    write_safetensors(tdir / "model.safetensors", {"model.embed_tokens.weight": [vocab, hidden]})
    cfg = drafter_config(recipe, hidden, vocab, n_layer, schema)
    cfg.update(drafter_overrides)
    (ddir / "config.json").write_text(json.dumps(cfg))
    dcfg = cfg.get("dflash_config", {})
    n_taps = len(dcfg.get("target_layer_ids") or cfg.get("target_layer_ids") or cfg.get("aux_hidden_state_layer_ids"))
    n_draft = cfg.get("num_hidden_layers") or cfg["transformer_layer_config"]["num_hidden_layers"]
    shapes = {"fc.weight": [hidden, n_taps * hidden], "hidden_norm.weight": [hidden], "norm.weight": [hidden]}
    for i in range(n_draft):
        for s in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            shapes[f"layers.{i}.{s}.weight"] = [hidden]
        for s in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                  "mlp.up_proj", "mlp.down_proj"):
            shapes[f"layers.{i}.{s}.weight"] = [hidden, hidden]
        if schema == "dflash2":
            for s in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{s}.base_kernel"] = [4]
                shapes[f"layers.{i}.{s}.kernel_projection.weight"] = [hidden // 16 * 4, hidden]
    if recipe.kind == "dspark":          # no embeddings: the sparse holes would be read to be compared
        shapes.update({"markov_head.markov_w1.weight": [vocab, DSPARK_RANK],
                       "markov_head.markov_w2.weight": [vocab, DSPARK_RANK],
                       "confidence_head.proj.weight": [1, hidden + DSPARK_RANK]})
    if schema == "dflash2":
        rank = dcfg["selector_rank"]
        shapes.update({"candidate_selector.hidden_projection.weight": [rank, hidden],
                       "candidate_selector.predecessor_codebook": [vocab, rank],
                       "candidate_selector.successor_codebook": [vocab, rank]})
    write_safetensors(ddir / "model.safetensors", shapes)
    return tdir, ddir


CONVERTED = sorted(n for n, r in CATALOGUE.items() if not r.download_only)
READY_GGUF = sorted(n for n, r in CATALOGUE.items() if r.download_only)


def _entry_param(name: str):
    """An entry whose target class the converter does not accept (not a tappable architecture of the pinned
    tree) is an expected failure: strict, so it must fail, and it starts passing when the class is accepted."""
    arch = CATALOGUE[name].target.architecture
    if arch is not None and arch not in SUPPORTED:
        return pytest.param(name, marks=pytest.mark.xfail(
            strict=True, raises=PairError,
            reason=f"the converter does not accept target class {arch}: its llama.cpp architecture is not "
                   "among the tappable ones"))
    return name


SUPPORTED = supported_targets()


def test_catalogue_has_entries_with_sources():
    assert catalogue_dir().name == "convert" and (catalogue_dir() / "README.md").is_file()
    assert len(CONVERTED) >= 10 and READY_GGUF
    readme = (catalogue_dir() / "README.md").read_text()
    for r in CATALOGUE.values():
        assert r.sources and r.target.repo.count("/") == 1 and r.drafter.repo.count("/") == 1
        assert r.schema in SCHEMAS + (None,)
        assert f"`{r.name}`" in readme, f"{r.name} missing from convert/README.md's table"
    assert {r.schema for r in CATALOGUE.values()} >= {"legacy", "dflash2"}
    # every target class an entry names is one the pinned converter converts to a tappable architecture
    assert {r.target.architecture for r in CATALOGUE.values()} - {None} <= set(SUPPORTED)


@pytest.mark.parametrize("name", [_entry_param(n) for n in CONVERTED])
def test_every_entry_passes_validation(name, tmp_path):
    r = CATALOGUE[name]
    spec = validate_pair(*synthetic(r, tmp_path))
    check_against(r, spec)
    assert spec.kind == r.kind and max(spec.gguf_target_layers) <= spec.n_layer - 1
    if r.block_size is not None:
        assert spec.block_size == r.block_size
    if r.drafter.sliding_window is not None:
        assert spec.attention.sliding_window == r.drafter.sliding_window


@pytest.mark.parametrize("schema", SCHEMAS)
def test_each_schema_key_set_passes_validation(schema, tmp_path):
    """The three key sets published drafters use, on a known pair's shapes: block size, taps and mask token
    are read from where each schema puts them."""
    dspark = schema in DSPARK_SCHEMAS
    r = CATALOGUE["qwen3.8-27b-dflash2" if schema == "dflash2" else "qwen3-8b-dspark-block7" if dspark
                  else "qwen3-8b-dflash-b16"]
    if schema in ("speculators", "dspark-nested"):  # the DeepSpec release's values in another form
        r = dataclasses.replace(r, schema=schema, drafter=dataclasses.replace(r.drafter, architecture=None))
    spec = validate_pair(*synthetic(r, tmp_path, schema=schema))
    check_against(r, spec)
    assert spec.block_size == r.block_size and spec.target_layer_ids == r.target_layer_ids
    assert spec.kind == ("dflash2" if schema == "dflash2" else "dspark" if dspark else "dflash")
    if dspark:
        assert spec.dspark.form == {"deepspec-flat": "deepspec", "dspark-nested": "nested"}.get(schema, schema)
        assert spec.dspark.markov_rank == DSPARK_RANK and spec.dspark.sample_from_anchor
    else:
        assert spec.attention.sliding_window == (0 if schema == "legacy" else r.drafter.sliding_window or 4096)


def test_a_checkpoint_that_contradicts_its_recipe_is_refused(tmp_path):
    r = CATALOGUE["qwen3-8b-dflash-b16"]
    spec = validate_pair(*synthetic(r, tmp_path, block_size=8))
    with pytest.raises(PairError, match="block_size: recipe 16, checkpoint 8"):
        check_against(r, spec)
    r = CATALOGUE["qwen3.6-27b-dflash"]
    spec = validate_pair(*synthetic(r, tmp_path / "w", sliding_window=4096))
    with pytest.raises(PairError, match="drafter sliding_window: recipe 2048, checkpoint 4096"):
        check_against(r, spec)


def test_a_window_declared_as_swa_window_size_matches_the_recipe(tmp_path):
    """DFlash2 / Muse configs may declare the window as dflash_config.swa_window_size (with use_swa)."""
    r = CATALOGUE["qwen3.8-27b-dflash2"]
    tdir, ddir = synthetic(r, tmp_path)
    cfg = json.loads((ddir / "config.json").read_text())
    del cfg["sliding_window"], cfg["use_sliding_window"]
    cfg["dflash_config"].update(use_swa=True, swa_window_size=r.drafter.sliding_window)
    (ddir / "config.json").write_text(json.dumps(cfg))
    spec = validate_pair(tdir, ddir)
    check_against(r, spec)
    assert spec.attention.sliding_window == r.drafter.sliding_window


def test_a_ready_gguf_entry_is_not_checked_as_a_conversion():
    r = CATALOGUE[READY_GGUF[0]]
    assert r.download_only and r.drafter.filename.endswith(".gguf") and r.target.gguf.repo.count("/") == 1
    with pytest.raises(PairError, match="ready GGUF drafter"):
        check_against(r, None)
    text = r.usage()
    assert (f"Llama.from_pretrained(repo_id={r.target.gguf.repo!r}, filename={r.target.gguf.filename!r}" in text
            and f"draft_repo_id={r.drafter.repo!r}, draft_filename={r.drafter.filename!r})" in text)
    assert f"-md {r.drafter.filename}" in text and "not converted" in text


def _write(root: Path, name: str, **changes) -> Path:
    d = json.loads((catalogue_dir() / "qwen3.8-27b-dflash2-gguf.json").read_text())
    d["name"] = name
    for k, v in changes.items():
        obj, *path = k.split("__")
        target = d
        for part in [obj, *path][:-1]:
            target = target[part]
        target[[obj, *path][-1]] = v
    p = root / f"{name}.json"
    p.write_text(json.dumps(d))
    return p


@pytest.mark.parametrize("changes, message", [
    ({"kind": "eagle"}, "kind 'eagle' is not one of"),
    ({"schema": "nested"}, "schema 'nested' is not null or one of"),
    ({"schema": "legacy"}, "does not fit kind 'dflash2'"),
    ({"drafter__filename": None}, "needs drafter.filename"),
    ({"drafter__format": "onnx"}, "drafter.format 'onnx' is not one of"),
    ({"drafter__repo": "incoai"}, "drafter.repo must be a Hub id"),
    ({"drafter__architecture": "DFlashDraftModel"}, "does not fit kind 'dflash2'"),
    ({"drafter__layers": 5}, "drafter has unknown field(s) layers"),
    ({"block_size": 100}, "block_size must be null or an integer 2..64"),
    ({"block_size": "8"}, "block_size must be null or an integer"),
    ({"target_layer_ids": [1, "9"]}, "target_layer_ids must be null or a non-empty list"),
    ({"recommended_quantization": "q8_0"}, "recommended_quantization must be null"),
    ({"sources": []}, "no sources"),
    ({"blocksize": 8}, "unknown field(s) blocksize"),
])
def test_load_refuses_a_malformed_entry(changes, message, tmp_path):
    assert load(_write(tmp_path, "unchanged")).download_only      # the file the changes start from loads
    with pytest.raises(ValueError, match=re.escape(message)):
        load(_write(tmp_path, "bad", **changes))


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


def test_list_and_recipe_of_a_ready_gguf_drafter(tmp_path):
    r = _convert(["--list"])
    assert r.returncode == 0, r.stderr
    name = READY_GGUF[0]
    line = next(x for x in r.stdout.splitlines() if x.startswith(name + " "))
    assert "ready GGUF, download only" in line
    entry = CATALOGUE[name]
    # nothing is fetched or converted: the answer is how to load the two files as they are
    r = _convert(["--recipe", name, "-o", str(tmp_path / "out")], HF_HUB_OFFLINE="1",
                 HF_HUB_CACHE=str(tmp_path / "empty-cache"))
    assert r.returncode == 0, r.stderr
    assert "is a ready GGUF; it is not converted, it is loaded directly" in r.stdout
    assert f"draft_repo_id={entry.drafter.repo!r}, draft_filename={entry.drafter.filename!r}" in r.stdout
    assert f"python -m dflash_gguf generate -m {entry.target.gguf.filename} -md {entry.drafter.filename}" in r.stdout
    assert not (tmp_path / "out").exists()
