"""cffi bindings to the patched libllama: the library ``llama_cpp`` already loaded.

Declared once in ``_cffi/dflash.cdef``. At import the library's build stamp is checked against
this package's patch series; a mismatch raises :class:`BuildMismatchError` naming the fix.
"""
from __future__ import annotations

import ctypes
from importlib import resources

import cffi

from dflash_gguf import paths
from dflash_gguf.errors import BuildMismatchError, raise_for_status

API_VERSION = 4
_FIX = ("reinstall dflash-gguf (`pip install --force-reinstall dflash-gguf`, or `pip install .` in its checkout: the "
        "wheel builds its own patched llama.cpp); in a development checkout run `python -m dflash_gguf.build` "
        "(`make build`), which installs the patched llama-cpp-python into the environment")

ffi = cffi.FFI()
ffi.cdef(resources.files("dflash_gguf").joinpath("native/_cffi/dflash.cdef").read_text())


def _library_path() -> str:
    try:
        from dflash_gguf.native.llama import llama_low
    except ImportError as e:  # not installed at all
        raise BuildMismatchError(f"llama_cpp is not importable ({e}); {_FIX}") from e
    return llama_low._lib._name


def _open():
    path = _library_path()
    lib = ffi.dlopen(path)  # same path => the same loaded library instance as llama_cpp's
    try:
        stamp_fn = lib.llama_dflash_build_stamp
    except AttributeError:
        raise BuildMismatchError(f"{path} is an unpatched libllama (no llama_dflash_* API); {_FIX}") from None
    stamp = ffi.string(stamp_fn()).decode()
    expected = f"dflash-gguf;api={API_VERSION};series={paths.patch_series_hash()}"
    if stamp != expected:
        raise BuildMismatchError(
            f"{path} was built from another patch series (library stamp {stamp!r}, this package needs "
            f"{expected!r}); {_FIX}")
    return lib, path, stamp


lib, LIBRARY_PATH, BUILD_STAMP = _open()


def tappable_archs() -> tuple[str, ...]:
    """The target architectures (GGUF names) whose layers a drafter can tap: the library's one list."""
    names, i = [], 0
    while (p := lib.llama_dflash_tappable_arch(i)) != ffi.NULL:
        names.append(ffi.string(p).decode())
        i += 1
    return tuple(names)


def status_str(code: int) -> str:
    return ffi.string(lib.llama_dflash_status_str(code)).decode()


def check(code: int, what: str) -> int:
    """Turn a negative status into its typed exception; pass other values through."""
    if code < 0:
        raise_for_status(code, what, status_str)
    return code


def as_ctx(ptr) -> "ffi.CData":
    """A cffi ``llama_context *`` from a ctypes pointer (llama_cpp) or an int address."""
    return ffi.cast("struct llama_context *", _address(ptr))


def as_model(ptr) -> "ffi.CData":
    return ffi.cast("struct llama_model *", _address(ptr))


def _address(ptr) -> int:
    if isinstance(ptr, int):
        return ptr
    if isinstance(ptr, ctypes.c_void_p):
        return ptr.value or 0
    return ctypes.cast(ptr, ctypes.c_void_p).value or 0
