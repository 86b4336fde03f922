"""DSpark drafters through ``python -m dflash_gguf.convert``: every published config form converts, and
what the pinned graph cannot run is refused before any work, naming the field or tensor.

The forms (``dflash_gguf/convert/dspark.py``) are built from one tiny DSpark checkpoint
(``tiny.make_drafter(kind="dspark")``) by rewriting its config.json and tensor names:

* DeepSpec's flat config (``Qwen3DSparkModel``, the target's config copied flat, its own copies of
  the target's ``embed_tokens`` / ``lm_head``), with and without a Markov head (``markov_rank: 0``);
* a vLLM speculators export (``DSparkSpeculator``, ``transformer_layer_config``,
  ``aux_hidden_state_layer_ids``, ``sample_from_anchor``), also with a reduced vocabulary (``d2t``);
* the nested ``DSparkDraftModel`` with its DSpark fields in ``dflash_config``.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import tiny
from dflash_gguf.convert import PairError, convert_pair, load_manifest, validate_pair
from dflash_gguf.convert import upstream
from dflash_gguf.native.gguf_check import check_manifest

RANK = 8


# ---------------------------------------------------------------- building the forms
def _load(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return dict(load_file(str(folder / "model.safetensors")))


def _save(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _write_config(folder: Path, cfg: dict) -> None:
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def _target_embeddings(target: Path) -> np.ndarray:
    return _load(target)["model.embed_tokens.weight"]       # the tiny Qwen3 target ties its head to it


def deepspec(src: Path, target: Path, out: Path, *, markov: bool = True) -> Path:
    """DeepSpec's build_draft_config: the config flat, the target's embeddings and head copied in."""
    shutil.copytree(src, out)
    cfg, t = _config(out), _load(out)
    dcfg = cfg.pop("dflash_config")
    for k in ("sample_from_anchor",):               # not a DeepSpec field: every slot predicts there
        cfg.pop(k)
    cfg.update(architectures=["Qwen3DSparkModel"], block_size=dcfg["block_size"],
               target_layer_ids=dcfg["target_layer_ids"], mask_token_id=dcfg["mask_token_id"], num_anchors=512,
               tie_word_embeddings=False)
    if not markov:                                  # DeepSpec's DFlash drafters
        cfg.update(markov_rank=0, enable_confidence_head=False)
        cfg.pop("markov_head_type"), cfg.pop("confidence_head_with_markov")
        t = {n: w for n, w in t.items() if not n.startswith(("markov_head.", "confidence_head."))}
    emb = _target_embeddings(target)
    t.update({"embed_tokens.weight": emb.copy(), "lm_head.weight": emb.copy()})
    _write_config(out, cfg)
    _save(out, t)
    return out


def speculators(src: Path, target: Path, out: Path, *, anchor: bool = False, draft_vocab: int | None = None) -> Path:
    """A speculators export: the decoder's config nested, taps as hidden_states indices, its own vocabulary."""
    shutil.copytree(src, out)
    cfg, t = _config(out), _load(out)
    dcfg = cfg.pop("dflash_config")
    shape_keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta",
                  "max_position_embeddings", "hidden_act")
    tlc = {k: cfg[k] for k in shape_keys}
    emb = _target_embeddings(target)
    vocab, block = emb.shape[0], dcfg["block_size"]
    new = {"architectures": ["DSparkSpeculator"], "speculators_model_type": "dspark", "transformer_layer_config": tlc,
           "aux_hidden_state_layer_ids": [i + 1 for i in dcfg["target_layer_ids"]],
           "mask_token_id": dcfg["mask_token_id"], "block_size": block, "draft_vocab_size": draft_vocab or vocab,
           "sample_from_anchor": anchor, "markov_rank": RANK, "markov_head_type": "vanilla",
           "enable_confidence_head": True, "confidence_head_with_markov": True,
           "speculators_config": {"algorithm": "dspark", "default_proposal_method": "greedy", "proposal_methods": [
               {"proposal_type": "greedy", "speculative_tokens": block if anchor else block - 1}]}}
    t["embed_tokens.weight"] = emb.copy()
    if draft_vocab:     # speculators' DraftVocabMixin: d2t holds offsets, t2d marks the kept target ids
        ids = np.sort(np.random.default_rng(3).choice(vocab, draft_vocab, replace=False)).astype(np.int64)
        t.update({"lm_head.weight": emb[ids].copy(), "d2t": ids - np.arange(draft_vocab, dtype=np.int64),
                  "t2d": np.isin(np.arange(vocab), ids)})
        t["markov_head.markov_w2.weight"] = t["markov_head.markov_w2.weight"][ids].copy()
    else:
        t["lm_head.weight"] = emb.copy()
    _write_config(out, new)
    _save(out, t)
    return out


