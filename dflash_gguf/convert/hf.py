"""Read a Hugging Face checkpoint folder cheaply: config.json and the safetensors headers only.

No tensor data is read. A header is checked against the file size, so a truncated or
corrupted download is caught before the (slow) conversion starts.
"""
from __future__ import annotations

import json
import logging
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf.convert.errors import PairError

log = logging.getLogger("dflash_gguf.convert")

# bytes per element of the safetensors dtypes (F4 packs two per byte)
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 0.5}
_MAX_HEADER = 100 * 1024 * 1024
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


@dataclass
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int = 0                 # of its data in ``file`` (for the few tensors that are compared)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)


@dataclass
class Checkpoint:
    """A Hugging Face folder: its merged text config and the tensors its safetensors declare."""
    path: Path
    role: str                       # "target" or "drafter" (for messages)
    config: dict                    # config.json, with text_config merged over it
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    weight_files: list[Path] = field(default_factory=list)
    headers_checked: bool = True    # False for pytorch_model*.bin checkpoints

    @property
    def architecture(self) -> str:
        archs = self.config.get("architectures") or []
        return archs[0] if archs else ""

    @property
    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)

    @property
    def n_params(self) -> int:
        return sum(t.n_elements for t in self.tensors.values())

    def get(self, key: str, default=None):
        return self.config.get(key, default)


def read_checkpoint(path: str | Path, role: str) -> Checkpoint:
    """Read ``config.json`` and every safetensors header of the folder ``path``."""
    p = Path(path).expanduser()
    what = f"{role} folder {p}"
    if not p.exists():
        raise PairError(f"{what} does not exist: check the path (a local Hugging Face checkpoint folder)")
    if not p.is_dir():
        raise PairError(f"{what} is not a directory: pass the folder that holds config.json and *.safetensors")
    try:
        names = {c.name for c in p.iterdir()}
    except OSError as e:
        raise PairError(f"{what} cannot be read ({e.strerror or e}): fix its permissions") from e
    if "config.json" not in names:
        raise PairError(f"{what} has no config.json: pass the folder of a Hugging Face checkpoint "
                        "(download the full repository, not only the weights)")
    cfg_file = p / "config.json"
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8"))
    except OSError as e:
        raise PairError(f"{cfg_file} cannot be read ({e.strerror or e}): fix its permissions") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PairError(f"{cfg_file} is not valid JSON ({e}): the download is damaged, fetch it again") from e
    if not isinstance(raw, dict):
        raise PairError(f"{cfg_file} is not a JSON object: the download is damaged, fetch it again")
    config = {**raw, **(raw.get("text_config") or {})}
    if raw.get("architectures"):
        config["architectures"] = raw["architectures"]
    ckpt = Checkpoint(path=p.resolve(), role=role, config=config)
    _read_weights(ckpt, names)
    return ckpt


def _read_weights(ckpt: Checkpoint, names: set[str]) -> None:
    p = ckpt.path
    index = p / "model.safetensors.index.json"
    if index.name in names:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PairError(f"{index} is damaged ({e}): fetch it again") from e
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (p / f).is_file()]
        if missing:
            raise PairError(f"{ckpt.role} folder {p} lacks {len(missing)} weight shard(s) listed in {index.name} "
                            f"(first: {missing[0]}): the download is incomplete, fetch the missing files")
        ckpt.weight_files = [p / f for f in files]
    else:
        ckpt.weight_files = sorted(p / n for n in names if n.endswith(".safetensors"))
    if not ckpt.weight_files:
        bins = sorted(p / n for n in names if n.startswith("pytorch_model") and n.endswith(".bin"))
        if not bins:
            raise PairError(f"{ckpt.role} folder {p} holds no weights (*.safetensors or pytorch_model*.bin): "
                            "the download is incomplete")
        log.warning("%s %s has only PyTorch .bin weights: their integrity cannot be checked before conversion",
                    ckpt.role, p)
        ckpt.weight_files, ckpt.headers_checked = bins, False
        return
    for f in ckpt.weight_files:
        for name, info in read_safetensors_header(f).items():
            ckpt.tensors[name] = info
    if index.name in names:
        absent = [n for n, f in weight_map.items() if n not in ckpt.tensors]
        if absent:
            raise PairError(f"{ckpt.role} tensor {absent[0]!r} is listed in {index.name} but not found in "
                            f"{weight_map[absent[0]]}: the shard is damaged, fetch it again")


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header and check that its tensors exactly fill the rest of the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"only {size} bytes long (truncated)")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, _MAX_HEADER):
                raise _corrupt(path, f"its header claims {n} bytes but the file holds {size} (truncated or "
                                     "not a safetensors file)")
            blob = fh.read(n)
    except OSError as e:
        raise PairError(f"{path} cannot be read ({e.strerror or e}): fix its permissions") from e
    try:
        header = json.loads(blob.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise _corrupt(path, f"its header is not valid JSON ({e})") from e
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    end_max, out = 0, {}
    for name, t in header.items():
        try:
            dtype, shape, (b, e) = t["dtype"], tuple(int(d) for d in t["shape"]), t["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise _corrupt(path, f"tensor {name!r} has a malformed header entry ({err})") from err
        if not 0 <= b <= e:
            raise _corrupt(path, f"tensor {name!r} has invalid data offsets [{b}, {e}]")
        per = _DTYPE_BYTES.get(dtype)
        if per is not None and e - b != math.ceil(math.prod(shape) * per):
            raise _corrupt(path, f"tensor {name!r} ({dtype} {list(shape)}) spans {e - b} bytes, expected "
                                 f"{math.ceil(math.prod(shape) * per)}")
        end_max = max(end_max, e)
        out[name] = TensorInfo(dtype=dtype, shape=shape, file=path, offset=8 + n + b)
    if end_max > data_len:
        raise _corrupt(path, f"it is truncated: the header describes {end_max} bytes of tensor data, the file "
                             f"holds {data_len}")
    if end_max < data_len:
        raise _corrupt(path, f"it has {data_len - end_max} bytes after the last tensor (damaged, or written "
                             "by a broken tool)")
    return out


def _corrupt(path: Path, why: str) -> PairError:
    return PairError(f"{path} is not a valid safetensors file: {why}. Download the checkpoint again "
                     "(e.g. `huggingface-cli download` resumes and verifies files)")


def has_tokenizer(ckpt: Checkpoint) -> bool:
    return any((ckpt.path / n).is_file() for n in TOKENIZER_FILES)
