"""Arm64 side of the build: KleidiAI offline, the aarch64 wheel, and an emulated aarch64 Python.

Used by :mod:`dflash_gguf.build.native` (``--cross aarch64-linux-gnu``, ``--platform kleidiai``) and by
the arm64 tests. Three parts:

* **KleidiAI offline**: ``--kleidiai-src`` takes the unpacked source *or* its release archive
  (``kleidiai-v1.24.0-src.tar.gz``); an archive is unpacked once into the build cache. Without
  ``--kleidiai-src`` upstream's configure-time download is kept. gcc 12 (Debian bookworm's cross
  compiler) stops with an internal compiler error in KleidiAI's
  ``kai_lhs_quant_pack_qai8dxp_bf16_neon.c``; C code is then compiled with ``-fno-tree-vectorize``
  (ggml's and KleidiAI's hot loops are hand-written intrinsics; the auto-vectorizer adds little).
* **The aarch64 wheel**: the cross-built shared libraries (RPATH ``$ORIGIN``) plus the pinned
  sdist's ``llama_cpp`` Python package, packed as ``llama_cpp_python-0.3.36-py3-none-linux_aarch64.whl``
  with the sdist's metadata (the same dependencies). ``pip install --platform ... --target`` installs it.
* **An aarch64 CPython to run it under qemu-user**: Debian's arm64 ``python3.X-minimal`` and
  ``libpython3.X-stdlib`` with their arm64 library dependencies (``apt-get download`` +
  ``dpkg -x`` into a sysroot in the cache), and a site folder with the aarch64 wheel, numpy and
  cffi from PyPI for that Python version. :func:`guest_python` returns the command that runs it:
  ``qemu-aarch64-static -cpu max -L SYSROOT SYSROOT/usr/bin/python3.X``; KleidiAI's SME2 kernels
  run under a newer qemu-user fetched into the cache (:func:`fetch_qemu_sme2`).

Needs on the build machine: ``g++-aarch64-linux-gnu`` (cross build), ``qemu-user-static`` (to run),
and for the emulated Python ``dpkg --add-architecture arm64`` + ``apt-get update`` (done by
``.ci/run``) and PyPI access for the aarch64 wheels of numpy and cffi.
"""
from __future__ import annotations

import argparse
import base64
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from dflash_gguf import paths

log = logging.getLogger("dflash_gguf.build.cross")

KLEIDIAI_VERSION = "1.24.0"
KLEIDIAI_COMMIT = "0b2ee513397578a272a4e8a6c12589ef6534371c"
# upstream's release archive (the URL ggml's CMake fetches) and the source archive of the same tag
# kept for offline builds; another archive of the right version is accepted with a warning
KLEIDIAI_KNOWN_ARCHIVES = {
    "35b4b116cfce3ae90aefbbf1451c2dee4e88bec0068e1201ac2ff57805fcea97": "v1.24.0 source (tag archive, commit 0b2ee51)",
}
KLEIDIAI_RELEASE_MD5 = "2f02ebe29573d45813e671eb304f2a00"   # ggml-cpu/CMakeLists.txt pins this

# the C flag that gets gcc 12 past its internal compiler error in KleidiAI (see the module doc)
GCC_KLEIDIAI_CFLAGS = "-fno-tree-vectorize"

QEMU_NAMES = ("qemu-aarch64-static", "qemu-aarch64")
# wheels of the guest Python: manylinux tags a Debian bookworm (glibc 2.36) arm64 system accepts
GUEST_PLATFORMS = ["linux_aarch64", "manylinux2014_aarch64"] + [f"manylinux_2_{v}_aarch64" for v in range(17, 37)]
# cffi for the engine's bindings; gguf for the DSpark drafter's sampled proposals (it reads the drafter's
# Markov weights from its GGUF)
GUEST_EXTRA = ("cffi>=1.16", "gguf>=0.10")
# arm64 packages the emulated Python never needs (host tools, perl, data)
_SKIP_PKGS = re.compile(r"^(dpkg|tar|install-info|perl.*|libperl.*|debconf.*|tzdata|media-types|mime-support|"
                        r"mailcap|readline-common|libtirpc-common|libgdbm-compat4)$")


