"""Hugging Face target + DFlash drafter -> a validated GGUF pair directory.

``python -m dflash_gguf.convert TARGET_DIR DRAFTER_DIR -o OUT_DIR [--quantize q4_0]`` or, from Python::

    from dflash_gguf.convert import convert_pair, check_pair, load_manifest
    convert_pair("Qwen3-8B", "Qwen3-8B-DFlash-b16", "out", quantize="q4_0")
    assert check_pair("out").ok
    pair = load_manifest("out")          # pair.target.path, pair.drafter.path, ...

Modules: ``hf`` (reading checkpoints), ``validate`` (pair rules), ``dspark`` (the DSpark forms), ``targets`` (which
HF targets can feed a drafter: the converter's registry and the library's list), ``upstream`` (llama.cpp's
converter), ``quantize``, ``manifest`` (pair.json), ``pipeline`` (convert_pair), ``check``, ``cli``.
"""
from __future__ import annotations

from dflash_gguf.convert.check import CheckResult, check_pair
from dflash_gguf.convert.errors import ConvertError, ManifestError, OutputError, PairError
from dflash_gguf.convert.manifest import PairFile, PairManifest, load_manifest
from dflash_gguf.convert.pipeline import convert_pair
from dflash_gguf.convert.validate import PairSpec, validate_pair


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.convert.cli import main as _main

    return _main(argv)


__all__ = ["CheckResult", "ConvertError", "ManifestError", "OutputError", "PairError", "PairFile", "PairManifest",
           "PairSpec", "check_pair", "convert_pair", "load_manifest", "main", "validate_pair"]
