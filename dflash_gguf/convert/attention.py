"""How a drafter config's attention is read: its sliding window and its causality.

Drafter configs say this in three schemas. The legacy one has no window. The nested schema of mid 2026
has ``layer_types`` (``sliding_attention`` / ``full_attention`` per layer), ``sliding_window`` (e.g.
4096) and, not always, ``use_sliding_window``; DFlash2 / Muse drafters put ``use_swa`` and
``swa_window_size`` in ``dflash_config``. The vendored converter writes a window only when
``use_sliding_window`` (or ``use_swa``) is true - which is also how transformers' Qwen3Config reads it
(``sliding_window = None`` unless ``use_sliding_window``), so a config with sliding layers and no
``use_sliding_window`` key is ambiguous: transformers (and so the reference drafter code running on
it) attends without a window, a reader that follows ``layer_types`` alone applies it. Here that case is
never silent: the default keeps the converter's (and transformers') reading and says so with the fix;
``sliding_window="on"`` applies the window (``use_sliding_window: true`` is set for the converter),
``"off"`` converts any window away.

Causality: llama.cpp's DFlash graph has one causal flag for all layers, written only when the config
sets ``is_causal`` (or ``dflash_config.causal``); without it every layer attends non-causally within
the block. The public reference (z-lab/dflash ``Qwen3DFlashAttention``) and vLLM read a
``sliding_attention`` layer as causal unless ``is_causal`` says otherwise, and a ``full_attention``
layer as non-causal. A config with sliding layers and no ``is_causal`` therefore runs here with
non-causal sliding layers: output stays exactly the target's (lossless either way), acceptance may be
below what its publisher reports. Published drafters that set ``is_causal: false`` read the same
everywhere.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.hf import Checkpoint

log = logging.getLogger("dflash_gguf.convert")

CHOICES = ("auto", "on", "off")


@dataclass
class DrafterAttention:
    """What the drafter GGUF will say about attention, and the config keys set for the converter."""
    sliding_window: int = 0                 # window written to the GGUF (0: none)
    sliding_layers: int = 0                 # layers the window applies to
    causal: bool | None = None              # causal flag written (None: none: llama.cpp reads non-causal)
    overlay: dict = field(default_factory=dict)   # config.json keys set before the upstream converter runs
    notes: list[str] = field(default_factory=list)


def _window_size(d: Checkpoint, dcfg: dict) -> int:
    w = dcfg.get("swa_window_size") or d.get("sliding_window")
    if w is None:
        return 0
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
        raise PairError(f"drafter config sliding_window {w!r} is not a positive integer: fix config.json")
    return w


def read_attention(d: Checkpoint, dcfg: dict, sliding_window: str = "auto") -> DrafterAttention:
    """Read (and log) a drafter config's window and causality; ``sliding_window``: auto | on | off."""
    if sliding_window not in CHOICES:
        raise ValueError(f"sliding_window must be one of {', '.join(CHOICES)}, got {sliding_window!r}")
    n_layers = d.get("num_hidden_layers") or 0
    types = d.get("layer_types") if isinstance(d.get("layer_types"), list) else []
    use_swa = bool(dcfg.get("use_swa"))
    n_sliding = n_layers if use_swa else sum(1 for t in types if t == "sliding_attention")
    size = _window_size(d, dcfg)
    usw = d.get("use_sliding_window")
    out = DrafterAttention()

    def note(msg: str) -> None:
        out.notes.append(msg)
        log.warning("%s", msg)

    if n_sliding == 0:
        if sliding_window == "on":
            raise PairError("--drafter-sliding-window on: the drafter config declares no sliding layers "
                            "(no layer_types entry 'sliding_attention', no dflash_config.use_swa)")
    elif size == 0:
        note(f"drafter config marks {n_sliding} of {n_layers} layers 'sliding_attention' but gives no "
             "sliding_window size: converted with full attention in every layer")
    elif sliding_window == "off":
        if use_swa or usw:
            out.overlay = {"use_sliding_window": False, **({"dflash_config": dict(dcfg, use_swa=False)}
                                                            if use_swa else {})}
        log.info("drafter sliding window %d converted away (--drafter-sliding-window off)", size)
    elif use_swa or usw or sliding_window == "on":
        if not (use_swa or usw):
            out.overlay = {"use_sliding_window": True}
        out.sliding_window, out.sliding_layers = size, n_sliding
        log.info("drafter attends within a sliding window of %d positions in %d of %d layers", size, n_sliding,
                 n_layers)
    else:
        how = "is false" if usw is False else "is not set"
        note(f"drafter config marks {n_sliding} of {n_layers} layers 'sliding_attention' with sliding_window="
             f"{size}, but use_sliding_window {how}: transformers' Qwen3Config then drops the window, and so "
             "does this conversion (full attention). If the drafter was trained with that window, convert "
             "again with --drafter-sliding-window on (Python: sliding_window='on')")
    causal = d.get("is_causal")
    if causal is None:
        causal = dcfg.get("causal")
    out.causal = None if causal is None else bool(causal)
    if causal is None and n_sliding:
        note(f"drafter config sets no is_causal: the reference drafter code reads its {n_sliding} sliding "
             "layer(s) as causal and its full-attention layers as non-causal; llama.cpp's DFlash graph has one "
             "flag for all layers and reads every layer as non-causal. Output stays exact (lossless); "
             "acceptance may be lower than published")
    return out