def nested(src: Path, out: Path, *, shift_label: bool | None = True) -> Path:
    """DSparkDraftModel with the DSpark fields in dflash_config (SpecForge's names)."""
    shutil.copytree(src, out)
    cfg = _config(out)
    for k in ("markov_rank", "markov_head_type", "sample_from_anchor", "enable_confidence_head",
              "confidence_head_with_markov"):
        cfg.pop(k)
    cfg["dflash_config"].update(projector_type="dspark", markov_rank=RANK, markov_head_type="vanilla",
                                use_confidence_head=True, confidence_head_with_markov=True)
    if shift_label is not None:
        cfg["dflash_config"]["shift_label"] = shift_label
    _write_config(out, cfg)
    return out


@pytest.fixture(scope="module")
def base(models, tmp_path_factory):
    """(target HF dir, the tiny z-lab DSpark drafter) and a scratch root for the forms."""
    t, _ = models.target("qwen3")
    root = tmp_path_factory.mktemp("dspark-forms")
    return t, tiny.make_drafter(root / "zlab", t, kind="dspark", block_size=8, markov_rank=RANK), root


def _gguf(path: Path):
    import gguf     # the vendored gguf-py the build installs

    r = gguf.GGUFReader(str(path))
    kv = {f.name: f.contents() for f in r.fields.values()}
    tensors = {t.name: [int(x) for x in t.shape] for t in r.tensors}
    return kv, tensors


def _convert(t: Path, d: Path, out: Path, **kw):
    m = convert_pair(t, d, out, outtype="f32", threads=1, **kw)
    kv, tensors = _gguf(m.drafter.path)
    return m, kv, tensors