class CrossError(RuntimeError):
    """A cross-build or emulation step failed; the message says which and what to do."""


class ToolMissing(CrossError):
    """This machine lacks a tool or package the step needs (a cross compiler, qemu-user, binutils,
    Debian's arm64 package lists): not a fault of the project's code, so tests skip on it, and only
    on it."""


# --------------------------------------------------------------------------- toolchain

def compilers(triple: str) -> tuple[str, str]:
    cc, cxx = f"{triple}-gcc", f"{triple}-g++"
    if not shutil.which(cc) or not shutil.which(cxx):
        pkg = triple.replace("_", "-")
        raise ToolMissing(f"cross compiler {cc}/{cxx} not found: install gcc-{pkg} and g++-{pkg} "
                         f"(Debian: apt-get install g++-{pkg})")
    return cc, cxx


def toolchain_id(triple: str) -> str:
    """The cross compiler's version line (part of the build cache key)."""
    cc, _ = compilers(triple)
    out = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else cc


def cross_cmake_args(triple: str, platform: str = "cpu") -> list[str]:
    cc, cxx = compilers(triple)
    proc = triple.split("-")[0]
    args = ["-DCMAKE_SYSTEM_NAME=Linux", f"-DCMAKE_SYSTEM_PROCESSOR={proc}",
            f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}", "-DGGML_NATIVE=OFF",
            "-DGGML_OPENMP=OFF", "-DLLAMA_OPENSSL=OFF",
            # libraries find each other next to themselves: the wheel ships them in one folder
            "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"]
    if platform == "kleidiai" and "gcc" in os.path.basename(cc):
        args.append(f"-DCMAKE_C_FLAGS={GCC_KLEIDIAI_CFLAGS}")
    return args


def find_qemu() -> str | None:
    for name in QEMU_NAMES:
        if shutil.which(name):
            return shutil.which(name)
    return None


# --------------------------------------------------------------------------- an SME2-capable qemu-user
#
# Debian 12's qemu-user-static (7.2) emulates SME but not SME2: KleidiAI's SME2 kernels die there with
# SIGILL, and ggml never selects them. QEMU 10.1 and later emulate SME2 under ``-cpu max``. Debian's
# trixie-backports ``qemu-user`` (statically linked) runs on Debian 12; fetch_qemu_sme2 takes only its
# ``qemu-aarch64`` through a private apt state, so the system's packages are never touched. It must not
# replace qemu-user-static 7.2: QEMU cannot hide SME2 while keeping SME, so the SME1-only kernels need
# the old emulator.

QEMU_SME2_MIN = (10, 1)
QEMU_SME2_SUITES = ("trixie-backports", "forky")
QEMU_SME2_ENV = "DFLASH_GGUF_QEMU_SME2"
# the streaming vector lengths the SME2 checks run at: 256 bits (QEMU's default), 512 bits (Apple M4's)
SME2_VECTOR_BITS = (256, 512)


def qemu_sme2_cpu(vector_bits: int = 256) -> str:
    """The ``-cpu`` argument of an SME2 emulator run at ``vector_bits`` streaming vector length."""
    return "max" if vector_bits == 256 else f"max,sme-default-vector-length={vector_bits // 8}"


