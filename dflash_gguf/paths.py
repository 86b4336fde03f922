"""Where things live: the patch series, the build cache and what the build left there."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

_PKG = Path(__file__).resolve().parent


def file_identity(path: str | os.PathLike) -> list:
    """What a cache keyed by a model file keys it by: its resolved path, size and modification time."""
    st = Path(path).stat()
    return [str(Path(path).resolve()), st.st_size, st.st_mtime_ns]


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The sha256 of a file's bytes, read in chunks (a pair's GGUFs, a downloaded sdist)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON to ``path`` whole or not at all: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def patches_dir() -> Path:
    """The patch series: ``patches/`` of a source checkout, or the copy inside an installed wheel."""
    for cand in (_PKG.parent / "patches", _PKG / "_patches"):
        if cand.is_dir() and any(cand.glob("*.patch")):
            return cand
    raise FileNotFoundError("dflash_gguf's patch series (patches/*.patch) is missing from this installation")


def patch_files() -> list[Path]:
    return sorted(patches_dir().glob("*.patch"))


def patch_series_hash() -> str:
    """sha256 over the patch files in order (name and bytes): the build stamp's series id."""
    h = hashlib.sha256()
    for p in patch_files():
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


# the shipped demo pair (target.gguf, drafter.gguf, MODEL_CARD.md)
DEMO_DIR = Path(__file__).resolve().parent / "data" / "demo"


def cache_dir() -> Path:
    d = Path(os.environ.get("DFLASH_GGUF_CACHE") or Path.home() / ".cache" / "dflash-gguf")
    d.mkdir(parents=True, exist_ok=True)
    return d


def make_once(dest: Path, marker: str, stamp: str, fill: Callable[[Path], None], force: bool = False) -> bool:
    """Make the folder ``dest`` in the cache unless ``dest/marker`` says it was made (``force``: anew).
    ``fill`` writes it into a temporary folder that then takes its place whole, so an interrupted fill
    leaves no half-made ``dest``; ``marker`` then records ``stamp``. Returns whether it was made now."""
    done = dest / marker
    if done.exists() and not force:
        return False
    shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{dest.name}-", dir=cache_dir()))
    try:
        fill(tmp)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    done.write_text(stamp)
    return True


def install_marker() -> Path | None:
    """A file inside the installed llama_cpp package recording which build installed it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / ".dflash-gguf-build"


def upstream_pointer() -> Path:
    return cache_dir() / "upstream-tree"


def tools_pointer(cross: str | None = None) -> Path:
    return cache_dir() / ("tools-dir" if not cross else f"tools-dir-{cross}")


def ggml_variant_pointer(name: str) -> Path:
    return cache_dir() / f"ggml-variant-{name}"


def ggml_variant_dir(name: str) -> Path | None:
    """Folder of a ggml build variant's libraries (``python -m dflash_gguf.build --ggml-variant NAME``)."""
    p = ggml_variant_pointer(name)
    if p.exists() and Path(p.read_text().strip()).is_dir():
        return Path(p.read_text().strip())
    return None


def upstream_tree() -> Path:
    """The patched llama.cpp source tree kept by the build (converter scripts, gguf-py)."""
    p = upstream_pointer()
    if not p.exists() or not Path(p.read_text().strip()).is_dir():
        raise FileNotFoundError("the upstream llama.cpp tree is not in the build cache: run `python -m dflash_gguf.build`")
    return Path(p.read_text().strip())


def import_gguf():
    """gguf-py as this package needs it (DFlash-aware; PyPI's ``gguf`` is not): the environment's when it is
    that one (a development environment: ``make build`` installs the vendored copy), else the copy in the
    patched tree the build keeps (a wheel install: its build left the tree in the cache)."""
    import sys

    try:
        import gguf
        if hasattr(gguf.MODEL_ARCH, "DFLASH"):
            return gguf
    except ImportError:
        pass
    try:
        tree = upstream_tree()
    except FileNotFoundError:
        raise ImportError("gguf-py with DFlash support is missing: run `python -m dflash_gguf.build` "
                          "(it keeps llama.cpp's vendored gguf-py; PyPI's gguf lacks DFlash)") from None
    for name in [m for m in sys.modules if m == "gguf" or m.startswith("gguf.")]:
        del sys.modules[name]     # PyPI's gguf, imported above: the tree's copy replaces it
    sys.path.insert(0, str(tree / "gguf-py"))
    import gguf
    return gguf


def tools_dir(cross: str | None = None) -> Path | None:
    """Folder of upstream's reference binaries, if the build made them (``--with-tools``, ``--cross``)."""
    env = os.environ.get("DFLASH_GGUF_TOOLS")
    if env and not cross:
        return Path(env)
    p = tools_pointer(cross)
    if p.exists() and Path(p.read_text().strip()).is_dir():
        return Path(p.read_text().strip())
    return None
