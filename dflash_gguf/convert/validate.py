"""Pair validation: is this Hugging Face drafter convertible for this target, and usable by llama.cpp?

Runs before any heavy work, from config.json and the safetensors headers only.

Tap-layer convention (the one thing that is easy to get wrong):
HF ``target_layer_ids`` entry ``t`` names the OUTPUT of HF decoder layer ``t``, i.e.
``hidden_states[t + 1]`` of a transformers forward with ``output_hidden_states=True``.
llama.cpp taps the INPUT of a layer, so the converter writes ``t + 1`` to the GGUF key
``dflash.target_layers``. llama.cpp cannot tap the output of the last layer (there is no
layer after it), hence ``0 <= t <= n_layer - 2``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf.convert import dspark, targets
from dflash_gguf.convert.attention import DrafterAttention, read_attention
from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.hf import Checkpoint, has_tokenizer, read_checkpoint

log = logging.getLogger("dflash_gguf.convert")

DRAFTERS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
DSPARK = dspark.ARCHS
MAX_TAPS = 32                   # LLAMA_DFLASH_MAX_TAPS
BLOCK_MIN, BLOCK_MAX = 2, 64
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
_LAYER_TENSORS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_DFLASH2_LAYER_TENSORS = ("attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
                          "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight")


@dataclass
class PairSpec:
    """A validated pair: what the converter will write and the manifest will record."""
    target: Checkpoint
    drafter: Checkpoint
    target_arch: str            # llama.cpp architecture of the target
    kind: str                   # "dflash" | "dflash2" | "dspark"
    n_layer: int                # target decoder layers
    hidden_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]  # HF convention (output of layer t)
    attention: DrafterAttention = field(default_factory=DrafterAttention)   # window, causality, config overlay
    dspark: dspark.DSparkInfo | None = None     # a DSpark-lineage drafter (any of its published forms)

    @property
    def overlay(self) -> dict:
        """The config.json keys the upstream converter must read for the drafter (DSpark form, window)."""
        base = dict(self.dspark.overlay) if self.dspark else {}
        att = self.attention.overlay
        merged = {**base, **att}
        if "dflash_config" in base and "dflash_config" in att:
            merged["dflash_config"] = {**base["dflash_config"], **att["dflash_config"]}
        return merged

    @property
    def gguf_target_layers(self) -> list[int]:
        """``dflash.target_layers`` as written to the drafter GGUF (input of layer t+1)."""
        return [t + 1 for t in self.target_layer_ids]


def validate_pair(target_dir: str | Path, drafter_dir: str | Path, *, sliding_window: str = "auto") -> PairSpec:
    """Check a target + drafter pair; raise :class:`PairError` naming the problem and the fix.

    ``sliding_window`` (auto | on | off): how a drafter config with sliding layers is converted
    (:mod:`dflash_gguf.convert.attention`)."""
    target = read_checkpoint(target_dir, "target")
    drafter = read_checkpoint(drafter_dir, "drafter")
    target_arch = _check_target(target)
    kind = _check_drafter_arch(drafter)
    form = dspark.normalize(drafter) if kind == "dspark" else None
    n_layer = _int(target, "num_hidden_layers")
    hidden = _int(target, "hidden_size")
    vocab = _int(target, "vocab_size")
    if _int(drafter, "hidden_size") != hidden:
        raise PairError(f"drafter hidden_size {drafter.get('hidden_size')} != target hidden_size {hidden}: "
                        "llama.cpp needs equal widths. This drafter was trained for another target; use the "
                        "drafter published for this target model")
    if _int(drafter, "vocab_size") != vocab:
        raise PairError(f"drafter vocab_size {drafter.get('vocab_size')} != target vocab_size {vocab}: the drafter "
                        "reads the target's embeddings and LM head, so both must share one vocabulary. Use the "
                        "drafter published for this target model")
    dcfg = drafter.get("dflash_config") or {}
    ids = _check_layer_ids(drafter, dcfg, n_layer)
    mask = _check_mask(drafter, dcfg, vocab)
    block = _check_block_size(drafter, dcfg, strict=form is not None)
    if kind == "dflash2":
        _check_dflash2(drafter, dcfg, hidden)
    info = None
    if form is not None:
        info = dspark.read(drafter, form, vocab, hidden)
        _check_speculators_block(drafter, block, info.sample_from_anchor)
        kind = info.kind
    n_target = drafter.get("num_target_layers")
    if isinstance(n_target, int) and n_target != n_layer:
        log.warning("drafter config says num_target_layers=%d but the target has %d layers: was it trained "
                    "for another target?", n_target, n_layer)
    _check_drafter_tensors(drafter, kind, hidden, len(ids) * hidden, vocab, dcfg,
                           layers=not (info and info.gemma))
    if info is not None and drafter.headers_checked:
        # the last check: it reads the two copies of the embeddings (the only tensor data read here)
        dspark.check_embeddings(drafter, target, info, vocab, hidden)
    return PairSpec(target=target, drafter=drafter, target_arch=target_arch, kind=kind, n_layer=n_layer,
                    hidden_size=hidden, vocab_size=vocab, block_size=block, mask_token_id=mask,
                    target_layer_ids=ids, attention=read_attention(drafter, dcfg, sliding_window), dspark=info)


def _int(ck: Checkpoint, key: str) -> int:
    v = ck.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise PairError(f"{ck.role} config {ck.path / 'config.json'} has no valid {key!r} (got {v!r}): "
                        "the config is damaged or not a transformers config")
    return v


def _check_target(t: Checkpoint) -> str:
    arch = t.architecture
    if arch in DRAFTERS or arch in DSPARK:
        raise PairError(f"the target folder {t.path} holds a drafter ({arch}): pass the target model first, "
                        "then the drafter")
    target_arch = targets.gguf_arch(arch) if arch else None
    if target_arch is None:
        raise PairError(f"target architecture {arch or '(none)'!r} is not one the pinned llama.cpp converter "
                        f"knows, so it cannot feed a DFlash drafter in this build: supported targets are "
                        f"{targets.describe_supported()}")
    if target_arch not in targets.tappable():
        raise PairError(f"target architecture {arch!r} converts to llama.cpp's {target_arch!r}, whose graph "
                        f"records no layer inputs for a drafter to tap, so it cannot feed a DFlash drafter: "
                        f"supported targets are "
                        f"{targets.describe_supported()}")
    if not has_tokenizer(t):
        raise PairError(f"target folder {t.path} has no tokenizer (tokenizer.json or tokenizer.model): the "
                        "drafter GGUF takes its vocabulary from the target. Download the tokenizer files too")
    return target_arch


def _check_drafter_arch(d: Checkpoint) -> str:
    """``dflash`` / ``dflash2``, or ``dspark`` for every DSpark form (refined by :func:`dspark.read`)."""
    arch = d.architecture
    if dspark.is_dspark(d):
        return "dspark"
    if arch not in DRAFTERS and arch and targets.gguf_arch(arch) in targets.tappable():
        raise PairError(f"the drafter folder {d.path} holds a target model ({arch}), not a drafter: pass the "
                        "target first, then a DFlash drafter (architectures: DFlashDraftModel)")
    if arch not in DRAFTERS:
        raise PairError(f"drafter architecture {arch or '(none)'!r} is not supported: expected "
                        "DFlashDraftModel, DFlash2DraftModel (z-lab DFlash checkpoints) or a DSpark drafter "
                        "(Qwen3DSparkModel, DSparkDraftModel, DSparkSpeculator, Gemma4DSparkModel)")
    return DRAFTERS[arch]


def _dvalue(d: Checkpoint, dcfg: dict, key: str, default=None):
    """The reference reader's precedence: ``dflash_config`` first, then the top level."""
    return dcfg[key] if key in dcfg else d.get(key, default)


