"""Check a GGUF file in Python before llama.cpp sees it.

llama.cpp's loader returns an error for most broken files, but on some inconsistent inputs it
asserts and aborts the whole process (e.g. an expert count above its limit, a zero head count
that divides), or reads past an array that is shorter than another one it pairs with. An app that
embeds the engine must get an exception it can catch instead, so :func:`check_gguf` reads the
header, the key/value section and the tensor-info section (never the tensor data) with bounds
checked against the file size, and raises :class:`~dflash_gguf.errors.ModelFileError` naming the
file and what is wrong.

:func:`parse_gguf` is the reader underneath; the reliability fuzzer uses its offsets to mutate
files section by section.
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_LAYERS = 512           # LLAMA_MAX_LAYERS
MAX_EXPERTS = 512          # LLAMA_MAX_EXPERTS (llama.cpp asserts above it)
MAX_KEY = 65535
MAX_TAPS = 64

# The architectures llama.cpp gives recurrent layers (src/llama-arch.cpp of the pinned tree:
# llm_arch_is_recurrent, llm_arch_is_hybrid; tests/test_llama_parity.py keeps them in step).
# Their converters write a head count of 0 for every layer without attention (mamba, mamba2 and
# rwkv for all of them), and llama.cpp derives the head sizes only from a non-zero count.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
HYBRID_ARCHS = frozenset({"jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
                          "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
                          "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})


def has_recurrent_layers(arch: str | None) -> bool:
    """Whether llama.cpp runs ``arch`` with recurrent layers (which have no attention heads)."""
    return arch in RECURRENT_ARCHS or arch in HYBRID_ARCHS

# value types: id -> (name, struct format or None for variable size)
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, \
    T_UINT64, T_INT64, T_FLOAT64 = range(13)
_SCALAR = {T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h", T_UINT32: "<I", T_INT32: "<i",
           T_FLOAT32: "<f", T_BOOL: "<B", T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d"}
_INTEGER = {T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_UINT64, T_INT64}

# ggml type id -> (block size, bytes per block); ids that upstream removed are absent. The vendored
# gguf-py's GGML_QUANT_SIZES is the same table (tests/test_llama_parity.py checks it), but importing any
# part of gguf-py loads the whole package (its reader, writer and vocabulary modules, with yaml and
# sentencepiece): memory that every Llama would then hold beyond plain llama_cpp's for one table
GGML_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
                   9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
                   15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
                   21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
                   27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66),
                   39: (32, 17), 40: (64, 36), 41: (128, 18), 42: (64, 18)}


def ggml_type_sizes() -> dict[int, tuple[int, int]]:
    """ggml type id -> (elements per block, bytes per block)."""
    return dict(GGML_TYPE_SIZES)


@dataclass
class KV:
    key: str
    type: int
    value: object               # scalar, str, or list (arrays of scalars/strings)
    start: int                  # offset of the key length
    value_start: int            # offset of the value type
    end: int
    array_type: int | None = None
    count: int | None = None    # array length


@dataclass
class TensorInfo:
    name: str
    dims: list[int]
    type: int
    offset: int                 # relative to the data section
    start: int
    dims_start: int
    type_start: int
    end: int


@dataclass
class GGUFHeader:
    path: Path
    size: int
    version: int
    n_tensors: int
    n_kv: int
    kv: dict[str, KV] = field(default_factory=dict)
    kv_list: list[KV] = field(default_factory=list)
    tensors: list[TensorInfo] = field(default_factory=list)
    kv_start: int = 24
    tensors_start: int = 0
    tensors_end: int = 0
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0

    def get(self, key: str, default=None):
        kv = self.kv.get(key)
        return default if kv is None else kv.value

    @property
    def arch(self) -> str | None:
        v = self.get("general.architecture")
        return v if isinstance(v, str) else None


class _Reader:
    """Bounds-checked reads from a byte buffer (the file, memory-mapped)."""

    def __init__(self, buf, size: int, path: Path, light: bool = False):
        self.buf, self.size, self.path, self.pos = buf, size, path, 0
        # light: string arrays are checked but not kept (value None), long scalar arrays become numpy
        # arrays - a 151k-token vocabulary as Python objects would cost ~45 MiB of peak RSS
        self.light = light

    def fail(self, what: str) -> None:
        raise ModelFileError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"truncated: {what} at offset {self.pos} needs {n} bytes, the file has {self.size}")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def scalar(self, t: int, what: str):
        fmt = _SCALAR[t]
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(T_UINT32, what)

    def u64(self, what: str) -> int:
        return self.scalar(T_UINT64, what)

    def raw_string(self, what: str, limit: int | None = None) -> bytes:
        n = self.u64(f"length of {what}")
        if limit is not None and n > limit:
            self.fail(f"{what} is {n} bytes long (at most {limit})")
        return self.read(n, what)

    def string(self, what: str, limit: int | None = None) -> str:
        return self.raw_string(what, limit).decode("utf-8", "replace")

    def value(self, t: int, what: str, depth: int = 0):
        if t in _SCALAR:
            return self.scalar(t, what)
        if t == T_STRING:
            return self.string(what)
        if t == T_ARRAY:
            at = self.u32(f"element type of {what}")
            n = self.u64(f"length of {what}")
            if at == T_ARRAY:
                self.fail(f"{what}: nested arrays are not supported by llama.cpp")
            if at not in _SCALAR and at != T_STRING:
                self.fail(f"{what}: invalid array element type {at}")
            min_size = struct.calcsize(_SCALAR[at]) if at in _SCALAR else 8
            if n * min_size > self.size - self.pos:
                self.fail(f"{what}: array of {n} elements does not fit in the {self.size - self.pos} bytes left")
            if at in _SCALAR:
                fmt = _SCALAR[at]
                k = n * struct.calcsize(fmt)
                self.need(k, what)
                if self.light and n > 4096:
                    import numpy as np
                    vals = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos).copy()
                else:
                    vals = list(struct.unpack_from(f"<{n}{fmt[1]}", self.buf, self.pos)) if n else []
                self.pos += k
                return vals
            if self.light:
                for _ in range(n):
                    m = self.u64(f"length of {what}")
                    self.need(m, what)
                    self.pos += m
                return None
            return [self.raw_string(what) for _ in range(n)]   # string arrays stay bytes (vocabularies)
        self.fail(f"{what}: invalid value type {t}")


def parse_gguf(path: str | os.PathLike, *, light: bool = False) -> GGUFHeader:
    """Read a GGUF's header, key/values and tensor infos (bounds-checked); raises ModelFileError.

    ``light=True``: string arrays (vocabularies, merges) are bounds-checked but their values are not
    kept (``None``), and long scalar arrays are numpy arrays.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ModelFileError(f"{path}: cannot be read ({e.strerror or e})") from e
    with f:
        if size < 24:
            raise ModelFileError(f"{path}: truncated: {size} bytes is less than a GGUF header (24)")
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise ModelFileError(f"{path}: cannot be mapped ({e})") from e
        try:
            return _parse(buf, size, path, light)
        finally:
            buf.close()