# ---------------------------------------------------------------- every form converts
FORMS = {
    # name: (make(src, target, root) -> drafter dir, sample_from_anchor, reduced head rows or None)
    "deepspec": (lambda s, t, r: deepspec(s, t, r / "deepspec"), True, None),
    "speculators bonus slot": (lambda s, t, r: speculators(s, t, r / "spec"), False, None),
    "speculators from anchor": (lambda s, t, r: speculators(s, t, r / "spec-anchor", anchor=True), True, None),
    "speculators reduced vocab": (lambda s, t, r: speculators(s, t, r / "spec-d2t", draft_vocab=64), False, 64),
    "nested": (lambda s, t, r: nested(s, r / "nested"), True, None),
    "nested unshifted": (lambda s, t, r: nested(s, r / "nested-unshifted", shift_label=False), False, None),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_each_published_form_converts_to_a_dspark_gguf(base, tmp_path, form):
    t, src, root = base
    make, anchor, rows = FORMS[form]
    d = make(src, t, root)
    m, kv, tensors = _convert(t, d, tmp_path / "pair")
    vocab, hidden = _config(t)["vocab_size"], _config(t)["hidden_size"]
    # the Markov head and the confidence head, in ggml's order (ne0 first): markov_w1 {R, vocab}
    assert tensors["markov_w1.weight"] == [RANK, vocab]
    assert tensors["markov_w2.weight"] == [RANK, rows or vocab]
    assert tensors["conf_proj.weight"] == [hidden + RANK, 1]
    assert kv["dflash.sample_from_anchor"] is anchor and kv["dflash.has_confidence_head"] is True
    assert kv["dflash.block_size"] == 8 and list(kv["dflash.target_layers"]) == [1, 3]
    # the drafter's own copies of the target's embeddings are gone: it borrows the target's
    assert "token_embd.weight" not in tensors
    if rows:        # a reduced head stays the drafter's own, with its d2t map
        assert tensors["output.weight"] == [hidden, rows] and tensors["d2t"] == [rows]
    else:
        assert "output.weight" not in tensors and "d2t" not in tensors
    assert (m.kind, m.data["sample_from_anchor"], m.data["dspark"]["markov_rank"]) == ("dspark", anchor, RANK)
    assert m.data["draft_vocab"]["size"] == rows
    assert load_manifest(m.dir).kind == "dspark"
    check_manifest(m.data, m.drafter.path)      # the runtime's pair check classifies the GGUF as dspark too


def test_deepspec_dflash_drafter_converts_as_dflash_with_slot_zero(base, tmp_path):
    """markov_rank 0 (DeepSpec's dflash_*_block7): a DFlash drafter whose anchor slot predicts too."""
    t, src, root = base
    d = deepspec(src, t, root / "deepspec-dflash", markov=False)
    spec = validate_pair(t, d)
    assert (spec.kind, spec.dspark.markov_rank, spec.dspark.sample_from_anchor) == ("dflash", 0, True)
    m, kv, tensors = _convert(t, d, tmp_path / "pair")
    assert m.kind == "dflash" and kv["dflash.sample_from_anchor"] is True
    assert kv["dflash.has_confidence_head"] is False
    assert not {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight", "token_embd.weight"} & set(tensors)
    assert any("slot 0 predicts" in n for n in m.data["notes"])


def test_a_dspark_head_keeps_the_vocabulary_it_was_trained_with(base, tmp_path):
    t, src, root = base
    d = nested(src, root / "nested-vocab")
    with pytest.raises(PairError, match="--draft-vocab 32: a DSpark drafter keeps the draft vocabulary"):
        convert_pair(t, d, tmp_path / "pair", draft_vocab=32)
    assert not (tmp_path / "pair").exists()


# ---------------------------------------------------------------- what cannot run is refused
def _edit(folder: Path, fn) -> Path:
    cfg = _config(folder)
    fn(cfg)
    _write_config(folder, cfg)
    return folder


def _tensors(folder: Path, fn) -> Path:
    t = _load(folder)
    fn(t)
    _save(folder, t)
    return folder


def _perturb_row(name: str, row: int):
    def fn(t):
        t[name] = t[name].copy()
        t[name][row] += 0.5
    return fn


BAD = {
    # name: (form, mutate(drafter dir), message naming the field / tensor)
    "gated markov head": ("deepspec", lambda d: _edit(d, lambda c: c.update(markov_head_type="gated")),
                          "markov_head_type: 'gated' is not supported"),
    "rnn markov head (nested)": ("nested", lambda d: _edit(d, lambda c: c["dflash_config"].update(
        markov_head_type="rnn")), "dflash_config.markov_head_type: 'rnn' is not supported"),
    "gated head tensor": ("deepspec", lambda d: _tensors(d, lambda t: t.update({
        "markov_head.gate_proj.weight": np.zeros((RANK, 64 + RANK), np.float32)})), "markov_head.gate_proj.weight"),
    "block sizes disagree": ("nested", lambda d: _edit(d, lambda c: c.update(block_size=7)),
                             "block_size: 7 disagrees with dflash_config.block_size: 8"),
    "no block size": ("deepspec", lambda d: _edit(d, lambda c: c.pop("block_size")), "has no block_size"),
    "speculative_tokens disagree": ("speculators", lambda d: _edit(d, lambda c: c["speculators_config"][
        "proposal_methods"][0].update(speculative_tokens=3)), "speculative_tokens: 3 disagrees with block_size: 8"),
    "missing markov_w2": ("deepspec", lambda d: _tensors(d, lambda t: t.pop("markov_head.markov_w2.weight")),
                          "lacks tensor 'markov_head.markov_w2.weight'"),
    "markov rank disagrees": ("deepspec", lambda d: _edit(d, lambda c: c.update(markov_rank=16)),
                              "markov_head.markov_w1.weight has shape [512, 8], expected [512, 16]"),
    "markov_w1 mis-shaped": ("nested", lambda d: _tensors(d, lambda t: t.update({
        "markov_head.markov_w1.weight": t["markov_head.markov_w1.weight"][:100].copy()})),
        "markov_head.markov_w1.weight has shape [100, 8]"),
    "confidence head mis-shaped": ("deepspec", lambda d: _tensors(d, lambda t: t.update({
        "confidence_head.proj.weight": np.zeros((1, 64), np.float32)})),
        "confidence_head.proj.weight has shape [1, 64], expected [1, 72]"),
    "confidence head missing": ("speculators", lambda d: _tensors(d, lambda t: t.pop("confidence_head.proj.weight")),
                                "enable_confidence_head: true but the checkpoint lacks tensor"),
    "confidence without markov": ("deepspec", lambda d: _edit(d, lambda c: c.update(confidence_head_with_markov=False)),
                                  "confidence_head_with_markov: false is not supported"),
    "markov tensors with rank 0": ("deepspec", lambda d: _edit(d, lambda c: c.update(
        markov_rank=0, enable_confidence_head=False)), "markov_rank is 0 but the checkpoint has"),
    "embeddings of another target": ("deepspec", lambda d: _tensors(d, _perturb_row("embed_tokens.weight", 7)),
                                     "own embed_tokens.weight differs from the target's (row 7"),
    "lm head of another target": ("speculators", lambda d: _tensors(d, _perturb_row("lm_head.weight", 300)),
                                  "own lm_head.weight differs from the target's (row 300"),
    "embeddings of another shape": ("deepspec", lambda d: _tensors(d, lambda t: t.update({
        "embed_tokens.weight": t["embed_tokens.weight"][:, :32].copy()})), "own embed_tokens.weight has shape [512, 32]"),
    "no mask token (speculators)": ("speculators", lambda d: _edit(d, lambda c: c.pop("mask_token_id")),
                                    "mask_token_id"),
    "sample_from_anchor not a bool": ("speculators", lambda d: _edit(d, lambda c: c.update(sample_from_anchor="yes")),
                                      "sample_from_anchor: 'yes' is not true or false"),
    "reduced vocab without d2t": ("speculators-d2t", lambda d: _tensors(d, lambda t: t.pop("d2t")),
                                  "draft_vocab_size: 64 is smaller than the vocabulary (512) but the checkpoint "
                                  "has no d2t"),
}


def _make(form: str, src: Path, t: Path, root: Path) -> Path:
    if form == "deepspec":
        return deepspec(src, t, root)
    if form == "speculators":
        return speculators(src, t, root)
    if form == "speculators-d2t":
        return speculators(src, t, root, draft_vocab=64)
    return nested(src, root)


@pytest.mark.parametrize("case", list(BAD))
def test_what_the_graph_cannot_run_is_refused_before_any_work(base, tmp_path, monkeypatch, case):
    t, src, _ = base
    form, mutate, message = BAD[case]
    d = mutate(_make(form, src, t, tmp_path / "drafter"))
    monkeypatch.setattr(upstream, "run_converter", lambda *a, **k: pytest.fail("converter ran on a bad pair"))
    out = tmp_path / "out" / "pair"
    with pytest.raises(PairError, match=re.escape(message)):
        convert_pair(t, d, out)
    assert not out.exists()
    assert not out.parent.exists() or not list(out.parent.glob(".pair.*")), "staging left behind"


def test_bf16_copies_of_the_embeddings_count_as_equal(base, tmp_path):
    """A drafter saved in bf16 with the target in f32: equal up to one bf16 rounding, so dropped."""
    t, src, _ = base
    d = deepspec(src, t, tmp_path / "drafter")
    st = _load(d)
    from safetensors.numpy import save_file

    def bf16(a: np.ndarray) -> np.ndarray:      # round to nearest even, kept as its raw 16 bits
        u = a.astype(np.float32).view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    raw = {n: w for n, w in st.items() if n not in ("embed_tokens.weight", "lm_head.weight")}
    save_file(raw, str(d / "model.safetensors"))
    # append the two as BF16 by rewriting the header (safetensors.numpy has no bfloat16)
    _append_bf16(d / "model.safetensors", {n: bf16(st[n]) for n in ("embed_tokens.weight", "lm_head.weight")})
    spec = validate_pair(t, d)
    assert spec.dspark.embeddings_dropped and spec.overlay["has_embed_tokens"] is False


def _append_bf16(path: Path, extra: dict[str, np.ndarray]) -> None:
    import struct

    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    data = bytearray(blob[8 + n:])
    for name, bits in extra.items():
        b = len(data)
        data += bits.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(bits.shape), "data_offsets": [b, len(data)]}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + bytes(data))
