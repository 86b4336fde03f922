"""``pair.json``: the manifest that links a target GGUF and its drafter GGUF in one directory.

:func:`load_manifest` opens a pair directory in one call (the Llama API uses it): it checks that
both files exist with the recorded sizes, and (``verify=True``) their sha256.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_gguf.convert.errors import ManifestError

MANIFEST = "pair.json"
FORMAT = "dflash-gguf-pair"
FORMAT_VERSION = 1


@dataclass
class PairFile:
    path: Path
    size: int
    sha256: str
    type: str


@dataclass
class PairManifest:
    """A loaded ``pair.json``; ``data`` holds the whole document."""
    dir: Path
    target: PairFile
    drafter: PairFile
    kind: str                   # "dflash" | "dflash2"
    block_size: int
    target_layers: list[int]    # GGUF convention: input of layer i (= HF target_layer_ids + 1)
    mask_token_id: int
    data: dict


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def converter_version() -> dict:
    from dflash_gguf import build, paths

    try:
        from importlib.metadata import version

        own = version("dflash-gguf")
    except Exception:
        own = "unknown"
    return {"dflash_gguf": own, "llama_cpp_python_sdist": build.SDIST_VERSION,
            "patch_series": paths.patch_series_hash()}


def file_entry(path: Path, gguf_type: str, **extra) -> dict:
    return {"file": path.name, "size": path.stat().st_size, "sha256": sha256_file(path), "type": gguf_type, **extra}


def build_manifest(spec, target_file: Path, target_type: str, drafter_file: Path, drafter_type: str) -> dict:
    """The manifest document for a converted :class:`~dflash_gguf.convert.validate.PairSpec`."""
    t, d = spec.target, spec.drafter
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kind": spec.kind,
        "block_size": spec.block_size,
        "mask_token_id": spec.mask_token_id,
        "target_layers": spec.gguf_target_layers,
        "target_layers_convention": "GGUF dflash.target_layers: input of layer i = output of HF layer i-1",
        "hf_target_layer_ids": spec.target_layer_ids,
        "target": file_entry(target_file, target_type, arch=spec.target_arch, hf_architecture=t.architecture,
                             n_layer=spec.n_layer, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                             source=str(t.path)),
        "drafter": file_entry(drafter_file, drafter_type, arch="dflash", hf_architecture=d.architecture,
                              n_layer=d.get("num_hidden_layers"), source=str(d.path)),
        "converter": converter_version(),
    }


def write_manifest(out_dir: Path, doc: dict) -> Path:
    """Write ``pair.json`` (through a temporary name, fsynced)."""
    path = out_dir / MANIFEST
    tmp = out_dir / (MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def load_manifest(pair_dir: str | os.PathLike, *, verify: bool = False) -> PairManifest:
    """Open a pair directory: read ``pair.json``, check both files (sizes; sha256 if ``verify``)."""
    d = Path(pair_dir).expanduser()
    path = d / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{d} is not a converted pair ({MANIFEST} missing): make one with "
                            "`python -m dflash_gguf.convert TARGET_DIR DRAFTER_DIR -o OUT_DIR`")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
        if doc.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"format_version {doc['format_version']} is newer than this dflash-gguf "
                             f"({FORMAT_VERSION}); upgrade dflash-gguf")
        files = {role: _pair_file(d, doc[role], role, verify) for role in ("target", "drafter")}
        return PairManifest(dir=d.resolve(), target=files["target"], drafter=files["drafter"], kind=doc["kind"],
                            block_size=int(doc["block_size"]), target_layers=[int(x) for x in doc["target_layers"]],
                            mask_token_id=int(doc["mask_token_id"]), data=doc)
    except ManifestError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:   # AttributeError: not a JSON object
        raise ManifestError(f"{path} is damaged ({e}): convert the pair again") from e


def _pair_file(d: Path, entry: dict, role: str, verify: bool) -> PairFile:
    f = PairFile(path=(d / entry["file"]).resolve(), size=int(entry["size"]), sha256=str(entry["sha256"]),
                 type=str(entry["type"]))
    if Path(entry["file"]).name != entry["file"]:
        raise ManifestError(f"{role} file name {entry['file']!r} in {d / MANIFEST} must be a plain file name")
    if not f.path.is_file():
        raise ManifestError(f"the {role} GGUF {f.path} listed in {MANIFEST} is missing: copy the whole pair "
                            "directory, or convert the pair again")
    size = f.path.stat().st_size
    if size != f.size:
        raise ManifestError(f"the {role} GGUF {f.path} has {size} bytes, {MANIFEST} records {f.size}: the file is "
                            "truncated or was replaced; copy it again or convert the pair again")
    if verify and sha256_file(f.path) != f.sha256:
        raise ManifestError(f"the {role} GGUF {f.path} does not match the sha256 in {MANIFEST}: the file is "
                            "corrupted or was replaced; copy it again or convert the pair again")
    return f
