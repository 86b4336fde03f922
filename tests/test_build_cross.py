"""The arm64 build options: KleidiAI offline from a folder or an archive, checked before any build."""
from __future__ import annotations

import io
import shutil
import tarfile
from pathlib import Path

import pytest

from dflash_gguf.build import native as build
from dflash_gguf.build import cross as build_cross

pytestmark = pytest.mark.pure

CMAKELISTS = "cmake_minimum_required(VERSION 3.16)\nproject(\n    KleidiAI\n    VERSION {v}\n    LANGUAGES C CXX ASM\n)\n"


def _archive(path: Path, version: str) -> Path:
    data = CMAKELISTS.format(v=version).encode()
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo(f"kleidiai-v{version}/CMakeLists.txt")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_GGUF_CACHE", str(tmp_path / "cache"))
    build_cross.kleidiai_source.cache_clear()
    yield
    build_cross.kleidiai_source.cache_clear()


def test_archive_is_unpacked_once_into_the_cache(tmp_path):
    arc = _archive(tmp_path / "kai.tar.gz", build_cross.KLEIDIAI_VERSION)
    src = build_cross.kleidiai_source(str(arc))
    assert (src / "CMakeLists.txt").exists() and str(src).startswith(str(tmp_path / "cache" / "kleidiai"))
    build_cross.kleidiai_source.cache_clear()
    (src / "marker").write_text("kept")
    assert build_cross.kleidiai_source(str(arc)) == src and (src / "marker").exists()


def test_a_cache_folder_is_made_whole_or_not_at_all(tmp_path):
    """``paths.make_once`` (the unpacked KleidiAI and the patched llama.cpp tree): made once, marked; a fill
    that fails leaves neither the folder nor its temporary copy behind."""
    from dflash_gguf import paths

    dest = paths.cache_dir() / "made" / "here"
    calls = []

    def fill(tmp: Path) -> None:
        calls.append(tmp)
        (tmp / "file").write_text("x")
    assert paths.make_once(dest, ".done", "stamp", fill) and (dest / ".done").read_text() == "stamp"
    assert not paths.make_once(dest, ".done", "stamp", fill) and len(calls) == 1 and (dest / "file").exists()

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise OSError("disk full")
    with pytest.raises(OSError):
        paths.make_once(dest, ".done", "stamp", broken, force=True)
    assert not dest.exists() and sorted(p.name for p in paths.cache_dir().iterdir()) == ["made"]


def test_folder_is_used_in_place(tmp_path):
    d = tmp_path / "kleidiai"
    d.mkdir()
    (d / "CMakeLists.txt").write_text(CMAKELISTS.format(v=build_cross.KLEIDIAI_VERSION))
    assert build_cross.kleidiai_source(str(d)) == d.resolve()


@pytest.mark.parametrize("what", ["version", "not-kleidiai", "not-an-archive", "missing"])
def test_wrong_sources_are_refused_with_the_reason(tmp_path, what):
    if what == "version":
        arg, match = _archive(tmp_path / "kai.tar.gz", "1.9.0"), "version 1.9.0"
    elif what == "not-kleidiai":
        d = tmp_path / "other"
        d.mkdir()
        (d / "CMakeLists.txt").write_text("project(Other VERSION 1.24.0)\n")
        arg, match = d, "not a KleidiAI source"
    elif what == "not-an-archive":
        arg, match = tmp_path / "x.tar.gz", "neither a folder nor a tar"
        arg.write_bytes(b"no")
    else:
        arg, match = tmp_path / "absent.tar.gz", "does not exist"
    with pytest.raises(build_cross.CrossError, match=match) as e:
        build_cross.kleidiai_source(str(arg))
    assert not isinstance(e.value, build_cross.ToolMissing)   # the caller's fault: a test must not skip on it


def test_only_an_absent_tool_is_tool_missing(monkeypatch):
    """tests/test_arm64.py skips on ToolMissing and fails on any other CrossError."""
    with pytest.raises(build_cross.ToolMissing, match="apt-get install g[+][+]-no-such-triple"):
        build_cross.compilers("no-such-triple")
    monkeypatch.setattr(build_cross, "find_qemu", lambda: None)
    with pytest.raises(build_cross.ToolMissing, match="qemu-user-static"):
        build_cross.guest_python(Path("unused.whl"))


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 cross compiler "
                    "(apt-get install g++-aarch64-linux-gnu)")
def test_kleidiai_cross_flags(tmp_path, monkeypatch):
    arc = _archive(tmp_path / "kai.tar.gz", build_cross.KLEIDIAI_VERSION)
    opts = build.BuildOptions(platform="kleidiai", cross="aarch64-linux-gnu", kleidiai_src=str(arc))
    args = opts.all_cmake_args()
    src = build_cross.kleidiai_source(str(arc))
    assert "-DGGML_CPU_KLEIDIAI=ON" in args and f"-DFETCHCONTENT_SOURCE_DIR_KLEIDIAI={src}" in args
    assert f"-DCMAKE_C_FLAGS={build_cross.GCC_KLEIDIAI_CFLAGS}" in args      # gcc 12's ICE in KleidiAI
    assert "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON" in args                      # the wheel's libraries find each other
    assert opts.cross_variant == "aarch64-linux-gnu-kleidiai"
    # without a source, upstream's configure-time download is kept
    online = build.BuildOptions(platform="kleidiai", cross="aarch64-linux-gnu").all_cmake_args()
    assert "-DGGML_CPU_KLEIDIAI=ON" in online and not any("FETCHCONTENT" in a for a in online)
    # the cross toolchain is part of the cache key
    key = build.build_key("a" * 64, opts)
    monkeypatch.setattr(build_cross, "toolchain_id", lambda triple: "aarch64-linux-gnu-gcc 99.1")
    assert build.build_key("a" * 64, opts) != key
    plain = build.BuildOptions(cross="aarch64-linux-gnu").all_cmake_args()
    assert not any(a.startswith("-DCMAKE_C_FLAGS") for a in plain)
