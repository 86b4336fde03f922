"""DSpark drafters: the published config forms read as one, and what the pinned graph can run.

DSpark (DeepSeek, arXiv 2607.05147) is a DFlash backbone plus a low-rank Markov head
(``markov_head.markov_w1`` ``[vocab, rank]``, ``markov_w2`` ``[draft vocab, rank]``: a logit bias
from the previous block token) and an optional confidence head (``confidence_head.proj``, a linear
``hidden + rank -> 1`` over ``[h; markov_w1[prev]]``). Three config forms are published:

* ``deepspec`` (deepseek-ai/DeepSpec, ``Qwen3DSparkModel`` / ``Gemma4DSparkModel``): the target's
  config copied flat plus ``block_size``, ``target_layer_ids``, ``mask_token_id``, ``num_anchors``,
  ``enable_confidence_head``, ``confidence_head_with_markov``, ``markov_rank``, ``markov_head_type``.
  It ships its own copies of the target's ``embed_tokens`` and ``lm_head``. ``markov_rank: 0`` is
  DeepSpec's DFlash drafter (no Markov head). Every block slot predicts (slot k: anchor + k + 1).
* ``speculators`` (vllm-project/speculators, ``speculators_model_type: "dspark"``): the decoder's
  config under ``transformer_layer_config``, taps as ``aux_hidden_state_layer_ids`` (hidden_states
  indices: HF id + 1), ``sample_from_anchor``, optionally a reduced head (``draft_vocab_size``,
  ``d2t``/``t2d``). It ships ``embed_tokens`` (the verifier's) and its ``lm_head``.
* ``nested`` (z-lab / SpecForge ``DSparkDraftModel``): the DFlash layout with the DSpark fields in
  ``dflash_config`` (``projector_type: "dspark"``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head`` or ``use_confidence_head``, ``shift_label``).

:func:`read` turns any of them into a :class:`DSparkInfo` and the config keys the pinned upstream
converter must read (its ``DSparkModel`` handles the speculators and flat forms itself, but takes
``markov_head_type`` only from the top level and has per-form defaults for the block layout; the
overlay states every value explicitly so the GGUF says what was validated here).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.hf import Checkpoint, TensorInfo

log = logging.getLogger("dflash_gguf.convert")

# every architecture name the pinned converter registers for a DSpark drafter
ARCHS = {"Qwen3DSparkModel", "DSparkDraftModel", "DSparkSpeculator", "Lfm2DSparkDraftModel", "LingDSparkModel",
         "Gemma4DSparkModel", "DeepseekV4DSparkModel"}
# a separate DeepSeek-V4 backbone (hyper-connections, MLA, MoE): another graph than the DFlash one
UNSUPPORTED = {"DeepseekV4DSparkModel": "a DeepSeek-V4 backbone (hyper-connections, MLA, MoE), not the DFlash "
                                        "backbone the pinned graph builds"}
HEAD_TYPES = ("vanilla",)       # the pinned graph builds only the vanilla Markov head (dflash.cpp)
W1, W2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
CONF, CONF_BIAS = "confidence_head.proj.weight", "confidence_head.proj.bias"


@dataclass
class DSparkInfo:
    """What a DSpark drafter is, once its form is read."""
    form: str                       # "deepspec" | "speculators" | "nested"
    markov_rank: int                # 0: no Markov head (DeepSpec's DFlash drafters)
    sample_from_anchor: bool        # True: every block slot predicts (slot k: anchor + k + 1)
    confidence_head: bool
    draft_vocab_size: int | None    # rows of the checkpoint's own reduced head (d2t), None: the full vocabulary
    gemma: bool = False
    own_embeddings: list[str] = field(default_factory=list)   # checked equal to the target's
    embeddings_dropped: bool = False
    overlay: dict = field(default_factory=dict)               # config.json keys the upstream converter reads
    notes: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """The pair kind: ``dspark`` with a Markov head, else a DFlash drafter in the anchor layout."""
        return "dspark" if self.markov_rank > 0 else "dflash"

    def manifest(self) -> dict:
        return {"form": self.form, "markov_rank": self.markov_rank, "confidence_head": self.confidence_head,
                "sample_from_anchor": self.sample_from_anchor, "draft_vocab_size": self.draft_vocab_size,
                "own_embeddings": "dropped (equal to the target's; borrowed at run time)" if self.embeddings_dropped
                else "kept (equal to the target's)" if self.own_embeddings else None}


def is_dspark(d: Checkpoint) -> bool:
    dcfg = d.get("dflash_config")
    return (d.architecture in ARCHS or d.get("speculators_model_type") == "dspark"
            or (isinstance(dcfg, dict) and str(dcfg.get("projector_type", "")).lower() == "dspark"))


def form_of(d: Checkpoint) -> str:
    if d.get("speculators_model_type") == "dspark" or "transformer_layer_config" in d.config \
            or "aux_hidden_state_layer_ids" in d.config:
        return "speculators"
    return "nested" if isinstance(d.get("dflash_config"), dict) else "deepspec"


def normalize(d: Checkpoint) -> str:
    """Rewrite ``d.config`` (in memory) to the DFlash shape the pair checks read; returns the form.

    The speculators form's decoder config is merged over the top level (as the upstream converter
    merges it), and the taps, mask token and block size of the flat forms go into ``dflash_config``.
    """
    if d.architecture in UNSUPPORTED:
        raise PairError(f"drafter architecture {d.architecture} is {UNSUPPORTED[d.architecture]}: dflash-gguf "
                        "converts DSpark drafters of the DFlash backbone (Qwen3DSparkModel, DSparkDraftModel, "
                        "DSparkSpeculator, Gemma4DSparkModel)")
    form = form_of(d)
    cfg = dict(d.config)
    if form == "speculators":
        tlc = cfg.get("transformer_layer_config")
        if not isinstance(tlc, dict):
            raise PairError(f"speculators DSpark config {d.path / 'config.json'} has no transformer_layer_config "
                            f"object (got {tlc!r}): the export is incomplete, export it again")
        cfg = {**cfg, **tlc, "architectures": d.config.get("architectures") or ["DSparkSpeculator"]}
        aux = cfg.get("aux_hidden_state_layer_ids")
        if aux is None:
            raise PairError("speculators DSpark config has no aux_hidden_state_layer_ids (the target layers the "
                            "drafter reads): export it again with its target layers")
        if not isinstance(aux, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in aux):
            raise PairError(f"speculators aux_hidden_state_layer_ids must be a list of integers, got {aux!r}")
        taps = [i - 1 for i in aux]         # hidden_states index i = output of HF layer i - 1
    else:
        taps = None
    dcfg = dict(cfg.get("dflash_config") or {})
    if taps is not None:
        dcfg["target_layer_ids"] = taps
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        if key not in dcfg and cfg.get(key) is not None:
            dcfg[key] = cfg[key]
    cfg["dflash_config"] = dcfg
    d.config = cfg
    return form


def _value(d: Checkpoint, key: str, *alt: str):
    """(field name as written, value): ``dflash_config`` first, then the top level."""
    dcfg = d.get("dflash_config") or {}
    for k in (key, *alt):
        if k in dcfg:
            return f"dflash_config.{k}", dcfg[k]
    for k in (key, *alt):
        if k in d.config:
            return k, d.config[k]
    return key, None


def _bool(d: Checkpoint, key: str, *alt: str) -> tuple[str, bool | None]:
    name, v = _value(d, key, *alt)
    if v is not None and not isinstance(v, bool):
        raise PairError(f"DSpark drafter config {name}: {v!r} is not true or false")
    return name, v


def read(d: Checkpoint, form: str, vocab: int, hidden: int) -> DSparkInfo:
    """Read and check a normalized DSpark drafter's head fields and tensors (before any heavy work)."""
    names = {n.removeprefix("model."): t for n, t in d.tensors.items()} if d.headers_checked else {}
    gemma = d.architecture == "Gemma4DSparkModel"
    if gemma:   # the Gemma4 export's confidence projection name, as the pinned converter renames it
        names = {n.replace("confidence_proj.", "confidence_head.proj."): t for n, t in names.items()}

    rank_field, rank = _value(d, "markov_rank")
    if rank is None:        # the nested form may leave it to the tensors
        rank = names[W1].shape[-1] if W1 in names and len(names[W1].shape) == 2 else 0
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise PairError(f"DSpark drafter config {rank_field}: {rank!r} is not a rank (an integer >= 0)")
    head_field, head = _value(d, "markov_head_type")
    if rank > 0 and head is not None and str(head).lower() not in HEAD_TYPES:
        raise PairError(f"DSpark drafter config {head_field}: {head!r} is not supported: the pinned llama.cpp graph "
                        f"builds only the {' / '.join(HEAD_TYPES)} Markov head (a bias from markov_w1 of the previous "
                        "token), so this drafter cannot run here; use a drafter trained with the vanilla head")

    draft_vocab = d.get("draft_vocab_size")
    if draft_vocab is not None and (not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool)
                                    or not 0 < draft_vocab <= vocab):
        raise PairError(f"DSpark drafter config draft_vocab_size: {draft_vocab!r} is not a size within "
                        f"1..{vocab} (the target vocabulary)")
    n_draft = draft_vocab or vocab
    if n_draft < vocab and names and "d2t" not in names:
        raise PairError(f"DSpark drafter config draft_vocab_size: {n_draft} is smaller than the vocabulary ({vocab}) "
                        "but the checkpoint has no d2t tensor (the target id of each head row): it is incomplete")
    if gemma and n_draft < vocab:
        raise PairError(f"Gemma4 DSpark drafter config draft_vocab_size: {n_draft}: the pinned converter needs "
                        "the full vocabulary for a Gemma4 DSpark drafter")

    conf_field, conf_on = _bool(d, "enable_confidence_head", "use_confidence_head")
    with_field, with_markov = _bool(d, "confidence_head_with_markov")
    has_conf = CONF in names
    if conf_on is None:
        conf_on = has_conf
    if conf_on and rank == 0:
        raise PairError(f"DSpark drafter config {conf_field}: true with markov_rank 0: the pinned graph's confidence "
                        "head reads [hidden; markov_w1[prev]], so it needs a Markov head")
    if conf_on and with_markov is False:
        raise PairError(f"DSpark drafter config {with_field}: false is not supported: the pinned graph's confidence "
                        "head reads [hidden; markov_w1[prev]] (trained with confidence_head_with_markov: true)")
    _check_tensors(d, names, rank, n_draft, vocab, hidden, conf_on, rank_field, conf_field)

    info = DSparkInfo(form=form, markov_rank=rank, sample_from_anchor=_anchor(d, form),
                      confidence_head=bool(conf_on and has_conf),
                      draft_vocab_size=n_draft if n_draft < vocab else None, gemma=gemma)
    info.overlay = {"sample_from_anchor": info.sample_from_anchor, "dflash_config": dict(d.get("dflash_config"))}
    if rank > 0:
        info.overlay["markov_head_type"] = "vanilla"
    if rank == 0:
        info.notes.append(f"DSpark-lineage drafter without a Markov head ({rank_field} 0): converted as a DFlash "
                          f"drafter whose block slot 0 predicts too (dflash.sample_from_anchor="
                          f"{str(info.sample_from_anchor).lower()})")
    return info


