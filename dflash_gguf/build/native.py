"""Build the patched llama.cpp: ``python -m dflash_gguf.build``.

Steps (each cached under ``$DFLASH_GGUF_CACHE``, default ``~/.cache/dflash-gguf``):

1. fetch the pinned llama-cpp-python sdist from PyPI and verify its sha256;
2. unpack it and apply ``patches/*.patch`` in order (a patch that does not apply stops the
   build and is named), then stamp the tree with the patch-series hash;
3. build a wheel of the patched llama-cpp-python (one libllama for the whole process) and
   install it; the wheel is cached by (sdist hash, patch-series hash, build flags);
4. install the sdist's vendored ``gguf-py`` (PyPI's ``gguf`` lacks DFlash) and keep the
   sdist's ``convert_hf_to_gguf.py`` + ``conversion/`` for :mod:`dflash_gguf.convert`;
5. optionally (``--with-tools``) build upstream's reference binaries from the same tree;
6. optionally (``--ggml-variant NAME``) build libraries from the same tree with other flags, for
   tests: ``avx2`` / ``avxvnni`` (ggml only, without AVX-512: the AVX2 and AVX-VNNI paths of
   patches/0014's kernels) and the GPU
   variants ``vulkan`` / ``cuda`` (libllama + ggml with that backend; the tests load it in child
   processes with ``LLAMA_CPP_LIB_PATH``; ``cuda`` also builds the reference tools for the benchmark).

``--platform vulkan`` / ``--platform cuda`` build the installed wheel itself with that backend.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import importlib
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf import paths
from dflash_gguf.build import cross as build_cross
from dflash_gguf.paths import sha256_file

log = logging.getLogger("dflash_gguf.build.native")

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
SDIST_FILE = f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TOOLS = ("llama-speculative-simple", "llama-completion", "llama-server", "ggml-rpc-server")
STAMP_HEADER = "vendor/llama.cpp/src/llama-dflash-stamp.h"
# llava/mtmd is not needed by DFlash and costs ~2 of the ~10 build minutes on 2 cores; RPC: a target's
# layers on other hosts' rpc-server processes (ggml-rpc, a few seconds of build time)
DEFAULT_CMAKE_ARGS = ("-DLLAVA_BUILD=OFF", "-DGGML_RPC=ON")
# ggml libraries built from the patched tree with fixed x86 flags instead of GGML_NATIVE, for
# testing code paths this CPU would not take: "avx2" has no AVX-512 and no AVX-VNNI, so the kernels
# of patches/0014 take their 256-bit VPMADDUBSW path (any AVX2 CPU runs it); "avxvnni" is the same with
# AVX-VNNI (the 256-bit VPDPBUSD path of Intel Alder Lake and later, AMD Zen 5; only a CPU with the
# instructions runs it)
_X86_AVX2 = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF")
GGML_VARIANTS = {
    "avx2": (*_X86_AVX2, "-DGGML_AVX_VNNI=OFF"),
    "avxvnni": (*_X86_AVX2, "-DGGML_AVX_VNNI=ON"),
    # GPU backends (the CPU backend stays native): libllama and its own ggml libraries, linked with the
    # build folder's RUNPATH, so LLAMA_CPP_LIB_PATH=<bin> loads them and not the wheel's
    "vulkan": ("-DGGML_VULKAN=ON",),
    "cuda": ("-DGGML_CUDA=ON",),
}
# what each variant builds (CMake targets) and the file that says it is complete
VARIANT_TARGETS = {"avx2": ("ggml", "ggml-cpu"), "avxvnni": ("ggml", "ggml-cpu"), "vulkan": ("llama",),
                   "cuda": ("llama", "llama-speculative-simple", "llama-completion")}
VARIANT_MINUTES = {"avx2": "about 2-3 minutes on 2 cores", "avxvnni": "about 2-3 minutes on 2 cores",
                   "vulkan": "about 11 CPU-minutes: 6 minutes on 2 idle cores",
                   "cuda": "minutes on a many-core machine, for the local GPU's architecture only"}
VARIANT_DONE = {"avx2": "libggml-cpu.so", "avxvnni": "libggml-cpu.so", "vulkan": "libllama.so", "cuda": "llama-completion"}
# wheels built with a GPU backend (--platform); Metal is macOS-only (see all_cmake_args)
GPU_PLATFORMS = {"vulkan": ("-DGGML_VULKAN=ON",), "cuda": ("-DGGML_CUDA=ON",)}
_PROGRESS = re.compile(r"^\[\s*(\d+)(?:/(\d+)|%)\]")  # ninja: [12/141], make: [ 45%]


class BuildError(RuntimeError):
    """A build step failed; the message says which and what to do."""


@dataclass
class BuildOptions:
    platform: str = "cpu"                 # cpu | metal | kleidiai | vulkan | cuda
    cmake_args: list[str] = field(default_factory=list)
    kleidiai_src: str | None = None
    cross: str | None = None              # e.g. aarch64-linux-gnu (configure + build only)
    with_tools: bool = False
    ggml_variants: list[str] = field(default_factory=list)
    force: bool = False
    sdist: str | None = None              # a local sdist instead of fetching it
    jobs: int = os.cpu_count() or 2

    @property
    def cross_variant(self) -> str | None:
        """Name of a cross build in the cache's pointers: the triple, plus ``-kleidiai`` for that platform."""
        if not self.cross:
            return None
        return self.cross + ("-kleidiai" if self.platform == "kleidiai" else "")

    def all_cmake_args(self) -> list[str]:
        args = list(DEFAULT_CMAKE_ARGS)
        if self.platform == "metal":
            args += ["-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"]
        elif self.platform == "kleidiai":
            target = (self.cross or platform.machine()).split("-")[0]
            if target not in ("aarch64", "arm64"):
                raise BuildError("--platform kleidiai builds Arm64 kernels: build on an arm64 machine or add "
                                 "--cross aarch64-linux-gnu")
            args += ["-DGGML_CPU_KLEIDIAI=ON"]
            if self.kleidiai_src:   # offline: a folder or the release archive; else upstream downloads it
                try:
                    src = build_cross.kleidiai_source(self.kleidiai_src)
                except build_cross.CrossError as e:
                    raise BuildError(str(e)) from None
                args.append(f"-DFETCHCONTENT_SOURCE_DIR_KLEIDIAI={src}")
        elif self.platform in GPU_PLATFORMS:
            args += list(GPU_PLATFORMS[self.platform])
        elif self.platform != "cpu":
            raise BuildError(f"unknown --platform {self.platform!r}: choose cpu, metal, kleidiai, vulkan or cuda")
        if self.cross:
            args += cross_cmake_args(self.cross, self.platform)
        return args + list(self.cmake_args)