def qemu_version(qemu: str | os.PathLike) -> tuple[int, int] | None:
    try:
        out = subprocess.run([str(qemu), "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"version (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def qemu_sme2_path() -> Path:
    return paths.cache_dir() / "qemu-sme2" / "qemu-aarch64"


def find_qemu_sme2() -> str | None:
    """A qemu-aarch64 that emulates SME2: $DFLASH_GGUF_QEMU_SME2, the fetched one in the cache, or the
    system's qemu-aarch64(-static) when it is new enough."""
    cands = [os.environ.get(QEMU_SME2_ENV), str(qemu_sme2_path()), *(shutil.which(n) for n in QEMU_NAMES)]
    for c in cands:
        if c and os.access(c, os.X_OK) and (qemu_version(c) or (0, 0)) >= QEMU_SME2_MIN:
            return c
    return None


def _debian_archive() -> str | None:
    """The Debian archive this machine's apt already uses (deb822 or one-line sources)."""
    texts = [f.read_text(errors="replace") for f in Path("/etc/apt/sources.list.d").glob("*.sources")]
    for t in texts:
        m = re.search(r"^URIs:\s*(\S+/debian)\s*$", t, re.M)
        if m:
            return m.group(1)
    lst = Path("/etc/apt/sources.list")
    if lst.exists():
        m = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)\s", lst.read_text(errors="replace"), re.M)
        if m:
            return m.group(1)
    return None


def fetch_qemu_sme2() -> Path:
    """Fetch (once; cached) a qemu-aarch64 >= 10.1 from Debian's newer suites into the cache."""
    dest = qemu_sme2_path()
    if dest.exists() and (qemu_version(dest) or (0, 0)) >= QEMU_SME2_MIN:
        return dest
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise ToolMissing("apt-get/dpkg-deb not found: the SME2 emulator is taken from Debian's qemu-user package")
    uri = _debian_archive()
    if uri is None:
        raise ToolMissing("no Debian archive in this machine's apt sources: cannot fetch an SME2-capable qemu-user")
    errors = []
    with tempfile.TemporaryDirectory(dir=paths.cache_dir()) as tmp:
        w = Path(tmp)
        for d in ("lists/partial", "cache/archives/partial", "parts", "deb"):
            (w / d).mkdir(parents=True)
        for suite in QEMU_SME2_SUITES:
            (w / "sources.list").write_text(f"deb {uri} {suite} main\n")
            opts = ["-q", "-o", f"Dir::Etc::SourceList={w / 'sources.list'}", "-o", f"Dir::Etc::SourceParts={w / 'parts'}",
                    "-o", f"Dir::State::Lists={w / 'lists'}", "-o", f"Dir::Cache={w / 'cache'}",
                    "-o", "APT::Architectures=amd64", "-o", "APT::Sandbox::User=root"]
            r = subprocess.run(["apt-get", *opts, "update"], capture_output=True, text=True)
            if r.returncode == 0:
                r = subprocess.run(["apt-get", *opts, "download", "qemu-user"], cwd=w / "deb", capture_output=True, text=True)
            debs = sorted((w / "deb").glob("qemu-user_*_amd64.deb"))
            if r.returncode != 0 or not debs:
                errors.append(f"{suite}: {r.stderr.strip()[-300:]}")
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            part = dest.with_suffix(".part")
            with open(part, "wb") as f:
                tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(debs[-1])], stdout=subprocess.PIPE)
                subprocess.run(["tar", "-x", "-O", "./usr/bin/qemu-aarch64"], stdin=tar.stdout, stdout=f, check=True)
                tar.wait()
            part.chmod(0o755)
            if (qemu_version(part) or (0, 0)) >= QEMU_SME2_MIN:
                os.replace(part, dest)
                return dest
            errors.append(f"{suite}: its qemu-aarch64 ({qemu_version(part)}) predates SME2 emulation")
            part.unlink()
    raise ToolMissing("could not fetch an SME2-capable qemu-user (>= 10.1) from " + uri + ": " + "; ".join(errors))


# --------------------------------------------------------------------------- KleidiAI

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check_kleidiai_tree(src: Path) -> Path:
    cml = src / "CMakeLists.txt"
    if not cml.exists():
        raise CrossError(f"--kleidiai-src {src} has no CMakeLists.txt: pass the KleidiAI source folder "
                         f"or its archive (kleidiai-v{KLEIDIAI_VERSION}-src.tar.gz)")
    m = re.search(r"project\(\s*KleidiAI\s+VERSION\s+([0-9.]+)", cml.read_text(errors="replace"))
    if not m:
        raise CrossError(f"{cml} does not declare project(KleidiAI VERSION ...): not a KleidiAI source tree")
    if m.group(1) != KLEIDIAI_VERSION:
        raise CrossError(f"KleidiAI source {src} is version {m.group(1)}; the pinned llama.cpp is built and "
                         f"tested against {KLEIDIAI_VERSION} (tag v{KLEIDIAI_VERSION}, commit {KLEIDIAI_COMMIT[:7]})")
    return src


