"""Writing ``pair.json``, the manifest that links a target GGUF and its drafter GGUF in one directory.

The format and its reader live in :mod:`dflash_gguf.pair` (the runtime opens pairs there).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from dflash_gguf.pair import (FORMAT, FORMAT_VERSION, MANIFEST, PairFile, PairManifest,  # noqa: F401
                              load_manifest)
from dflash_gguf.paths import sha256_file


def converter_version() -> dict:
    from dflash_gguf import __version__, paths
    from dflash_gguf.build import native as build

    return {"dflash_gguf": __version__, "llama_cpp_python_sdist": build.SDIST_VERSION,
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
                              n_layer=d.get("num_hidden_layers"), source=str(d.path),
                              sliding_window=spec.attention.sliding_window, causal=spec.attention.causal),
        **({"sample_from_anchor": spec.dspark.sample_from_anchor, "dspark": spec.dspark.manifest()}
           if spec.dspark is not None else {}),
        "notes": list(spec.attention.notes) + (list(spec.dspark.notes) if spec.dspark is not None else []),
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