def _parse(buf, size: int, path: Path, light: bool = False) -> GGUFHeader:
    r = _Reader(buf, size, path, light)
    magic = r.read(4, "magic")
    if magic != GGUF_MAGIC:
        r.fail(f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    version = r.u32("version")
    if version not in (2, 3):
        r.fail(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = r.u64("tensor count"), r.u64("key/value count")
    # every KV needs >= 8 (key length) + 4 (type) + 1 bytes, every tensor info >= 8 + 4 + 8 + 4 + 8
    if n_kv * 13 > size - r.pos:
        r.fail(f"key/value count {n_kv} cannot fit in a file of {size} bytes")
    if n_tensors * 32 > size - r.pos:
        r.fail(f"tensor count {n_tensors} cannot fit in a file of {size} bytes")
    h = GGUFHeader(path=path, size=size, version=version, n_tensors=n_tensors, n_kv=n_kv, kv_start=r.pos)
    for i in range(n_kv):
        start = r.pos
        key = r.string(f"key #{i}", limit=MAX_KEY)
        if key in h.kv:
            r.fail(f"duplicate key {key!r}")
        vstart = r.pos
        t = r.u32(f"type of {key}")
        array_type = count = None
        if t == T_ARRAY:
            save = r.pos
            array_type, count = r.u32(f"{key}"), r.u64(f"{key}")
            r.pos = save
        value = r.value(t, key)
        kv = KV(key, t, value, start, vstart, r.pos, array_type, count)
        h.kv[key] = kv
        h.kv_list.append(kv)
    align = h.get("general.alignment", DEFAULT_ALIGNMENT)
    if "general.alignment" in h.kv and (h.kv["general.alignment"].type != T_UINT32 or align <= 0
                                        or align & (align - 1)):
        r.fail(f"general.alignment must be a power of two (uint32), got {align!r}")
    h.alignment = align
    h.tensors_start = r.pos
    names = set()
    types = ggml_type_sizes()
    for i in range(n_tensors):
        start = r.pos
        name = r.string(f"name of tensor #{i}", limit=63)   # GGML_MAX_NAME - 1
        if name in names:
            r.fail(f"duplicate tensor name {name!r}")
        names.add(name)
        dims_start = r.pos
        nd = r.u32(f"dimension count of {name}")
        if not 1 <= nd <= MAX_DIMS:
            r.fail(f"tensor {name!r} has {nd} dimensions (1..{MAX_DIMS})")
        dims = [r.u64(f"dimension of {name}") for _ in range(nd)]
        type_start = r.pos
        t = r.u32(f"type of {name}")
        off = r.u64(f"offset of {name}")
        h.tensors.append(TensorInfo(name, dims, t, off, start, dims_start, type_start, r.pos))
    h.tensors_end = r.pos
    h.data_start = (r.pos + align - 1) // align * align
    _check_tensors(h, types, r)
    return h


def _nbytes(dims: list[int], block: int, tsize: int) -> int:
    n = 1
    for d in dims:
        n *= d
    return n // block * tsize


def _check_tensors(h: GGUFHeader, types: dict, r: _Reader) -> None:
    expected = 0
    data_size = h.size - h.data_start
    for t in h.tensors:
        if t.type not in types:
            r.fail(f"tensor {t.name!r} has unknown ggml type {t.type}")
        block, tsize = types[t.type]
        if any(d <= 0 for d in t.dims):
            r.fail(f"tensor {t.name!r} has a dimension <= 0: {t.dims}")
        prod = 1
        for d in t.dims:
            prod *= d
        if prod >= 2 ** 63 or any(d >= 2 ** 63 for d in t.dims):
            r.fail(f"tensor {t.name!r} has absurd dimensions {t.dims}")
        if t.dims[0] % block:
            r.fail(f"tensor {t.name!r}: first dimension {t.dims[0]} is not a multiple of the block size "
                   f"{block} of its type {t.type}")
        if t.offset != expected:
            r.fail(f"tensor {t.name!r} starts at data offset {t.offset}, expected {expected} "
                   "(offsets out of order or tensor sizes changed)")
        nb = _nbytes(t.dims, block, tsize)
        expected += (nb + h.alignment - 1) // h.alignment * h.alignment
        if t.offset + nb > data_size:
            r.fail(f"truncated: tensor {t.name!r} needs bytes up to {h.data_start + t.offset + nb}, "
                   f"the file has {h.size}")


# --------------------------------------------------------------------------- model-level checks
def _arch_int(h: GGUFHeader, arch: str, key: str, r: _Reader, *, required: bool = False,
              lo: int = 0, hi: int | None = None, per_layer: int | None = None):
    """An integer hyperparameter (scalar or per-layer array) within [lo, hi]; None if absent."""
    full = f"{arch}.{key}"
    kv = h.kv.get(full)
    if kv is None:
        if required:
            r.fail(f"missing key {full}")
        return None
    vals = kv.value if kv.type == T_ARRAY else [kv.value]
    if kv.type == T_ARRAY:
        if kv.array_type not in _INTEGER:
            r.fail(f"{full} must be an integer array, has element type {kv.array_type}")
        if per_layer is not None and len(vals) != per_layer:
            r.fail(f"{full} has {len(vals)} entries for {per_layer} layers")
    elif kv.type not in _INTEGER:
        r.fail(f"{full} must be an integer, has value type {kv.type}")
    for v in vals:
        if v < lo or (hi is not None and v > hi):
            r.fail(f"{full} = {v} is outside [{lo}, {hi if hi is not None else 'inf'}]")
    return vals


def _check_model(h: GGUFHeader, r: _Reader) -> None:
    arch = h.arch
    if not arch:
        r.fail("general.architecture is missing or not a string")
    n_layer = _arch_int(h, arch, "block_count", r, required=True, lo=1, hi=MAX_LAYERS)[0]
    n_embd = _arch_int(h, arch, "embedding_length", r, required=True, lo=1, hi=1 << 20)[0]
    heads = _arch_int(h, arch, "attention.head_count", r, lo=0, hi=1 << 16, per_layer=n_layer)
    kv_heads = _arch_int(h, arch, "attention.head_count_kv", r, lo=0, hi=1 << 16, per_layer=n_layer)
    if heads is not None and kv_heads is not None:
        for i, (a, b) in enumerate(zip(heads if len(heads) > 1 else heads * n_layer,
                                       kv_heads if len(kv_heads) > 1 else kv_heads * n_layer)):
            if a and (not b or a % b):
                r.fail(f"layer {i}: {a} attention heads are not a multiple of {b} KV heads")
    if heads is not None and not any(heads) and not has_recurrent_layers(arch):
        r.fail(f"{arch}.attention.head_count is 0 (only architectures with recurrent layers have no heads)")
    if heads is not None and len(heads) == 1 and heads[0] and f"{arch}.attention.key_length" not in h.kv \
            and n_embd % heads[0]:
        r.fail(f"embedding length {n_embd} is not a multiple of the head count {heads[0]}")
    _arch_int(h, arch, "attention.key_length", r, lo=1, hi=1 << 16)
    _arch_int(h, arch, "attention.value_length", r, lo=1, hi=1 << 16)
    _arch_int(h, arch, "feed_forward_length", r, lo=0, hi=1 << 24, per_layer=n_layer)
    _arch_int(h, arch, "context_length", r, lo=1, hi=1 << 25)   # llama_cpp allocates n_ctx_train tokens per tokenize
    n_expert = _arch_int(h, arch, "expert_count", r, lo=0, hi=MAX_EXPERTS)
    ne = (n_expert or [0])[0]
    n_used = _arch_int(h, arch, "expert_used_count", r, lo=0, hi=MAX_EXPERTS, per_layer=n_layer)
    nu = max(n_used or [0])
    if nu > ne or (ne > 0 and nu == 0):
        r.fail(f"{arch}.expert_used_count = {nu} does not fit expert_count = {ne}")
    groups = (_arch_int(h, arch, "expert_group_count", r, lo=0, hi=MAX_EXPERTS) or [0])[0]
    g_used = (_arch_int(h, arch, "expert_group_used_count", r, lo=0, hi=MAX_EXPERTS) or [0])[0]
    if (ne == 0 and groups) or (ne and groups >= ne) or \
            (groups > 1 and (ne % groups or not 0 < g_used < groups)):
        r.fail(f"expert groups ({groups}, {g_used} used) do not fit {ne} experts")
    _arch_int(h, arch, "nextn_predict_layers", r, lo=0, hi=n_layer)
    rope = h.get(f"{arch}.rope.scaling.type")
    if rope is not None and rope not in ("none", "linear", "yarn", "longrope"):
        r.fail(f"{arch}.rope.scaling.type {rope!r} is not one of none, linear, yarn, longrope")
    _check_vocab(h, r)
    if arch == "dflash":
        _check_drafter(h, r, n_layer)


def _check_vocab(h: GGUFHeader, r: _Reader) -> None:
    tokens = h.kv.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if tokens.type != T_ARRAY or tokens.array_type != T_STRING or not tokens.count:
        r.fail("tokenizer.ggml.tokens must be a non-empty array of strings")
    n = tokens.count
    # llama.cpp reads these as raw float32 / int32 arrays of n_tokens entries
    for key, elem in (("tokenizer.ggml.scores", T_FLOAT32), ("tokenizer.ggml.token_type", T_INT32)):
        kv = h.kv.get(key)
        if kv is not None and (kv.type != T_ARRAY or kv.count != n or kv.array_type != elem):
            r.fail(f"{key} must be an array of {n} {'float32' if elem == T_FLOAT32 else 'int32'} "
                   f"(one per token), has type {kv.type}/{kv.array_type} and {kv.count} entries")
    model = h.get("tokenizer.ggml.model")
    if model is not None and not isinstance(model, str):
        r.fail("tokenizer.ggml.model must be a string")
    merges = h.kv.get("tokenizer.ggml.merges")
    if merges is not None and (merges.type != T_ARRAY or merges.array_type != T_STRING):
        r.fail("tokenizer.ggml.merges must be an array of strings")
    for key, kv in h.kv.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if kv.type not in _INTEGER:
                r.fail(f"{key} must be an integer")


def _check_drafter(h: GGUFHeader, r: _Reader, n_layer: int) -> None:
    taps = h.kv.get("dflash.target_layers")
    if taps is None:
        r.fail("drafter without dflash.target_layers (not converted by a DFlash-aware converter)")
    if taps.type != T_ARRAY or taps.array_type not in _INTEGER or not 1 <= taps.count <= MAX_TAPS:
        r.fail(f"dflash.target_layers must be an integer array of 1..{MAX_TAPS} layer ids")
    if any(t < 0 or t >= MAX_LAYERS for t in taps.value):
        r.fail(f"dflash.target_layers {taps.value} holds ids outside [0, {MAX_LAYERS})")
    bs = h.kv.get("dflash.block_size")
    if bs is not None and (bs.type not in _INTEGER or not 2 <= bs.value <= 4096):
        r.fail(f"dflash.block_size must be an integer in [2, 4096], got {bs.value!r}")
    tokens = h.kv.get("tokenizer.ggml.tokens")
    n_vocab = tokens.count if tokens is not None else 1 << 31
    n_embd = h.get("dflash.embedding_length", 0)
    for key, lo, hi in (("selector_top_k", 0, min(n_vocab, 4096)), ("selector_rank", 0, 1 << 16),
                        ("conv_kernel_size", 0, 64), ("conv_group_size", 0, max(n_embd, 1))):
        kv = h.kv.get(f"dflash.{key}")
        if kv is not None and (kv.type not in _INTEGER or not lo <= kv.value <= hi):
            r.fail(f"dflash.{key} must be an integer in [{lo}, {hi}], got {kv.value!r}")
    group = h.get("dflash.conv_group_size", 0)
    if group and n_embd % group:
        r.fail(f"dflash.conv_group_size {group} does not divide the hidden size {n_embd}")
    mask = h.kv.get("tokenizer.ggml.mask_token_id")
    if mask is None:
        r.fail("drafter without tokenizer.ggml.mask_token_id")
    if tokens is not None and not 0 <= mask.value < tokens.count:
        r.fail(f"mask token id {mask.value} outside the vocabulary (0..{tokens.count - 1})")


def check_gguf(path: str | os.PathLike, *, role: str = "model") -> GGUFHeader:
    """Validate a model file before llama.cpp loads it; raises ModelFileError (or FileNotFoundError).

    ``role`` ("model", "target", "drafter") only shapes the messages and the drafter check.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{role} file not found: {path}")
    h = parse_gguf(path, light=True)
    r = _Reader(None, h.size, path)
    _check_model(h, r)
    if role == "target" and h.arch == "dflash":
        r.fail("this is a DFlash drafter, not a target model (pass it as draft_model_path; a pair.json "
               "with target and drafter swapped?)")
    if role == "drafter" and h.arch != "dflash":
        r.fail(f"general.architecture is {h.arch!r}, a drafter must be 'dflash' "
               "(pass the target as model_path and the drafter as draft_model_path)")
    return h


def drafter_kind(h: GGUFHeader) -> str:
    """``dspark`` (a Markov head: ``markov_w1``), ``dflash2`` (a candidate selector) or ``dflash``."""
    if any(t.name == "markov_w1.weight" for t in h.tensors):
        return "dspark"
    return "dflash2" if h.get("dflash.selector_top_k", 0) else "dflash"


def check_manifest(doc: dict, drafter: str | os.PathLike) -> None:
    """``pair.json`` must describe the drafter it names: kind, block size, taps and mask id agree.

    The engine runs on what the GGUF says; a manifest that disagrees means the pair directory was
    assembled from different conversions (a drafter copied over another one, a hand-edited file).
    """
    from dflash_gguf.errors import PairMismatchError

    h = parse_gguf(drafter)
    if h.arch != "dflash":
        raise PairMismatchError(f"pair.json names {Path(drafter).name} as the drafter, but its general.architecture "
                                f"is {h.arch!r}, not 'dflash' (target and drafter swapped?)")
    _check_model(h, _Reader(None, h.size, Path(drafter)))
    have = {"kind": drafter_kind(h),
            "block_size": h.get("dflash.block_size", 16),
            "target_layers": list(h.get("dflash.target_layers", []) or []),
            "mask_token_id": h.get("tokenizer.ggml.mask_token_id")}
    bad = []
    for key, value in have.items():
        if key not in doc:
            continue
        want = doc[key]
        if key == "target_layers":
            ok = isinstance(want, list) and [int(x) if isinstance(x, int) else x for x in want] == value
        elif key == "kind":
            ok = want == value
        else:
            ok = isinstance(want, int) and not isinstance(want, bool) and want == value
        if not ok:
            bad.append(f"{key}: pair.json {want!r}, drafter GGUF {value!r}")
    if bad:
        raise PairMismatchError(f"pair.json does not describe {Path(drafter).name} ({'; '.join(bad)}): the pair "
                                "directory mixes files of different conversions; convert the pair again")
