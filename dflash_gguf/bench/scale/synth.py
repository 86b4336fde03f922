"""Synthetic GGUF pairs at the shapes people run: random weights, real shapes, real vocabulary.

Written straight to GGUF with numpy and the vendored gguf-py (no torch, no conversion, no
quantization pass): quantized matrices are random quant blocks generated directly, with fp16 block
scales chosen so every matrix has a weight std of about ``1/sqrt(fan_in)`` (the token embedding:
``10/sqrt(hidden)``, so the random target's logits are well separated and batched-vs-single-row
rounding rarely flips its greedy choice). Speed depends on the shapes and types, not the values.

Target: a Qwen3 architecture GGUF with the shape of Qwen3-0.6B / 1.7B / 4B / 8B (their published
configs) and Qwen2/Qwen3's 151,936-token vocabulary (the tokenizer of llama.cpp's
``models/ggml-vocab-qwen2.gguf``). ``Q4_0`` mirrors llama-quantize's default Q4_0 mix: every matrix
Q4_0 except the LM head (the tied ``token_embd`` for 0.6B-4B, ``output`` for 8B), which is Q6_K;
``Q8_0`` is Q8_0 throughout (llama-quantize keeps the head in Q8_0 there too).

Drafter: the published DFlash shape (z-lab Qwen3-*-DFlash-b16: 5 layers, block 16, the target's
hidden size, heads and FFN width, mask token 151669), taps spread as z-lab's
``build_target_layer_ids`` spreads them (from layer 1 to ``n_layers - 3``, evenly; GGUF stores HF id
+ 1), no embeddings or head of its own (it borrows the target's), same type as the target.

Pairs are cached under ``<cache>/scale-pairs/<name>/`` with a ``pair.json`` (so every pair tool,
e.g. ``python -m dflash_gguf.convert.draft_vocab``, works on them).
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("dflash_gguf.bench.scale")

FORMAT = 1           # bump when the files written here change
VOCAB_SIZE = 151936
MASK_TOKEN = 151669  # z-lab Qwen3 DFlash drafters' mask_token_id
DRAFT_LAYERS = 5
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    inter: int
    tied: bool
    head_dim: int = 128

    @property
    def params(self) -> int:
        H, hd = self.hidden, self.head_dim
        per = H * hd * (self.heads * 2 + self.kv_heads * 2) + 3 * H * self.inter
        return self.layers * per + VOCAB_SIZE * H * (1 if self.tied else 2)


# Qwen3 configs (hidden_size, num_hidden_layers, heads, kv heads, intermediate_size, tie_word_embeddings)
SHAPES = {
    "0.6b": Shape("0.6b", 1024, 28, 16, 8, 3072, True),
    "1.7b": Shape("1.7b", 2048, 28, 16, 8, 6144, True),
    "4b": Shape("4b", 2560, 36, 32, 8, 9728, True),
    "8b": Shape("8b", 4096, 36, 32, 8, 12288, False),
}
TYPES = ("q4_0", "q8_0")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's spread of the drafter's taps over the target (HF convention: output of layer t)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


# ------------------------------------------------------------------ random quant blocks
def _gguf():
    import gguf

    return gguf


def _scales(rng, n: int, d: float) -> np.ndarray:
    return (d * (1.0 + 0.1 * rng.standard_normal(n))).astype(np.float16)


def random_q8_0(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Q8_0 blocks (fp16 d + 32 int8): values d * q with q uniform in [-127, 127]."""
    nb = rows * cols // 32
    blk = np.frombuffer(rng.bytes(nb * 34), dtype=np.uint8).reshape(nb, 34).copy()
    q = blk[:, 2:].view(np.int8)
    q[q == -128] = -127
    blk[:, :2] = _scales(rng, nb, std / 73.3).view(np.uint8).reshape(nb, 2)
    return blk.reshape(rows, cols // 32 * 34)


def random_q4_0(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Q4_0 blocks (fp16 d + 16 bytes of nibbles): values d * (nibble - 8)."""
    nb = rows * cols // 32
    blk = np.frombuffer(rng.bytes(nb * 18), dtype=np.uint8).reshape(nb, 18).copy()
    blk[:, :2] = _scales(rng, nb, std / 4.61).view(np.uint8).reshape(nb, 2)
    return blk.reshape(rows, cols // 32 * 18)


def random_q6_k(rng, rows: int, cols: int, std: float) -> np.ndarray:
    """Q6_K super-blocks of 256 (ql[128], qh[64], int8 scales[16], fp16 d): d * scale * (q - 32)."""
    nb = rows * cols // 256
    blk = np.frombuffer(rng.bytes(nb * 210), dtype=np.uint8).reshape(nb, 210).copy()
    sc = rng.integers(16, 32, size=(nb, 16), dtype=np.int8)
    blk[:, 192:208] = sc.view(np.uint8)
    blk[:, 208:210] = _scales(rng, nb, std / (18.47 * 24.0)).view(np.uint8).reshape(nb, 2)
    return blk.reshape(rows, cols // 256 * 210)


QUANT = {"q4_0": ("Q4_0", random_q4_0), "q8_0": ("Q8_0", random_q8_0), "q6_k": ("Q6_K", random_q6_k)}


class _Tensor:
    def __init__(self, name: str, rows: int, cols: int, kind: str, std: float = 1.0, fill: float | None = None):
        self.name, self.rows, self.cols, self.kind, self.std, self.fill = name, rows, cols, kind, std, fill

    def info(self):
        gguf = _gguf()
        if self.kind == "f32":
            shape = (self.cols,) if self.rows == 1 else (self.rows, self.cols)
            return shape, np.float32, 4 * self.rows * self.cols, gguf.GGMLQuantizationType.F32
        qname, _ = QUANT[self.kind]
        qt = gguf.GGMLQuantizationType[qname]
        blk, size = gguf.GGML_QUANT_SIZES[qt]
        return (self.rows, self.cols), np.float32, self.rows * self.cols // blk * size, qt

    def data(self, rng) -> np.ndarray:
        if self.kind == "f32":
            return np.full(self.rows * self.cols, self.fill if self.fill is not None else 1.0, dtype=np.float32)
        return QUANT[self.kind][1](rng, self.rows, self.cols, self.std)


def _layer_tensors(s: Shape, i: int, wtype: str) -> list[_Tensor]:
    H, hd = s.hidden, s.head_dim
    p = f"blk.{i}."
    return [
        _Tensor(p + "attn_norm.weight", 1, H, "f32"),
        _Tensor(p + "attn_q.weight", s.heads * hd, H, wtype, H ** -0.5),
        _Tensor(p + "attn_k.weight", s.kv_heads * hd, H, wtype, H ** -0.5),
        _Tensor(p + "attn_v.weight", s.kv_heads * hd, H, wtype, H ** -0.5),
        _Tensor(p + "attn_output.weight", H, s.heads * hd, wtype, (s.heads * hd) ** -0.5),
        _Tensor(p + "attn_q_norm.weight", 1, hd, "f32"),
        _Tensor(p + "attn_k_norm.weight", 1, hd, "f32"),
        _Tensor(p + "ffn_norm.weight", 1, H, "f32"),
        _Tensor(p + "ffn_gate.weight", s.inter, H, wtype, H ** -0.5),
        _Tensor(p + "ffn_up.weight", s.inter, H, wtype, H ** -0.5),
        _Tensor(p + "ffn_down.weight", H, s.inter, wtype, s.inter ** -0.5),
    ]


def _head_type(wtype: str) -> str:
    return "q6_k" if wtype == "q4_0" else wtype


def target_tensors(s: Shape, wtype: str) -> list[_Tensor]:
    emb_std = 10.0 / s.hidden ** 0.5
    out = [_Tensor("token_embd.weight", VOCAB_SIZE, s.hidden, _head_type(wtype) if s.tied else wtype, emb_std)]
    for i in range(s.layers):
        out += _layer_tensors(s, i, wtype)
    out.append(_Tensor("output_norm.weight", 1, s.hidden, "f32"))
    if not s.tied:
        out.append(_Tensor("output.weight", VOCAB_SIZE, s.hidden, _head_type(wtype), emb_std))
    return out


def drafter_tensors(s: Shape, wtype: str, n_taps: int) -> list[_Tensor]:
    H = s.hidden
    out = [_Tensor("fc.weight", H, n_taps * H, wtype, (n_taps * H) ** -0.5),
           _Tensor("enc.output_norm.weight", 1, H, "f32")]
    for i in range(DRAFT_LAYERS):
        out += _layer_tensors(s, i, wtype)
    out.append(_Tensor("output_norm.weight", 1, H, "f32"))
    return out


# ------------------------------------------------------------------ files
def _vocab_source() -> Path:
    from dflash_gguf import paths

    p = paths.upstream_tree() / "models" / "ggml-vocab-qwen2.gguf"
    if not p.is_file():
        raise FileNotFoundError(f"{p} is missing: the Qwen2/Qwen3 tokenizer comes from the build's llama.cpp tree "
                                "(python -m dflash_gguf.build)")
    return p


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(vocab_path: Path) -> tuple:
    """``tokenizer.*`` fields of a GGUF as (key, value, type, sub-type); parsed once per process."""
    gguf = _gguf()
    r = gguf.GGUFReader(str(vocab_path))
    out = []
    for f in r.fields.values():
        if f.name.startswith("tokenizer."):
            vt = f.types[0]
            out.append((f.name, f.contents(), vt, f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None))
    n = len(r.fields["tokenizer.ggml.tokens"].contents())
    if n != VOCAB_SIZE:
        raise ValueError(f"{vocab_path} has {n} tokens, expected {VOCAB_SIZE}")
    return tuple(out)


def _copy_tokenizer(writer, vocab_path: Path) -> None:
    for key, val, vt, sub in _tokenizer_fields(vocab_path):
        writer.add_key_value(key, val, vt, sub_type=sub)


def _common_kv(w, arch: str, s: Shape, n_layers: int, ftype: int) -> None:
    w.add_name(f"synthetic qwen3-{s.name} random weights ({arch})")
    w.add_uint32(f"{arch}.block_count", n_layers)
    w.add_uint32(f"{arch}.context_length", 40960)
    w.add_uint32(f"{arch}.embedding_length", s.hidden)
    w.add_uint32(f"{arch}.feed_forward_length", s.inter)
    w.add_uint32(f"{arch}.attention.head_count", s.heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", s.kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", 1000000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(f"{arch}.attention.key_length", s.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", s.head_dim)
    w.add_uint32("general.file_type", ftype)
    w.add_uint32("general.quantization_version", 2)


def _write(path: Path, arch: str, kv, tensors: list[_Tensor], seed: int) -> None:
    gguf = _gguf()
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(str(tmp), arch)
    try:
        kv(w)
        for t in tensors:
            shape, dt, nbytes, qt = t.info()
            w.add_tensor_info(t.name, shape, dt, nbytes, qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for i, t in enumerate(tensors):
            rng = np.random.default_rng([seed, i])
            w.write_tensor_data(t.data(rng))
        w.close()
        os.replace(tmp, path)
    except BaseException:
        w.close()
        tmp.unlink(missing_ok=True)
        raise


def pair_name(shape: str, wtype: str, seed: int = 0) -> str:
    return f"qwen3-{shape}-{wtype}-s{seed}-v{FORMAT}"


def scale_root() -> Path:
    from dflash_gguf import paths

    return paths.cache_dir() / "scale-pairs"


def make_pair(shape: str, wtype: str, *, seed: int = 0, root: Path | None = None) -> Path:
    """The cached synthetic pair directory for (shape, type), written if missing."""
    from dflash_gguf.convert import manifest as mf

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")
    if wtype not in TYPES:
        raise ValueError(f"unknown type {wtype!r}; one of {', '.join(TYPES)}")
    s = SHAPES[shape]
    d = (root or scale_root()) / pair_name(shape, wtype, seed)
    if (d / mf.MANIFEST).is_file():
        return d
    gguf = _gguf()
    ftype = {"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[wtype].value
    t_tensors = target_tensors(s, wtype)
    hf_ids = build_target_layer_ids(s.layers, DRAFT_LAYERS)
    taps = [t + 1 for t in hf_ids]
    d_tensors = drafter_tensors(s, wtype, len(taps))
    need = sum(t.info()[2] for t in t_tensors + d_tensors) + (64 << 20)
    d.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(d.parent).free
    if free < need:
        raise OSError(f"not enough disk space in {d.parent} for the {shape} {wtype} pair: {need / 2**30:.1f} GiB "
                      f"needed, {free / 2**30:.1f} GiB free")
    staging = d.with_name(d.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    vocab = _vocab_source()
    t0 = time.perf_counter()
    log.info("writing synthetic pair %s (%.2f GiB) in %s", d.name, need / 2**30, d.parent)

    def target_kv(w):
        _common_kv(w, "qwen3", s, s.layers, ftype)
        _copy_tokenizer(w, vocab)

    def drafter_kv(w):
        _common_kv(w, "dflash", s, DRAFT_LAYERS, ftype)
        w.add_uint32("dflash.block_size", BLOCK_SIZE)
        w.add_array("dflash.target_layers", taps)
        _copy_tokenizer(w, vocab)
        w.add_uint32("tokenizer.ggml.mask_token_id", MASK_TOKEN)

    tf, df = staging / "target.gguf", staging / "drafter.gguf"
    _write(tf, "qwen3", target_kv, t_tensors, seed)
    _write(df, "dflash", drafter_kv, d_tensors, seed + 1000)
    doc = {
        "format": mf.FORMAT, "format_version": mf.FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kind": "dflash", "block_size": BLOCK_SIZE, "mask_token_id": MASK_TOKEN, "target_layers": taps,
        "target_layers_convention": "GGUF dflash.target_layers: input of layer i = output of HF layer i-1",
        "hf_target_layer_ids": hf_ids,
        "target": mf.file_entry(tf, wtype, arch="qwen3", n_layer=s.layers, hidden_size=s.hidden,
                                vocab_size=VOCAB_SIZE, source=f"synthetic random weights, Qwen3-{s.name} shape"),
        "drafter": mf.file_entry(df, wtype, arch="dflash", n_layer=DRAFT_LAYERS,
                                 source="synthetic random weights, z-lab DFlash-b16 shape"),
        "synthetic": {"shape": s.name, "type": wtype, "seed": seed, "format": FORMAT,
                      "head_type": _head_type(wtype), "params_target": s.params},
        "converter": mf.converter_version(),
    }
    mf.write_manifest(staging, doc)
    if d.exists():
        shutil.rmtree(d)
    os.rename(staging, d)
    log.info("pair %s written in %.0f s", d.name, time.perf_counter() - t0)
    return d


def reduced_pair(pair: Path, n: int) -> Path:
    """The cached copy of ``pair`` whose drafter has a reduced head of ``n`` rows (made if missing)."""
    from dflash_gguf.convert import draft_vocab

    out = pair.with_name(f"{pair.name}-dv{n}")
    if (out / "pair.json").is_file():
        return out
    return draft_vocab.reduce_pair(pair, n, out_dir=out)
