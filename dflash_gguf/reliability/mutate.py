"""Mutations of GGUF files and pair manifests for the hostile-file fuzzer.

Every mutation is a deterministic function of a base file and a seeded RNG. In-place edits keep
the file size (a flipped byte, a changed type id, dimension or integer value); structural edits
re-serialise the header (keys removed, duplicated or retyped; tensor infos dropped) and keep the
tensor data section byte for byte, re-aligned.
"""
from __future__ import annotations

import random
import struct
from dataclasses import dataclass
from typing import Callable

from dflash_gguf.native.gguf_check import (KV, T_ARRAY, T_INT32, T_STRING, T_UINT32, T_UINT64, _INTEGER, _SCALAR,
                                    GGUFHeader, TensorInfo)

HUGE = (2 ** 31 - 1, 2 ** 32 - 1, 2 ** 40, 2 ** 63 - 1, 2 ** 64 - 1)


@dataclass
class FileMutation:
    """One mutated copy of a GGUF: ``cls`` (mutation class), ``desc`` and a function of the bytes."""
    cls: str
    desc: str
    fn: Callable[[bytes], bytes]


def _set(data: bytes, off: int, raw: bytes) -> bytes:
    b = bytearray(data)
    b[off:off + len(raw)] = raw
    return bytes(b)


def _int_raw(t: int, v: int) -> bytes:
    size = struct.calcsize(_SCALAR[t])
    return (v & ((1 << 8 * size) - 1)).to_bytes(size, "little")


def kv_raw(key: str, t: int, value, array_type: int | None = None) -> bytes:
    """Serialise one key/value entry."""
    out = struct.pack("<Q", len(key.encode())) + key.encode() + struct.pack("<I", t)
    return out + _value_raw(t, value, array_type)


def _value_raw(t: int, value, array_type: int | None = None) -> bytes:
    if t == T_STRING:
        b = value.encode() if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(b)) + b
    if t == T_ARRAY:
        return struct.pack("<IQ", array_type, len(value)) + b"".join(_value_raw(array_type, v) for v in value)
    if t in _INTEGER:
        return _int_raw(t, int(value))
    return struct.pack(_SCALAR[t], value)