@functools.lru_cache(maxsize=8)
def kleidiai_source(arg: str | os.PathLike) -> Path:
    """A KleidiAI v1.24.0 source folder from a folder or an archive (unpacked once into the cache)."""
    p = Path(arg).expanduser().resolve()
    if p.is_dir():
        return _check_kleidiai_tree(p)
    if not p.is_file():
        raise CrossError(f"--kleidiai-src {p} does not exist")
    if not tarfile.is_tarfile(p):
        raise CrossError(f"--kleidiai-src {p} is neither a folder nor a tar archive")
    digest = _sha256(p)
    if digest in KLEIDIAI_KNOWN_ARCHIVES:
        log.info("KleidiAI archive %s: %s", p.name, KLEIDIAI_KNOWN_ARCHIVES[digest])
    elif hashlib.md5(p.read_bytes()).hexdigest() == KLEIDIAI_RELEASE_MD5:
        log.info("KleidiAI archive %s: upstream's v%s release archive", p.name, KLEIDIAI_VERSION)
    else:
        log.warning("KleidiAI archive %s (sha256 %s…) is not a known v%s archive; its version is checked "
                    "from its CMakeLists.txt", p.name, digest[:12], KLEIDIAI_VERSION)
    dest = paths.cache_dir() / "kleidiai" / digest[:16]

    def unpack(tmp: Path) -> None:
        with tarfile.open(p) as tf:
            tf.extractall(tmp, filter="data")
    paths.make_once(dest, ".unpacked", digest, unpack)
    tops = [d for d in dest.iterdir() if d.is_dir()]
    root = tops[0] if len(tops) == 1 and not (dest / "CMakeLists.txt").exists() else dest
    return _check_kleidiai_tree(root)


# --------------------------------------------------------------------------- wheel

def _readelf() -> str:
    for name in ("aarch64-linux-gnu-readelf", "readelf"):
        if shutil.which(name):
            return shutil.which(name)
    raise ToolMissing("readelf not found (binutils): needed to read the libraries' sonames")


def _dynamic(lib: Path) -> tuple[str | None, list[str]]:
    out = subprocess.run([_readelf(), "-d", str(lib)], capture_output=True, text=True).stdout
    soname = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", out)
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    return (soname.group(1) if soname else None), needed


def wheel_libraries(bindir: Path) -> dict[str, Path]:
    """Wheel file name -> built file for libllama and every project library it needs (by soname)."""
    want: dict[str, Path] = {}
    by_soname: dict[str, Path] = {}
    for f in bindir.glob("lib*.so*"):
        real = f.resolve()
        soname, _ = _dynamic(real)
        if soname:
            by_soname[soname] = real
    top = bindir / "libllama.so"
    if not top.exists():
        raise CrossError(f"{top} is missing: the cross build did not produce libllama")
    todo = [("libllama.so", top.resolve())]
    while todo:
        name, real = todo.pop()
        if name in want:
            continue
        want[name] = real
        for dep in _dynamic(real)[1]:
            if dep in by_soname:
                todo.append((dep, by_soname[dep]))
    return want