def _anchor(d: Checkpoint, form: str) -> bool:
    """Whether block slot 0 (the anchor) predicts: the config's own word, else its form's convention."""
    top = d.config.get("sample_from_anchor")
    if top is not None:
        if not isinstance(top, bool):
            raise PairError(f"DSpark drafter config sample_from_anchor: {top!r} is not true or false")
        return top
    shift = (d.get("dflash_config") or {}).get("shift_label")
    if shift is not None:           # SpecForge: slot j predicts draft token j + 1 when shifted
        if not isinstance(shift, bool):
            raise PairError(f"DSpark drafter config dflash_config.shift_label: {shift!r} is not true or false")
        return shift
    # DeepSpec and the nested form train every slot; speculators exports written before the field
    # existed used the 1+N layout (slot 0 is the bonus token), which is also the pinned converter's default
    return form != "speculators"


def _check_tensors(d: Checkpoint, names: dict[str, TensorInfo], rank: int, n_draft: int, vocab: int, hidden: int,
                   conf_on: bool, rank_field: str, conf_field: str) -> None:
    if not names:
        return
    extra = sorted(n for n in names if n.startswith("markov_head.") and n not in (W1, W2))
    if extra:
        raise PairError(f"drafter {d.path} has Markov head tensor {extra[0]!r}, which the vanilla head has not "
                        "(a gated or RNN head): the pinned graph builds only the vanilla head")
    if rank == 0:
        if W1 in names or W2 in names:
            raise PairError(f"DSpark drafter config {rank_field} is 0 but the checkpoint has {W1 if W1 in names else W2}: "
                            "config and weights disagree")
    else:
        for n, want in ((W1, (vocab, rank)), (W2, (n_draft, rank))):
            if n not in names:
                raise PairError(f"drafter {d.path} lacks tensor {n!r} for a DSpark drafter with {rank_field} "
                                f"{rank}: the checkpoint is incomplete or of another kind")
            if tuple(names[n].shape) != want:
                raise PairError(f"DSpark {n} has shape {list(names[n].shape)}, expected {list(want)} "
                                f"({'vocab' if n == W1 else 'draft vocab'} x markov_rank): config and weights "
                                "disagree, or the drafter belongs to another target")
    if conf_on and CONF not in names:
        raise PairError(f"DSpark drafter config {conf_field}: true but the checkpoint lacks tensor {CONF!r}: it is "
                        "incomplete")
    if CONF in names:
        want = (1, hidden + rank)
        if tuple(names[CONF].shape) != want:
            raise PairError(f"DSpark {CONF} has shape {list(names[CONF].shape)}, expected {list(want)} "
                            "(1 x hidden_size + markov_rank): config and weights disagree")
        if CONF_BIAS in names and tuple(names[CONF_BIAS].shape) != (1,):
            raise PairError(f"DSpark {CONF_BIAS} has shape {list(names[CONF_BIAS].shape)}, expected [1]")
    if "d2t" in names and tuple(names["d2t"].shape) != (n_draft,):
        raise PairError(f"DSpark d2t has shape {list(names['d2t'].shape)}, expected [{n_draft}] (draft_vocab_size)")