def rebuild(data: bytes, h: GGUFHeader, kvs: list[bytes], tensors: list[bytes],
            n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A GGUF with these raw key/value and tensor-info entries and the original tensor data."""
    head = data[:8] + struct.pack("<QQ", len(tensors) if n_tensors is None else n_tensors,
                                  len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * ((-len(body)) % h.alignment)
    return body + data[h.data_start:]


def _raw_kvs(data: bytes, h: GGUFHeader) -> list[bytes]:
    return [data[kv.start:kv.end] for kv in h.kv_list]


def _raw_tensors(data: bytes, h: GGUFHeader) -> list[bytes]:
    return [data[t.start:t.end] for t in h.tensors]


def _scalar_value_offset(kv: KV) -> int:
    return kv.value_start + 4


# --------------------------------------------------------------------------- generators
def truncations(h: GGUFHeader, rng: random.Random, n_random: int) -> list[FileMutation]:
    marks = {0: "empty file", 3: "inside the magic", 4: "after the magic", 8: "after the version",
             16: "after the tensor count", 24: "after the header"}
    kvl = h.kv_list
    if kvl:
        mid = kvl[len(kvl) // 2]
        marks.update({kvl[0].value_start: "after the first key", mid.start: f"before key {mid.key}",
                      mid.value_start + 2: f"inside the type of {mid.key}", kvl[-1].end - 1: "inside the last value"})
        big = max(kvl, key=lambda kv: kv.end - kv.start)
        marks[(big.start + big.end) // 2] = f"inside {big.key}"
    marks.update({h.tensors_start: "at the tensor-info section", h.tensors_end: "after the tensor infos",
                  (h.tensors_start + h.tensors_end) // 2: "inside the tensor infos",
                  h.data_start: "at the data section", h.data_start + 1: "one byte into the data",
                  (h.data_start + h.size) // 2: "half of the data", h.size - 1: "last byte missing"})
    if h.tensors:
        t = h.tensors[0]
        marks[t.dims_start + 4] = f"inside the dimensions of {t.name}"
        if len(h.tensors) > 2:
            t = h.tensors[len(h.tensors) // 2]
            marks[h.data_start + t.offset] = f"at the data of {t.name}"
    out = [FileMutation("truncate-boundary", f"truncated at {off} ({what})", lambda d, o=off: d[:o])
           for off, what in sorted(marks.items()) if 0 <= off < h.size]
    for _ in range(n_random):
        off = rng.randrange(1, h.size)
        out.append(FileMutation("truncate-random", f"truncated at random offset {off}", lambda d, o=off: d[:o]))
    return out


def header_flips(h: GGUFHeader, rng: random.Random, n_random: int) -> list[FileMutation]:
    out = [
        FileMutation("header", "version 1", lambda d: _set(d, 4, struct.pack("<I", 1))),
        FileMutation("header", "version 4", lambda d: _set(d, 4, struct.pack("<I", 4))),
        FileMutation("header", "version 0xffffffff", lambda d: _set(d, 4, struct.pack("<I", 2 ** 32 - 1))),
        FileMutation("header", "tensor count + 1", lambda d: _set(d, 8, struct.pack("<Q", h.n_tensors + 1))),
        FileMutation("header", "tensor count - 1", lambda d: _set(d, 8, struct.pack("<Q", max(h.n_tensors - 1, 0)))),
        FileMutation("header", "key/value count + 1", lambda d: _set(d, 16, struct.pack("<Q", h.n_kv + 1))),
        FileMutation("header", "key/value count - 1", lambda d: _set(d, 16, struct.pack("<Q", max(h.n_kv - 1, 0)))),
        FileMutation("header", "tensor count 2**63", lambda d: _set(d, 8, struct.pack("<Q", 2 ** 63))),
        FileMutation("header", "key/value count 2**62", lambda d: _set(d, 16, struct.pack("<Q", 2 ** 62))),
        FileMutation("header", "magic GGUG", lambda d: _set(d, 0, b"GGUG")),
    ]
    for _ in range(n_random):
        off, bit = rng.randrange(0, 24), rng.randrange(8)
        out.append(FileMutation("header-flip", f"bit {bit} of header byte {off} flipped",
                                lambda d, o=off, b=bit: _set(d, o, bytes([d[o] ^ (1 << b)]))))
    return out


def section_flips(h: GGUFHeader, rng: random.Random, n_kv: int, n_ti: int, n_data: int) -> list[FileMutation]:
    out = []
    for cls, lo, hi, n in (("kv-flip", h.kv_start, h.tensors_start, n_kv),
                           ("tensor-info-flip", h.tensors_start, h.tensors_end, n_ti),
                           ("data-flip", h.data_start, h.size, n_data)):
        for _ in range(n):
            off, val = rng.randrange(lo, hi), rng.randrange(256)
            out.append(FileMutation(cls, f"byte {off} set to {val:#04x}", lambda d, o=off, v=val: _set(d, o, bytes([v]))))
    return out


def tensor_edits(h: GGUFHeader, rng: random.Random, n_type: int, n_shape: int) -> list[FileMutation]:
    out = []
    types = [0, 1, 2, 8, 12, 14, 30, 4, 31, 36, 40, 99, 2 ** 32 - 1]
    for _ in range(n_type):
        t = rng.choice(h.tensors)
        ty = rng.choice([x for x in types if x != t.type])
        out.append(FileMutation("tensor-type", f"{t.name} type {t.type} -> {ty}",
                                lambda d, t=t, ty=ty: _set(d, t.type_start, struct.pack("<I", ty))))
    for _ in range(n_shape):
        t = rng.choice(h.tensors)
        i = rng.randrange(len(t.dims))
        d0 = t.dims[i]
        v = rng.choice([0, 1, d0 + 1, d0 * 2, max(d0 // 2, 1), 2 ** 32, 2 ** 62, 2 ** 64 - 1])
        out.append(FileMutation("tensor-shape", f"{t.name} dim {i} {d0} -> {v}",
                                lambda d, t=t, i=i, v=v: _set(d, t.dims_start + 4 + 8 * i, struct.pack("<Q", v))))
    if len(h.tensors) > 1:
        a, b = h.tensors[0], h.tensors[-1]
        out.append(FileMutation("tensor-shape", f"{a.name} dims swapped" if len(a.dims) > 1 else f"{a.name} 1-D -> 2-D",
                                lambda d, a=a: _set(d, a.dims_start + 4, struct.pack("<Q", a.dims[-1]) +
                                                    (struct.pack("<Q", a.dims[0]) if len(a.dims) > 1 else b""))))
        out.append(FileMutation("tensor-info", f"tensor {b.name} dropped",
                                lambda d: rebuild(d, h, _raw_kvs(d, h), _raw_tensors(d, h)[:-1])))
        mid = h.tensors[len(h.tensors) // 2]
        out.append(FileMutation("tensor-info", f"tensor {mid.name} dropped (later offsets now wrong)",
                                lambda d, m=mid: rebuild(d, h, _raw_kvs(d, h),
                                                         [x for t, x in zip(h.tensors, _raw_tensors(d, h)) if t is not m])))
        out.append(FileMutation("tensor-info", f"tensor {a.name} renamed to {b.name} (duplicate name)",
                                lambda d, a=a, b=b: rebuild(d, h, _raw_kvs(d, h),
                                                            [_rename(d, a, b.name)] + _raw_tensors(d, h)[1:])))
        out.append(FileMutation("tensor-info", f"tensor {a.name} renamed (a required tensor is missing)",
                                lambda d, a=a: rebuild(d, h, _raw_kvs(d, h),
                                                       [_rename(d, a, a.name + ".x")] + _raw_tensors(d, h)[1:])))
        out.append(FileMutation("tensor-info", f"{a.name} offset + 32",
                                lambda d, a=a: _set(d, a.end - 8, struct.pack("<Q", a.offset + 32))))
    return out


def _rename(data: bytes, t: TensorInfo, name: str) -> bytes:
    return struct.pack("<Q", len(name.encode())) + name.encode() + data[t.dims_start:t.end]


def absurd_counts(h: GGUFHeader, rng: random.Random) -> list[FileMutation]:
    out = []
    arrays = [kv for kv in h.kv_list if kv.type == T_ARRAY]
    for kv in arrays[:6]:
        for v in (kv.count + 1, 2 ** 40, 2 ** 63):
            out.append(FileMutation("absurd-count", f"{kv.key}: array length {kv.count} -> {v}",
                                    lambda d, kv=kv, v=v: _set(d, kv.value_start + 8, struct.pack("<Q", v))))
    strings = [kv for kv in h.kv_list if kv.type == T_STRING]
    for kv in strings[:3]:
        out.append(FileMutation("absurd-count", f"{kv.key}: string length 2**62",
                                lambda d, kv=kv: _set(d, kv.value_start + 4, struct.pack("<Q", 2 ** 62))))
    if h.kv_list:
        kv = h.kv_list[len(h.kv_list) // 2]
        out.append(FileMutation("absurd-count", f"key length of {kv.key} 2**63",
                                lambda d, kv=kv: _set(d, kv.start, struct.pack("<Q", 2 ** 63))))
        out.append(FileMutation("absurd-count", f"value type of {kv.key} 200",
                                lambda d, kv=kv: _set(d, kv.value_start, struct.pack("<I", 200))))
    for kv in arrays[:2]:
        out.append(FileMutation("absurd-count", f"{kv.key}: element type 9 (nested array)",
                                lambda d, kv=kv: _set(d, kv.value_start + 4, struct.pack("<I", T_ARRAY))))
    if h.tensors:
        t = h.tensors[rng.randrange(len(h.tensors))]
        for nd in (0, 5, 2 ** 32 - 1):
            out.append(FileMutation("absurd-count", f"{t.name}: {nd} dimensions",
                                    lambda d, t=t, nd=nd: _set(d, t.dims_start, struct.pack("<I", nd))))
    return out


def hparam_edits(h: GGUFHeader, rng: random.Random, n: int) -> list[FileMutation]:
    """Integer hyperparameters (scalars and per-layer arrays) set to 0, 1, -1 or absurd values."""
    arch = h.arch or ""
    ints = [kv for kv in h.kv_list if kv.type in _INTEGER and
            (kv.key.startswith(arch + ".") or kv.key.startswith("tokenizer.ggml.") or kv.key == "general.alignment")]
    pool = []
    for kv in ints:
        for v in (0, 1, -1, kv.value + 1, kv.value * 2, 2 ** 31 - 1, 2 ** 32 - 1, 2 ** 63 - 1):
            pool.append((kv, v))
    # always: the values llama.cpp is known to be touchy about
    must = [(kv, v) for kv in ints for v in (0, 2 ** 32 - 1)
            if kv.key.split(".")[-1] in ("block_count", "head_count", "head_count_kv", "embedding_length",
                                         "expert_count", "expert_used_count", "block_size", "mask_token_id")]
    rng.shuffle(pool)
    chosen = must + pool[:max(0, n - len(must))]
    out = []
    for kv, v in chosen:
        size = struct.calcsize(_SCALAR[kv.type])
        raw = (v & ((1 << 8 * size) - 1)).to_bytes(size, "little")
        out.append(FileMutation("hparam", f"{kv.key} {kv.value} -> {v}",
                                lambda d, kv=kv, raw=raw: _set(d, _scalar_value_offset(kv), raw)))
    arrays = [kv for kv in h.kv_list if kv.type == T_ARRAY and kv.array_type in _INTEGER and kv.key.startswith(arch + ".")]
    for kv in arrays:
        size = struct.calcsize(_SCALAR[kv.array_type])
        for i, v in ((0, -1), (kv.count - 1, 2 ** 31 - 1), (0, 10_000)):
            raw = (v & ((1 << 8 * size) - 1)).to_bytes(size, "little")
            out.append(FileMutation("hparam", f"{kv.key}[{i}] -> {v}",
                                    lambda d, kv=kv, i=i, raw=raw: _set(d, kv.value_start + 12 + i * len(raw), raw)))
    return out


def kv_structure(h: GGUFHeader, rng: random.Random, n_remove: int, n_retype: int) -> list[FileMutation]:
    out = []
    keys = [kv for kv in h.kv_list]
    important = [kv for kv in keys if kv.key in ("general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.model",
                                                 "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                                                 "tokenizer.ggml.merges") or kv.key.endswith(".block_count")
                 or kv.key.endswith(".embedding_length") or kv.key.endswith(".attention.head_count")]
    others = [kv for kv in keys if kv not in important]
    rng.shuffle(others)
    for kv in (important + others)[:max(n_remove, len(important))]:
        out.append(FileMutation("kv-remove", f"key {kv.key} removed",
                                lambda d, kv=kv: rebuild(d, h, [x for k, x in zip(h.kv_list, _raw_kvs(d, h)) if k is not kv],
                                                         _raw_tensors(d, h))))
    rng.shuffle(keys)
    for kv in keys[:n_retype]:
        if kv.type == T_STRING:
            new = kv_raw(kv.key, T_UINT32, 7)
            what = "string -> uint32"
        elif kv.type == T_ARRAY and kv.array_type == T_STRING:
            new = kv_raw(kv.key, T_ARRAY, list(range(kv.count)), T_INT32)
            what = "string array -> int32 array of the same length"
        elif kv.type == T_ARRAY:
            new = kv_raw(kv.key, T_ARRAY, [str(i) for i in range(min(kv.count, 64))], T_STRING)
            what = "array -> string array"
        else:
            new = kv_raw(kv.key, T_STRING, "not a number")
            what = f"type {kv.type} -> string"
        out.append(FileMutation("kv-retype", f"{kv.key}: {what}",
                                lambda d, kv=kv, new=new: rebuild(d, h, [new if k is kv else x for k, x in
                                                                         zip(h.kv_list, _raw_kvs(d, h))], _raw_tensors(d, h))))
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        kv = h.kv.get(key)
        if kv is not None and kv.count:
            short = kv_raw(key, T_ARRAY, kv.value[: kv.count // 2], kv.array_type)
            out.append(FileMutation("kv-retype", f"{key} half as long as the vocabulary",
                                    lambda d, kv=kv, new=short: rebuild(
                                        d, h, [new if k is kv else x for k, x in zip(h.kv_list, _raw_kvs(d, h))],
                                        _raw_tensors(d, h))))
            u8 = kv_raw(key, T_ARRAY, [0] * kv.count, 0)
            out.append(FileMutation("kv-retype", f"{key} as uint8 array",
                                    lambda d, kv=kv, new=u8: rebuild(d, h, [new if k is kv else x for k, x in
                                                                            zip(h.kv_list, _raw_kvs(d, h))], _raw_tensors(d, h))))
    if h.kv_list:
        kv = h.kv_list[-1]
        out.append(FileMutation("kv-remove", f"key {kv.key} duplicated",
                                lambda d, kv=kv: rebuild(d, h, _raw_kvs(d, h) + [d[kv.start:kv.end]], _raw_tensors(d, h))))
    out.append(FileMutation("kv-retype", "general.alignment = 7 (not a power of two)",
                            lambda d: rebuild(d, h, _raw_kvs(d, h) + [kv_raw("general.alignment", T_UINT32, 7)],
                                              _raw_tensors(d, h))))
    out.append(FileMutation("kv-retype", "general.alignment as uint64",
                            lambda d: rebuild(d, h, _raw_kvs(d, h) + [kv_raw("general.alignment", T_UINT64, 32)],
                                              _raw_tensors(d, h))))
    return out


def drafter_fields(h: GGUFHeader, target_layers: int, target_vocab: int) -> list[FileMutation]:
    """Wrong or missing DFlash fields of a drafter (taps, block size, mask id, selector)."""
    out = []

    def replace(key: str, raw: bytes | None, desc: str, cls: str = "dflash-field"):
        kv = h.kv.get(key)
        def fn(d, kv=kv, raw=raw):
            kvs = [x for k, x in zip(h.kv_list, _raw_kvs(d, h)) if k is not kv]
            if raw is not None:
                kvs.append(raw)
            return rebuild(d, h, kvs, _raw_tensors(d, h))
        out.append(FileMutation(cls, desc, fn))

    taps = h.kv.get("dflash.target_layers")
    if taps is not None:
        at = taps.array_type
        for bad in ([target_layers], [target_layers - 1 + 1000], [-1], [2 ** 31 - 1], [], list(range(100)),
                    [0] * len(taps.value), list(reversed(taps.value))):
            replace("dflash.target_layers", kv_raw("dflash.target_layers", T_ARRAY, bad, at),
                    f"dflash.target_layers {taps.value} -> {bad[:8]}{'...' if len(bad) > 8 else ''}")
        replace("dflash.target_layers", None, "dflash.target_layers removed")
        replace("dflash.target_layers", kv_raw("dflash.target_layers", T_UINT32, 1), "dflash.target_layers as a scalar")
    for key in ("dflash.block_size",):
        kv = h.kv.get(key)
        t = kv.type if kv is not None else T_UINT32
        for v in (0, 1, 2, 3, 16, 64, 1000, 2 ** 31 - 1, 2 ** 32 - 1):
            replace(key, kv_raw(key, t, v), f"{key} -> {v}")
        replace(key, None, f"{key} removed (llama.cpp's default applies)")
        replace(key, kv_raw(key, T_STRING, "eight"), f"{key} as a string")
    key = "tokenizer.ggml.mask_token_id"
    kv = h.kv.get(key)
    t = kv.type if kv is not None else T_UINT32
    for v in (target_vocab, target_vocab - 1, 0, 2 ** 31, 2 ** 32 - 1):
        replace(key, kv_raw(key, t, v), f"{key} -> {v}")
    replace(key, None, f"{key} removed")
    for kv in h.kv_list:
        if kv.key.startswith("dflash.") and kv.key not in ("dflash.target_layers", "dflash.block_size") \
                and kv.type in _INTEGER:
            for v in (0, 2 ** 31 - 1):
                replace(kv.key, kv_raw(kv.key, kv.type, v), f"{kv.key} -> {v}")
    replace("general.architecture", kv_raw("general.architecture", T_STRING, "qwen3"),
            "drafter claims general.architecture = qwen3")
    return out


def hparam_additions(h: GGUFHeader) -> list[FileMutation]:
    """Keys the file does not have, added with values llama.cpp asserts on (MoE, rope, MTP layers)."""
    arch = h.arch or "x"
    n_layer = h.get(f"{arch}.block_count", 1) or 1
    adds = [
        ("expert_used_count without experts", [(f"{arch}.expert_used_count", T_UINT32, 2)]),
        ("expert_count above llama.cpp's limit", [(f"{arch}.expert_count", T_UINT32, 100_000),
                                                  (f"{arch}.expert_used_count", T_UINT32, 2)]),
        ("more experts used than exist", [(f"{arch}.expert_count", T_UINT32, 4), (f"{arch}.expert_used_count", T_UINT32, 8)]),
        ("experts without any used", [(f"{arch}.expert_count", T_UINT32, 4), (f"{arch}.expert_used_count", T_UINT32, 0)]),
        ("expert groups without experts", [(f"{arch}.expert_group_count", T_UINT32, 2)]),
        ("expert groups not dividing the experts", [(f"{arch}.expert_count", T_UINT32, 6),
                                                    (f"{arch}.expert_used_count", T_UINT32, 2),
                                                    (f"{arch}.expert_group_count", T_UINT32, 4),
                                                    (f"{arch}.expert_group_used_count", T_UINT32, 1)]),
        ("unknown rope scaling type", [(f"{arch}.rope.scaling.type", T_STRING, "cubic")]),
        ("rope scaling type as a number", [(f"{arch}.rope.scaling.type", T_UINT32, 3)]),
        ("more MTP layers than layers", [(f"{arch}.nextn_predict_layers", T_UINT32, n_layer + 5)]),
        ("per-layer head counts of the wrong length", [(f"{arch}.attention.head_count", T_ARRAY, [4] * (n_layer + 3))]),
    ]
    out = []
    for desc, entries in adds:
        keys = {k for k, _, _ in entries}
        raws = [kv_raw(k, t, v, T_INT32 if t == T_ARRAY else None) for k, t, v in entries]

        def fn(d, keys=keys, raws=raws):
            kvs = [x for kv, x in zip(h.kv_list, _raw_kvs(d, h)) if kv.key not in keys]
            return rebuild(d, h, kvs + raws, _raw_tensors(d, h))
        out.append(FileMutation("hparam-add", desc, fn))
    return out