def _check_layer_ids(d: Checkpoint, dcfg: dict, n_layer: int) -> list[int]:
    ids = _dvalue(d, dcfg, "target_layer_ids")
    if not ids:
        raise PairError(f"drafter config {d.path / 'config.json'} has no target_layer_ids: add "
                        "dflash_config.target_layer_ids (the HF layer indices whose outputs it was trained on)")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PairError(f"drafter target_layer_ids must be a list of integers, got {ids!r}")
    if len(ids) > MAX_TAPS:
        raise PairError(f"drafter taps {len(ids)} target layers, llama.cpp supports at most {MAX_TAPS}")
    bad = [t for t in ids if not 0 <= t <= n_layer - 2]
    if bad:
        raise PairError(
            f"drafter target_layer_ids {ids} contain {bad[0]}, outside 0..{n_layer - 2} for a {n_layer}-layer "
            f"target. HF id t means the output of layer t (hidden_states[t+1]); llama.cpp taps layer inputs "
            f"and cannot tap the last layer's output. This drafter belongs to another (deeper) target")
    return list(ids)


def _check_mask(d: Checkpoint, dcfg: dict, vocab: int) -> int:
    mask = dcfg.get("mask_token_id")
    if mask is None:
        where = " (it is at the top level; move it into dflash_config)" if "mask_token_id" in d.config else ""
        raise PairError(f"drafter config has no dflash_config.mask_token_id{where}: the converter reads the "
                        "noise-block mask token from there")
    if not isinstance(mask, int) or not 0 <= mask < vocab:
        raise PairError(f"drafter mask_token_id {mask!r} is outside the vocabulary 0..{vocab - 1}: the drafter "
                        "belongs to another tokenizer")
    return mask


