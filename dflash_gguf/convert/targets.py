"""Which Hugging Face target architectures can feed a DFlash drafter: derived, not listed.

Two facts decide it, each read from where it is defined:

- the GGUF architecture a Hugging Face ``architectures[0]`` converts to: the registry of the pinned
  tree's own ``convert_hf_to_gguf.py`` (``ModelBase``'s registered text-model classes carry
  ``model_arch``; gguf-py's ``MODEL_ARCH_NAMES`` names it);
- whether llama.cpp's graph for that architecture records the layer inputs a drafter taps: the
  library's one list, :func:`dflash_gguf.native._bindings.tappable_archs`.

Reading the registry imports the converter (torch, transformers and every model module: seconds),
so it runs once in a subprocess and the map is cached on disk, keyed by the tree and its converter
registry's source.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from dflash_gguf import paths
from dflash_gguf.convert.errors import ConvertError

log = logging.getLogger("dflash_gguf.convert")

# run in the subprocess: the converter's text-model registry as {HF architecture: GGUF architecture}
_SCRIPT = r"""
import json, logging, sys
tree = sys.argv[1]
sys.path[:0] = [tree, tree + "/gguf-py"]
logging.disable(logging.WARNING)
import gguf
from conversion import ModelBase, ModelType, load_all_models
load_all_models()
out = {}
for name, cls in ModelBase._model_classes[ModelType.TEXT].items():
    arch = getattr(cls, "model_arch", None)
    if isinstance(arch, gguf.MODEL_ARCH):
        out[name] = gguf.MODEL_ARCH_NAMES[arch]
sys.stdout.write(json.dumps(out, sort_keys=True))
"""


def _tree() -> Path:
    try:
        return paths.upstream_tree()
    except FileNotFoundError as e:
        raise ConvertError(str(e)) from None


def _cache_file(tree: Path) -> Path:
    registry = tree / "conversion" / "__init__.py"
    if not registry.is_file():
        raise ConvertError(f"{registry} is missing from the upstream tree: run `python -m dflash_gguf.build` again")
    h = hashlib.sha256(str(tree).encode() + b"\0" + registry.read_bytes() + _SCRIPT.encode()).hexdigest()[:16]
    return paths.cache_dir() / "converter-archs" / f"{h}.json"


@functools.lru_cache(maxsize=4)
def _registry(tree: Path) -> dict[str, str]:
    cache = _cache_file(tree)
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    log.info("reading the converter's architecture registry from %s (once; cached in %s)", tree, cache)
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(tree)], capture_output=True, text=True, env=env,
                       stdin=subprocess.DEVNULL)
    try:
        found = json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        found = None
    if not isinstance(found, dict) or not found:
        raise ConvertError(f"reading the architecture registry of {tree / 'convert_hf_to_gguf.py'} failed "
                           f"(exit {r.returncode}); install the converter's dependencies with "
                           f"`pip install 'dflash-gguf[convert]'`.\n{r.stderr[-2000:]}")
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(found, sort_keys=True))
    tmp.replace(cache)
    return found


def converter_archs() -> dict[str, str]:
    """``{HF architecture: GGUF architecture}`` for every text model the pinned converter registers."""
    return dict(_registry(_tree()))


def tappable() -> tuple[str, ...]:
    """GGUF architectures whose layers a drafter can tap (the library's list)."""
    from dflash_gguf.native import _bindings

    return _bindings.tappable_archs()


def supported_targets() -> dict[str, str]:
    """``{HF architecture: GGUF architecture}`` of the targets a DFlash drafter can be converted for."""
    taps = set(tappable())
    return {hf: arch for hf, arch in converter_archs().items() if arch in taps}


def gguf_arch(hf_arch: str) -> str | None:
    """The GGUF architecture the pinned converter writes for ``hf_arch`` (None: it does not convert it)."""
    return converter_archs().get(hf_arch)


def describe_supported() -> str:
    """The supported targets for an error message: GGUF architectures with their HF names."""
    by_arch: dict[str, list[str]] = {}
    for hf, arch in sorted(supported_targets().items()):
        by_arch.setdefault(arch, []).append(hf)
    return "; ".join(f"{arch} ({', '.join(names)})" for arch, names in sorted(by_arch.items()))