def gpu_prerequisites(backend: str) -> None:
    """Stop before a long build when a GPU backend's compiler or headers are missing, saying what to install."""
    if backend == "vulkan":
        missing = [what for what, ok in (
            ("glslc (Debian/Ubuntu: glslc)", shutil.which("glslc") or os.environ.get("VULKAN_SDK")),
            ("the Vulkan headers and loader (libvulkan-dev)", os.environ.get("VULKAN_SDK") or any(
                Path(d, "vulkan", "vulkan.h").exists() for d in ("/usr/include", "/usr/local/include"))),
            ("SPIRV-Headers (spirv-headers)", os.environ.get("VULKAN_SDK") or any(
                Path(d, "spirv", "unified1", "spirv.hpp").exists() for d in ("/usr/include", "/usr/local/include"))),
        ) if not ok]
        if missing:
            raise BuildError("the Vulkan backend needs " + ", ".join(missing) + " (or the LunarG Vulkan SDK with "
                             "VULKAN_SDK set); Debian/Ubuntu: apt-get install libvulkan-dev glslc spirv-headers")
    elif backend == "cuda":
        nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc") or (
            "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
        if not nvcc:
            raise BuildError("the CUDA backend needs the CUDA toolkit's nvcc (on PATH, or CUDACXX=/path/to/nvcc)")