def _record_line(arc: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def make_wheel(tree: Path, bindir: Path, out_dir: Path, version: str, plat: str = "linux_aarch64") -> Path:
    """Pack the cross-built libraries and the sdist's ``llama_cpp`` package into an installable wheel."""
    pkg = tree / "llama_cpp"
    if not (pkg / "__init__.py").exists():
        raise CrossError(f"{pkg} is not the llama_cpp package of the sdist")
    pkg_info = (tree / "PKG-INFO").read_text()
    dist = f"llama_cpp_python-{version}"
    name = f"{dist}-py3-none-{plat}.whl"
    files: list[tuple[str, bytes]] = []
    for f in sorted(pkg.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc" and "lib" not in f.relative_to(pkg).parts[:1]:
            files.append((f"llama_cpp/{f.relative_to(pkg).as_posix()}", f.read_bytes()))
    for arc_name, real in sorted(wheel_libraries(bindir).items()):
        files.append((f"llama_cpp/lib/{arc_name}", real.read_bytes()))
    wheel_meta = ("Wheel-Version: 1.0\nGenerator: dflash_gguf.build.cross\nRoot-Is-Purelib: false\n"
                  f"Tag: py3-none-{plat}\n")
    files += [(f"{dist}.dist-info/METADATA", pkg_info.encode()), (f"{dist}.dist-info/WHEEL", wheel_meta.encode())]
    record = [_record_line(a, d) for a, d in files] + [f"{dist}.dist-info/RECORD,,"]
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (name + ".part")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arc, data in files:
            info = zipfile.ZipInfo(arc, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if arc.endswith(".so") or ".so." in arc else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
        zf.writestr(zipfile.ZipInfo(f"{dist}.dist-info/RECORD", date_time=(2020, 1, 1, 0, 0, 0)),
                    "\n".join(record) + "\n")
    os.replace(tmp, out_dir / name)
    log.info("aarch64 wheel %s (%d files, %.1f MB)", name, len(files), (out_dir / name).stat().st_size / 1e6)
    return out_dir / name


# --------------------------------------------------------------------------- guest Python

def _apt(*args: str) -> str:
    r = subprocess.run(list(args), capture_output=True, text=True)
    if r.returncode != 0:
        raise ToolMissing(f"{' '.join(args)} failed: {r.stderr.strip()[-600:]}\nThe emulated Python needs "
                         "Debian's arm64 packages: dpkg --add-architecture arm64 && apt-get update")
    return r.stdout


def guest_python_version(arch: str = "arm64") -> str:
    """The X.Y of the distribution's python3 for ``arch`` (from apt's package lists)."""
    if not shutil.which("apt-cache"):
        raise ToolMissing("apt-cache not found: the emulated aarch64 Python is built from Debian/Ubuntu arm64 packages")
    out = _apt("apt-cache", "show", "--no-all-versions", f"python3-minimal:{arch}")
    m = re.search(r"^(?:Pre-)?Depends:.*?python(3\.\d+)-minimal", out, re.M)
    if not m:
        raise CrossError(f"cannot tell the python3 version of python3-minimal:{arch} from apt-cache")
    return m.group(1)


def _sysroot_packages(pyver: str, arch: str) -> list[str]:
    roots = [f"python{pyver}-minimal:{arch}", f"libpython{pyver}-stdlib:{arch}", f"libstdc++6:{arch}"]
    out = _apt("apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
               "--no-breaks", "--no-replaces", "--no-enhances", "--no-pre-depends", *roots)
    names = sorted({ln.strip() for ln in out.splitlines() if ln and not ln.startswith(" ")})
    return [n for n in names if n.endswith(f":{arch}") and not n.startswith("<")
            and not _SKIP_PKGS.match(n.split(":")[0])]


def sysroot(arch: str = "arm64") -> Path:
    """A folder with Debian's arm64 CPython and the libraries it and libllama need (cached)."""
    pyver = guest_python_version(arch)
    root = paths.cache_dir() / "cross" / f"sysroot-{arch}-py{pyver}"
    if (root / ".complete").exists():
        return root
    pkgs = _sysroot_packages(pyver, arch)
    log.info("making an %s sysroot with Python %s from %d Debian packages", arch, pyver, len(pkgs))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    with tempfile.TemporaryDirectory(dir=paths.cache_dir()) as tmp:
        r = subprocess.run(["apt-get", "download", *pkgs], cwd=tmp, capture_output=True, text=True)
        if r.returncode != 0:
            raise ToolMissing(f"apt-get download of the {arch} packages failed: {r.stderr.strip()[-800:]}")
        for deb in sorted(Path(tmp).glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    py = root / "usr" / "bin" / f"python{pyver}"
    if not py.exists():
        raise CrossError(f"{py} missing after unpacking the {arch} packages")
    (root / ".complete").write_text(json.dumps({"python": pyver, "packages": pkgs}))
    return root


def guest_site(wheel: Path, pyver: str) -> Path:
    """A folder holding the aarch64 wheel installed with its dependencies + GUEST_EXTRA (cached by both)."""
    tag = hashlib.sha256(wheel.read_bytes() + repr(GUEST_EXTRA).encode()).hexdigest()[:16]
    site = paths.cache_dir() / "cross" / f"site-py{pyver}-{tag}"
    if (site / ".complete").exists():
        return site
    shutil.rmtree(site, ignore_errors=True)
    plat = [a for p in GUEST_PLATFORMS for a in ("--platform", p)]
    nodot = pyver.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--target", str(site),
           *plat, "--python-version", pyver, "--implementation", "cp", "--abi", f"cp{nodot}", "--abi", "abi3",
           "--abi", "none", "--only-binary", ":all:", str(wheel), *GUEST_EXTRA]
    log.info("installing the aarch64 wheel + numpy/cffi for CPython %s into %s", pyver, site)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        shutil.rmtree(site, ignore_errors=True)
        raise CrossError(f"pip could not install the aarch64 wheel set (needs PyPI for numpy/cffi):\n{r.stderr.strip()[-1200:]}")
    (site / ".complete").write_text(wheel.name)
    return site


def guest_python(wheel: Path, cpu: str = "max", qemu: str | None = None) -> tuple[list[str], dict]:
    """(command prefix, environment) that run the emulated aarch64 CPython with the wheel installed
    (under ``qemu``, default: the system's qemu-user)."""
    qemu = qemu or find_qemu()
    if qemu is None:
        raise ToolMissing("qemu-aarch64-static not found (Debian: apt-get install qemu-user-static)")
    root = sysroot()
    pyver = json.loads((root / ".complete").read_text())["python"]
    site = guest_site(wheel, pyver)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(Path(__file__).resolve().parents[2])]),
           "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8",
           "DFLASH_GGUF_CACHE": str(paths.cache_dir()), "HOME": os.environ.get("HOME", "/root")}
    return [qemu, "-cpu", cpu, "-L", str(root), str(root / "usr" / "bin" / f"python{pyver}")], env