# ------------------------------------------------------------------ own embeddings / LM head
# relative tolerance by the coarser dtype of the two copies: one rounding of that format
_RTOL = {"F32": 1e-6, "F16": 2.0 ** -10, "BF16": 2.0 ** -7}
_ATOL = {"F32": 1e-7, "F16": 1e-5, "BF16": 1e-5}
_ROWS = 4096


def check_embeddings(d: Checkpoint, target: Checkpoint, info: DSparkInfo, vocab: int, hidden: int) -> None:
    """Compare the drafter's own ``embed_tokens`` / full ``lm_head`` with the target's; refuse on a difference.

    Equal copies are dropped from the drafter GGUF (it borrows the target's through ``ctx_other``, as
    DFlash drafters do), except for Gemma4, whose pinned converter keeps its LM head.
    """
    names = {n.removeprefix("model."): (n, t) for n, t in d.tensors.items()}
    own = [n for n in ("embed_tokens.weight", "lm_head.weight") if n in names]
    if not own:
        return
    if not target.headers_checked:
        raise PairError(f"the drafter ships its own {own[0]} but the target {target.path} has only .bin weights: "
                        "they cannot be compared with the target's; convert the target to safetensors first")
    t_embed = _find(target, "embed_tokens.weight")
    t_head = _find(target, "lm_head.weight") or t_embed
    for n in own:
        info_d = names[n][1]
        ref = t_embed if n == "embed_tokens.weight" else t_head
        if ref is None:
            raise PairError(f"the drafter ships its own {n} but the target {target.path} has no embed_tokens tensor "
                            "to compare it with: is the target folder complete?")
        rows = None
        if n == "lm_head.weight" and info.draft_vocab_size:
            rows = _d2t_rows(d, names, info.draft_vocab_size, vocab)
        _compare(n, info_d, target.tensors[ref], rows, hidden)
        info.own_embeddings.append(n)
    # a reduced head stays the drafter's own output layer (the pinned converter keeps it with d2t);
    # full copies go, and the drafter borrows the target's
    info.embeddings_dropped = not info.gemma
    if info.embeddings_dropped:
        info.overlay["has_embed_tokens"] = False
    log.info("the drafter's own %s equal the target's: %s", " and ".join(own),
             "dropped, the drafter uses the target's" if info.embeddings_dropped else "kept (Gemma4 DSpark)")