def cross_cmake_args(triple: str, platform_: str = "cpu") -> list[str]:
    try:
        return build_cross.cross_cmake_args(triple, platform_)
    except build_cross.CrossError as e:
        raise BuildError(str(e)) from None


# --------------------------------------------------------------------------- hashing

def build_key(series: str, opts: BuildOptions) -> str:
    flags = {"cmake": opts.all_cmake_args(), "machine": platform.machine(),
             "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    if opts.cross:
        flags["toolchain"] = build_cross.toolchain_id(opts.cross)
    flags = json.dumps(flags, sort_keys=True)
    return hashlib.sha256(f"{SDIST_SHA256}\n{series}\n{flags}".encode()).hexdigest()[:20]


# --------------------------------------------------------------------------- steps

def fetch_sdist(opts: BuildOptions) -> Path:
    """Return a verified copy of the pinned sdist in the cache."""
    dest_dir = paths.cache_dir() / "sdist"
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / SDIST_FILE
    if opts.sdist:
        src = Path(opts.sdist)
        if not src.is_file():
            raise BuildError(f"--sdist {src} does not exist")
        shutil.copyfile(src, dest)
    if not dest.exists():
        log.info("fetching %s==%s sdist from PyPI", SDIST_NAME, SDIST_VERSION)
        with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                   "--disable-pip-version-check", f"{SDIST_NAME}=={SDIST_VERSION}", "-d", tmp]
            r = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / SDIST_FILE
            if r.returncode != 0 or not got.exists():
                raise BuildError(
                    f"could not download {SDIST_NAME}=={SDIST_VERSION} from PyPI (no network?).\n"
                    f"Fetch {SDIST_FILE} on a connected machine and pass it with --sdist PATH.\n"
                    f"pip said: {r.stderr.strip()[-800:]}")
            os.replace(got, dest)
    digest = sha256_file(dest)
    if digest != SDIST_SHA256:
        dest.unlink()
        raise BuildError(f"{SDIST_FILE} has sha256 {digest}, expected {SDIST_SHA256}: the download is "
                         "corrupt or not the pinned release; it was removed, run the build again")
    return dest


