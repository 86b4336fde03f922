"""The build's guard rails: patches apply in order or the build stops naming the patch; the
sdist is verified; the cache key follows sdist, patch series and flags."""
from __future__ import annotations

import platform
import shutil
import tarfile
from pathlib import Path

import pytest

from dflash_gguf import paths
from dflash_gguf.build import native as build

SDIST = paths.cache_dir() / "sdist" / build.SDIST_FILE
pytestmark = pytest.mark.skipif(not SDIST.exists(), reason="the pinned sdist is not in the build cache "
                                "(python -m dflash_gguf.build fetches it; make test runs the build first)")

def _sdist_files_touched() -> list[str]:
    """Files of the sdist the series modifies (a file created by an earlier patch is not one)."""
    first: dict[str, bool] = {}
    for p in paths.patch_files():
        lines = p.read_text().splitlines()
        for old, new in zip(lines, lines[1:]):
            if old.startswith("--- ") and new.startswith("+++ b/"):
                first.setdefault(new[6:].strip(), old.startswith("--- a/"))
    return sorted(f for f, from_sdist in first.items() if from_sdist)


TOUCHED = _sdist_files_touched()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Only the files the patch series touches, from the pinned sdist (fast to copy per test)."""
    root = tmp_path_factory.mktemp("pristine")
    prefix = f"llama_cpp_python-{build.SDIST_VERSION}/"
    with tarfile.open(SDIST) as tf:
        members = [m for m in tf.getmembers() if m.name[len(prefix):] in TOUCHED]
        assert len(members) == len(TOUCHED)
        tf.extractall(root, members=members, filter="data")
    return root / prefix.rstrip("/")


def fresh(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "tree"
    shutil.copytree(pristine, dst)
    return dst


def test_series_applies_in_order(pristine, tmp_path):
    tree = fresh(pristine, tmp_path)
    build.apply_patches(tree, paths.patch_files())
    assert (tree / "vendor/llama.cpp/include/llama-dflash.h").exists()
    assert "llama_dflash_draft" in (tree / "vendor/llama.cpp/src/llama-dflash.cpp").read_text()
    assert "llama-dflash.cpp" in (tree / "vendor/llama.cpp/src/CMakeLists.txt").read_text()


def test_every_patch_has_a_header():
    for p in paths.patch_files():
        head = p.read_text().split("\n--- ", 1)[0]
        assert head.startswith(f"dflash-gguf patch {p.name[:4]}:"), p.name
        assert "What it changes" in head and "Why" in head, p.name


def test_tampered_patch_fails_naming_it(pristine, tmp_path):
    tree = fresh(pristine, tmp_path)
    patches = paths.patch_files()
    bad = tmp_path / patches[0].name
    text = patches[0].read_text()
    # corrupt a context line of the llama-context.cpp hunk
    bad.write_text(text.replace(" int llama_context::decode(const llama_batch_ext & batch_inp) {",
                                " int llama_context::decode(const llama_batch_ext & tampered) {", 1))
    with pytest.raises(build.BuildError, match=patches[0].name):
        build.apply_patches(tree, [bad, *patches[1:]])


def test_missing_patch_fails_naming_the_next(pristine, tmp_path):
    tree = fresh(pristine, tmp_path)
    patches = paths.patch_files()
    with pytest.raises(build.BuildError, match=patches[1].name):
        build.apply_patches(tree, patches[1:])


def test_corrupt_sdist_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_GGUF_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / build.SDIST_FILE
    fake.write_bytes(b"not the release")
    with pytest.raises(build.BuildError, match="sha256"):
        build.fetch_sdist(build.BuildOptions(sdist=str(fake)))
    assert not (tmp_path / "cache" / "sdist" / build.SDIST_FILE).exists()


def test_cache_key_follows_series_and_flags():
    cpu = build.BuildOptions()
    k = build.build_key("a" * 64, cpu)
    assert k == build.build_key("a" * 64, build.BuildOptions())
    assert k != build.build_key("b" * 64, cpu)
    assert k != build.build_key("a" * 64, build.BuildOptions(cmake_args=["-DGGML_AVX512=OFF"]))
    if platform.machine() not in ("aarch64", "arm64"):
        with pytest.raises(build.BuildError, match="--cross aarch64-linux-gnu"):
            build.BuildOptions(platform="kleidiai").all_cmake_args()


def test_gpu_platforms_and_variants(monkeypatch):
    """--platform vulkan|cuda: the wheel's flags add the backend (another cache key); the GPU build
    variants build libllama with it; a missing compiler stops the build before it starts, saying what to install."""
    cpu = build.BuildOptions().all_cmake_args()
    for name, flag in (("vulkan", "-DGGML_VULKAN=ON"), ("cuda", "-DGGML_CUDA=ON")):
        args = build.BuildOptions(platform=name).all_cmake_args()
        assert args == cpu[:len(build.DEFAULT_CMAKE_ARGS)] + [flag]
        assert build.build_key("a" * 64, build.BuildOptions(platform=name)) != build.build_key("a" * 64, build.BuildOptions())
        assert flag in build.GGML_VARIANTS[name] and "llama" in build.VARIANT_TARGETS[name]
    with pytest.raises(build.BuildError, match="choose cpu, metal, kleidiai, vulkan or cuda"):
        build.BuildOptions(platform="rocm").all_cmake_args()
    monkeypatch.setattr(build.shutil, "which", lambda _: None)
    monkeypatch.delenv("VULKAN_SDK", raising=False)
    monkeypatch.delenv("CUDACXX", raising=False)
    with pytest.raises(build.BuildError, match="glslc"):
        build.gpu_prerequisites("vulkan")
    with pytest.raises(build.BuildError, match="unknown --ggml-variant"):
        build.build_ggml_variant(Path("/nonexistent"), "k", "rocm", build.BuildOptions())


def test_gguf_marker_alone_does_not_count_as_installed(tmp_path, monkeypatch):
    """A fresh environment at the same path (a CI clone's new .venv) matches the cache's marker but has
    no gguf: the build must install it again, not trust the marker."""
    import importlib.util
    import sys

    marker = tmp_path / "gguf-installed"
    assert not build.gguf_installed(marker, "k")                      # no marker
    marker.write_text(f"k:{sys.prefix}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert not build.gguf_installed(marker, "k")                      # marker, but nothing importable
    monkeypatch.undo()
    marker.write_text(f"other:{sys.prefix}")
    assert not build.gguf_installed(marker, "k")                      # another build's marker
    marker.write_text(f"k:{sys.prefix}")
    assert build.gguf_installed(marker, "k")      # this environment: the build installed gguf into it