def _find(ck: Checkpoint, suffix: str) -> str | None:
    hits = sorted((n for n in ck.tensors if n == suffix or n.endswith("." + suffix)), key=len)
    return hits[0] if hits else None


def _d2t_rows(d: Checkpoint, names: dict, n_draft: int, vocab: int) -> np.ndarray:
    t = names["d2t"][1]
    ids = _array(t).reshape(-1).astype(np.int64) + np.arange(n_draft, dtype=np.int64)
    if ids.min() < 0 or ids.max() >= vocab or np.unique(ids).size != ids.size:
        raise PairError(f"DSpark d2t of {d.path} maps draft rows outside the vocabulary 0..{vocab - 1} or twice: "
                        "the checkpoint is damaged or belongs to another tokenizer")
    return ids


def _array(t: TensorInfo) -> np.ndarray:
    """The tensor as a read-only memory map (BF16 as uint16 bits)."""
    base = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}.get(t.dtype)
    if base is None:
        raise PairError(f"tensor of dtype {t.dtype} in {t.file} cannot be compared (F32, F16, BF16 only)")
    return np.memmap(t.file, dtype=base, mode="r", offset=t.offset, shape=t.shape)


def _floats(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


def _compare(name: str, mine: TensorInfo, ref: TensorInfo, rows: np.ndarray | None, hidden: int) -> None:
    want_rows = ref.shape[0] if rows is None else rows.size
    if len(mine.shape) != 2 or mine.shape != (want_rows, hidden) or len(ref.shape) != 2 or ref.shape[1] != hidden:
        raise PairError(f"the drafter's own {name} has shape {list(mine.shape)}, the target's has {list(ref.shape)}: "
                        "this drafter was made for another target; use the drafter published for this target model")
    coarse = max((mine.dtype, ref.dtype), key=lambda t: _RTOL.get(t, 1.0))
    rtol, atol = _RTOL.get(coarse, 0.0), _ATOL.get(coarse, 0.0)
    a, b = _array(mine), _array(ref)
    for i in range(0, want_rows, _ROWS):
        x = _floats(a[i:i + _ROWS], mine.dtype)
        y = _floats(b[i:i + _ROWS] if rows is None else b[rows[i:i + _ROWS]], ref.dtype)
        diff = np.abs(x - y)
        bad = diff > atol + rtol * np.maximum(np.abs(x), np.abs(y))
        if bad.any():
            r = i + int(np.argwhere(bad)[0][0])
            raise PairError(f"the drafter's own {name} differs from the target's (row {r}, largest difference "
                            f"{float(diff.max()):.3g}): this drafter was trained for another target (or another "
                            "revision of it); use the drafter published for this target model")