def apply_patches(tree: Path, patches: list[Path]) -> None:
    """Apply each patch in order; stop at the first that does not apply, naming it."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    for p in patches:
        check = subprocess.run(["git", "apply", "--check", "-p1", str(p)], cwd=tree, env=env,
                               capture_output=True, text=True)
        if check.returncode != 0:
            raise BuildError(f"patch {p.name} does not apply to {SDIST_NAME} {SDIST_VERSION}:\n"
                             f"{check.stderr.strip()}\nFix or regenerate {p} against the pinned sdist.")
        subprocess.run(["git", "apply", "-p1", str(p)], cwd=tree, env=env, check=True)
        log.info("applied %s", p.name)


def prepare_tree(sdist: Path, key: str, series: str, force: bool) -> Path:
    """Unpack the sdist, apply the patch series and stamp it. Returns the patched sdist root."""
    root = paths.cache_dir() / "src" / key

    def fill(tmp: Path) -> None:
        log.info("unpacking %s", sdist.name)
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        tree = tmp / f"llama_cpp_python-{SDIST_VERSION}"
        for git_marker in (tree / ".git", tree / "vendor" / "llama.cpp" / ".git"):
            if git_marker.is_file():
                git_marker.unlink()          # submodule pointers: would confuse git apply
        apply_patches(tree, paths.patch_files())
        (tree / STAMP_HEADER).write_text(
            "// written by dflash_gguf.build.native after the patch series applied\n"
            f'#define LLAMA_DFLASH_SERIES "{series}"\n')
    paths.make_once(root, ".dflash-prepared", series, fill, force)
    return root / f"llama_cpp_python-{SDIST_VERSION}"


def _run_logged(cmd: list[str], cwd: Path | None, env: dict, logfile: Path, what: str) -> None:
    """Run a long command, writing its output to logfile and progress lines to the log."""
    log.info("%s (log: %s)", what, logfile)
    t0 = time.time()
    last = 0.0
    with open(logfile, "w") as lf:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            m = _PROGRESS.match(line.strip())
            if m and time.time() - last > 15:
                last = time.time()
                done = f"{m.group(1)}/{m.group(2)}" if m.group(2) else f"{m.group(1)}%"
                log.info("  %s  (%.0f s)", done, last - t0)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(open(logfile).readlines()[-30:])
        raise BuildError(f"{what} failed (exit {rc}); last lines of {logfile}:\n{tail}")
    log.info("%s done in %.0f s", what, time.time() - t0)


def build_wheel(tree: Path, key: str, opts: BuildOptions) -> Path:
    wheel_dir = paths.cache_dir() / "wheels" / key
    wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl")) if wheel_dir.exists() else []
    if wheels and not opts.force:
        log.info("using cached wheel %s", wheels[-1].name)
        return wheels[-1]
    if opts.cross:
        raise BuildError("a --cross wheel is packed from the cross-built libraries (build_cross.make_wheel)")
    shutil.rmtree(wheel_dir, ignore_errors=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix="wheel-", dir=paths.cache_dir()))
    env = dict(os.environ, CMAKE_ARGS=" ".join(opts.all_cmake_args()),
               CMAKE_BUILD_PARALLEL_LEVEL=str(opts.jobs))
    logfile = paths.cache_dir() / "logs" / f"wheel-{key}.log"
    logfile.parent.mkdir(parents=True, exist_ok=True)
    try:
        _run_logged([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
                     "-v", "-w", str(tmp_dir), str(tree)], None, env, logfile,
                    "building the patched llama-cpp-python wheel (about 3 minutes on 2 cores)")
        built = sorted(tmp_dir.glob("llama_cpp_python-*.whl"))
        if not built:
            raise BuildError(f"pip wheel produced no wheel; see {logfile}")
        wheel_dir.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp_dir, wheel_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return sorted(wheel_dir.glob("llama_cpp_python-*.whl"))[-1]


def _pip_install(args: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", *args],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise BuildError(f"pip install {' '.join(args)} failed:\n{r.stderr.strip()[-1500:]}")


def gguf_installed(marker: Path, key: str) -> bool:
    """The vendored gguf-py of build ``key`` is installed in this environment.

    The marker (in the shared cache) names the build and the environment's prefix; a fresh
    environment made at the same path (a CI clone) has the same prefix and no gguf, so the
    package itself must also be importable from inside this environment.
    """
    if not (marker.exists() and marker.read_text() == f"{key}:{sys.prefix}"):
        return False
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("gguf")
    if spec is None or spec.origin is None:
        return False
    return Path(spec.origin).resolve().is_relative_to(Path(sys.prefix).resolve())


def install(wheel: Path, tree: Path, key: str) -> None:
    marker = paths.install_marker()
    if marker is not None and marker.exists() and marker.read_text().strip() == key:
        log.info("patched llama-cpp-python %s already installed", key)
    else:
        log.info("installing %s", wheel.name)
        _pip_install(["--force-reinstall", "--no-deps", str(wheel)])
        _pip_install([str(wheel)])  # its dependencies (diskcache, jinja2, ...), already-present ones kept
        marker = paths.install_marker()
        if marker is None:
            raise BuildError("llama_cpp is not importable after installing the wheel")
        marker.write_text(key)
    gguf_py = tree / "vendor" / "llama.cpp" / "gguf-py"
    gguf_marker = paths.cache_dir() / "gguf-installed"
    if not gguf_installed(gguf_marker, key):
        log.info("installing the vendored gguf-py (DFlash-aware) as 'gguf'")
        _pip_install(["--force-reinstall", "--no-deps", str(gguf_py)])
        _pip_install([str(gguf_py)])
        gguf_marker.write_text(f"{key}:{sys.prefix}")
    remember_tree(tree)


def remember_tree(tree: Path) -> None:
    """Record ``tree`` as the patched llama.cpp the converter runs (its scripts and gguf-py:
    :func:`dflash_gguf.paths.upstream_tree`)."""
    paths.upstream_pointer().parent.mkdir(parents=True, exist_ok=True)
    paths.upstream_pointer().write_text(str(tree / "vendor" / "llama.cpp"))


def build_tools(tree: Path, key: str, opts: BuildOptions) -> Path:
    """Build upstream's reference binaries from the same patched tree."""
    out = paths.cache_dir() / "tools" / key
    bindir = out / "build" / "bin"   # llama.cpp's CMake puts every executable there
    # cross builds: the library plus the reference loop, which runs under qemu-user for a check
    targets = list(TOOLS) if not opts.cross else ["llama", "llama-speculative-simple"]
    if all((bindir / t).exists() for t in targets if t != "llama") and not opts.force:
        log.info("reference tools cached in %s", bindir)
        return bindir
    build = out / "build"
    src = tree / "vendor" / "llama.cpp"
    logfile = paths.cache_dir() / "logs" / f"tools-{key}.log"
    env = dict(os.environ)
    # an interrupted build of this key (same tree, same flags) resumes where it stopped; --force starts over
    if opts.force or not (build / "CMakeCache.txt").is_file():
        shutil.rmtree(out, ignore_errors=True)
        build.mkdir(parents=True)
        cfg = ["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
               "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_CURL=OFF",
               *opts.all_cmake_args()]
        _run_logged(cfg, None, env, logfile.with_suffix(".configure.log"), "configuring reference tools")
    else:
        log.info("resuming the reference tools' build in %s", build)
    _run_logged(["cmake", "--build", str(build), "--config", "Release", "-j", str(opts.jobs),
                 "--target", *targets], None, env, logfile,
                f"building {', '.join(targets)} (about 3-6 minutes on 2 cores)")
    return bindir