def _check_block_size(d: Checkpoint, dcfg: dict, strict: bool = False) -> int:
    """``strict`` (DSpark): the graph asserts the trained block size, so it must be stated, and once."""
    block = _dvalue(d, dcfg, "block_size", None if strict else 16)
    top = d.get("block_size")
    if strict and block is None:
        raise PairError(f"DSpark drafter config {d.path / 'config.json'} has no block_size: the Markov chain and "
                        "the confidence head run over exactly the trained block; add block_size")
    if "block_size" in dcfg and top is not None and top != block:
        if strict:
            raise PairError(f"DSpark drafter config block_size: {top} disagrees with dflash_config.block_size: "
                            f"{block}: the trained block size must be one value; fix the config")
        log.warning("drafter block_size differs: dflash_config says %s, top level %s; using %s", block, top, block)
    if not isinstance(block, int) or not BLOCK_MIN <= block <= BLOCK_MAX:
        raise PairError(f"drafter block_size {block!r} is outside [{BLOCK_MIN}, {BLOCK_MAX}]: fix block_size "
                        "in the drafter config (it is the size the drafter was trained with)")
    return block


def _check_speculators_block(d: Checkpoint, block: int, anchor: bool) -> None:
    """A speculators export also states its draft length: block_size, or block_size - 1 with a bonus slot."""
    methods = ((d.get("speculators_config") or {}).get("proposal_methods") or []) if isinstance(
        d.get("speculators_config"), dict) else []
    want = block if anchor else block - 1
    for m in methods:
        n = m.get("speculative_tokens") if isinstance(m, dict) else None
        if isinstance(n, int) and n != want:
            raise PairError(f"speculators_config.proposal_methods speculative_tokens: {n} disagrees with block_size: "
                            f"{block} (sample_from_anchor {str(anchor).lower()} drafts {want} tokens a block): "
                            "the export is inconsistent; export it again")


def _check_dflash2(d: Checkpoint, dcfg: dict, hidden: int) -> None:
    missing = [k for k in DFLASH2_KEYS if not isinstance(dcfg.get(k), int) or dcfg[k] <= 0]
    if missing:
        raise PairError(f"DFlash2 drafter config lacks dflash_config.{missing[0]} (needs {', '.join(DFLASH2_KEYS)} "
                        "as positive integers): the config is incomplete, fetch it again")
    group, top_k = dcfg["conv_group_size"], dcfg["selector_top_k"]
    if hidden % group:
        raise PairError(f"DFlash2 hidden_size {hidden} is not a multiple of conv_group_size {group}")
    if hidden < top_k * (top_k + 1):
        raise PairError(f"DFlash2 selector_top_k {top_k} is too large for hidden_size {hidden} "
                        f"(llama.cpp packs top_k*(top_k+1) = {top_k * (top_k + 1)} values per row)")


def _check_drafter_tensors(d: Checkpoint, kind: str, hidden: int, fc_in: int, vocab: int, dcfg: dict,
                           layers: bool = True) -> None:
    """``layers``: check the Qwen3-style layer tensors (a Gemma4 DSpark drafter names its norms otherwise)."""
    if not d.headers_checked:
        return
    names = {n.removeprefix("model."): t for n, t in d.tensors.items()}
    n_layers = _int(d, "num_hidden_layers")
    want = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(n_layers if layers else 0):
        want += [f"layers.{i}.{s}" for s in _LAYER_TENSORS]
        if kind == "dflash2":
            want += [f"layers.{i}.{s}" for s in _DFLASH2_LAYER_TENSORS]
    if kind == "dflash2":
        want += ["candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
                 "candidate_selector.successor_codebook"]
    missing = [w for w in want if w not in names and w + ".weight" not in names]
    if missing:
        raise PairError(f"drafter {d.path} lacks tensor {missing[0]!r} ({len(missing)} missing) for a {kind} "
                        f"drafter with {n_layers} layers: the checkpoint is incomplete or of another kind")
    fc = names["fc.weight"].shape
    if fc != (hidden, fc_in):
        raise PairError(f"drafter fc.weight has shape {list(fc)}, expected [{hidden}, {fc_in}] "
                        f"(hidden_size x n_taps*hidden_size): config and weights disagree")
    if kind == "dflash2":
        cb = names.get("candidate_selector.predecessor_codebook") or names["candidate_selector.predecessor_codebook.weight"]
        if cb.shape != (vocab, dcfg["selector_rank"]):
            raise PairError(f"DFlash2 predecessor_codebook has shape {list(cb.shape)}, expected "
                            f"[{vocab}, {dcfg['selector_rank']}] (vocab x selector_rank)")