def wheel_pointer(variant: str) -> Path:
    return paths.cache_dir() / f"cross-wheel-{variant}"


def cross_wheel(variant: str) -> Path | None:
    """The wheel the last build of a cross variant (``aarch64-linux-gnu``, ``...-kleidiai``) made, if it
    was built from this checkout's patch series (a wheel of another series would fail the stamp check)."""
    p = wheel_pointer(variant)
    if not (p.exists() and Path(p.read_text().strip()).is_file()):
        return None
    wheel = Path(p.read_text().strip())
    stamp = f"series={paths.patch_series_hash()}".encode()
    try:
        with zipfile.ZipFile(wheel) as zf:
            lib = zf.read("llama_cpp/lib/libllama.so")
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    if stamp not in lib:
        log.info("the last %s cross build is of another patch series: rebuild it", variant)
        return None
    return wheel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.build.cross",
                                 description="Prepare (and print) the emulated aarch64 Python for a cross-built wheel.")
    ap.add_argument("--wheel", help="aarch64 wheel (default: the last --cross build's)")
    ap.add_argument("--variant", default="aarch64-linux-gnu",
                    help="which cross build: aarch64-linux-gnu (default) or aarch64-linux-gnu-kleidiai")
    ap.add_argument("--fetch-qemu-sme2", action="store_true",
                    help="fetch (once, into the cache) a qemu-aarch64 that emulates SME2, print its path and stop")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if args.fetch_qemu_sme2:
        try:
            print(fetch_qemu_sme2())
        except CrossError as e:
            log.error("%s", e)
            return 1
        return 0
    wheel = Path(args.wheel) if args.wheel else cross_wheel(args.variant)
    if wheel is None:
        log.error("no aarch64 wheel: run python -m dflash_gguf.build --cross first (%s)", args.variant)
        return 1
    try:
        cmd, env = guest_python(wheel)
    except CrossError as e:
        log.error("%s", e)
        return 1
    print(json.dumps({"command": cmd, "env": env}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