def build_ggml_variant(tree: Path, key: str, name: str, opts: BuildOptions) -> Path:
    """Build a variant's libraries (not the wheel) from the patched tree with GGML_VARIANTS[name]."""
    if name not in GGML_VARIANTS:
        raise BuildError(f"unknown --ggml-variant {name!r}: choose one of {', '.join(GGML_VARIANTS)}")
    out = paths.cache_dir() / "ggml-variants" / f"{key}-{name}"
    bindir = out / "build" / "bin"
    if (bindir / VARIANT_DONE[name]).exists() and not opts.force:
        log.info("ggml variant %s cached in %s", name, bindir)
        return bindir
    gpu_prerequisites(name)
    targets = VARIANT_TARGETS[name]
    tools = "ON" if any(t.startswith("llama-") for t in targets) else "OFF"
    build = out / "build"
    shutil.rmtree(out, ignore_errors=True)
    build.mkdir(parents=True)
    logfile = paths.cache_dir() / "logs" / f"ggml-{name}-{key}.log"
    cfg = ["cmake", "-S", str(tree / "vendor" / "llama.cpp"), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
           "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
           f"-DLLAMA_BUILD_TOOLS={tools}", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
           "-DLLAMA_USE_PREBUILT_UI=OFF", *GGML_VARIANTS[name]]
    cfg[cfg.index("-DLLAMA_BUILD_EXAMPLES=OFF")] = f"-DLLAMA_BUILD_EXAMPLES={tools}"
    env = dict(os.environ)
    _run_logged(cfg, None, env, logfile.with_suffix(".configure.log"), f"configuring the ggml {name} variant")
    _run_logged(["cmake", "--build", str(build), "--config", "Release", "-j", str(opts.jobs),
                 "--target", *targets], None, env, logfile,
                f"building the ggml {name} variant ({', '.join(targets)}; {VARIANT_MINUTES[name]})")
    return bindir


def patched_tree(opts: BuildOptions) -> tuple[str, str, Path]:
    """This package's patch series applied to the pinned sdist (cached): its series hash, the build key for
    ``opts`` and the patched tree; a GPU platform's prerequisites are checked before any long build."""
    series = paths.patch_series_hash()
    key = build_key(series, opts)
    log.info("build key %s (patch series %s…, flags %s)", key, series[:12], " ".join(opts.all_cmake_args()))
    tree = prepare_tree(fetch_sdist(opts), key, series, opts.force)
    if opts.platform in GPU_PLATFORMS:
        gpu_prerequisites(opts.platform)
    return series, key, tree


def build(opts: BuildOptions) -> dict:
    """Run the whole build; returns a summary dict."""
    t0 = time.time()
    series, key, tree = patched_tree(opts)
    summary: dict = {"key": key, "series": series, "tree": str(tree)}
    if not opts.cross:
        wheel = build_wheel(tree, key, opts)
        install(wheel, tree, key)
        summary["wheel"] = str(wheel)
    if opts.with_tools or opts.cross:
        summary["tools"] = str(build_tools(tree, key, opts))
        paths.tools_pointer(opts.cross_variant).write_text(summary["tools"])
    for name in opts.ggml_variants:
        summary[f"ggml-{name}"] = str(build_ggml_variant(tree, key, name, opts))
        paths.ggml_variant_pointer(name).write_text(summary[f"ggml-{name}"])
    if opts.cross:   # an installable wheel of the cross-built library (see build_cross)
        wheel_dir = paths.cache_dir() / "wheels" / key
        wheels = sorted(wheel_dir.glob("llama_cpp_python-*.whl")) if wheel_dir.exists() else []
        wheel = wheels[-1] if wheels and not opts.force else build_cross.make_wheel(
            tree, Path(summary["tools"]), wheel_dir, SDIST_VERSION)
        build_cross.wheel_pointer(opts.cross_variant).write_text(str(wheel))
        summary["wheel"] = str(wheel)
    summary["seconds"] = round(time.time() - t0, 1)
    log.info("build ready in %.1f s", summary["seconds"])
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.build", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--platform", default="cpu", choices=["cpu", "metal", "kleidiai", "vulkan", "cuda"],
                    help="cpu (default, GGML_NATIVE), metal (macOS), kleidiai (Arm64 SME/SME2 kernels), vulkan "
                    "(needs the Vulkan headers, glslc and SPIRV-Headers), cuda (needs the CUDA toolkit)")
    ap.add_argument("--kleidiai-src", help="KleidiAI v1.24.0 source: its folder or kleidiai-v1.24.0-src.tar.gz "
                    "(offline; without it upstream downloads the archive at configure time)")
    ap.add_argument("--cross", help="cross-compile the library for a GNU triple, e.g. aarch64-linux-gnu")
    ap.add_argument("--cmake-arg", action="append", default=[], dest="cmake_args", help="extra CMake -D flag")
    ap.add_argument("--with-tools", action="store_true",
                    help="also build llama-speculative-simple, llama-completion and llama-server")
    ap.add_argument("--ggml-variant", action="append", default=[], dest="ggml_variants",
                    choices=sorted(GGML_VARIANTS), help="also build libraries for tests: avx2 / avxvnni (ggml "
                    "without AVX-512: the kernels' 256-bit paths), vulkan / cuda (libllama + ggml with that GPU backend)")
    ap.add_argument("--sdist", help="use this local llama-cpp-python 0.3.36 sdist instead of PyPI")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    opts = BuildOptions(platform=args.platform, cmake_args=args.cmake_args, kleidiai_src=args.kleidiai_src,
                        cross=args.cross, with_tools=args.with_tools, ggml_variants=args.ggml_variants,
                        force=args.force, sdist=args.sdist,
                        jobs=args.jobs)
    try:
        summary = build(opts)
    except (BuildError, build_cross.CrossError) as e:
        log.error("%s", e)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
