"""Pack what an offline NVIDIA machine needs for the CUDA check into one folder: ``python bench/gpu_pack.py [DEST]``.

The GPU machines this project may get have Python 3.12 with numpy and torch, CMake, ninja and nvcc,
and no network: the check (``run.sh`` in the pack, from ``bench/gpu_pack_run.sh``) builds and runs
from this folder alone (default ``gpu-pack/``, git-ignored, at most 64 MiB):

* ``llama.cpp.tar.xz``: the patched llama.cpp tree of this checkout's patch series, trimmed to what a
  CUDA build of libllama, ggml-cuda, llama-speculative-simple, llama-completion and llama-server reads
  (no tests, docs, models, other backends' sources, gguf-py, converters, web UI sources);
* ``wheels/``: this package (``dflash_gguf``, with the demo pairs), the patched ``llama_cpp`` Python
  package without a native library (``run.sh`` links the build into it), the tree's ``gguf``, and
  every other package the check imports that a bare Python with numpy lacks, for CPython 3.12 (the
  GPU machines) and 3.11 (this project's machines, for the dry run);
* ``tests/``: this checkout's tests (``tests/test_offload.py`` runs on CUDA);
* ``test-models.tar.xz``: the tiny hybrid Qwen3.5 pair of ``test_offload.py``, made here (making it
  needs transformers and sentencepiece training);
* ``requirements.txt`` (what ``run.sh`` installs with ``pip --no-index``), ``MANIFEST.json`` (sizes,
  versions, the patch series, the CUDA source count), ``run.sh``.

Making it needs this checkout's build cache (the sdist, ``python -m dflash_gguf.build``), PyPI for the
third-party wheels and hatchling (the wheel of this package), and the test dependencies
(``make .venv/.test-deps``) unless the test models are cached already.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash_gguf import paths  # noqa: E402
from dflash_gguf.build import native as build  # noqa: E402

log = logging.getLogger("gpu_pack")

PACK_LIMIT = 64 * 2**20   # what the device tool carries beside the working tree
PYTHONS = ("3.12", "3.11")   # the GPU machines; this project's machines (the dry run)
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
# what the check imports beyond numpy (and torch, unused): llama_cpp's and gguf's dependencies, pytest,
# and what tests/tiny.py imports before it finds the pack's test models (sentencepiece, safetensors)
THIRD_PARTY = ("cffi", "pycparser", "jinja2", "markupsafe", "diskcache", "typing-extensions", "pyyaml", "tqdm",
               "pytest", "iniconfig", "pluggy", "packaging", "pygments", "sentencepiece", "safetensors")
# the pack's layout: everything run.sh reads (tests/test_gpu_pack.py holds run.sh to it)
LAYOUT = ("run.sh", "MANIFEST.json", "requirements.txt", "llama.cpp.tar.xz", "test-models.tar.xz", "wheels", "tests")
# the hybrid pair of tests/test_offload.py::test_hybrid_target_offloaded: the files tests/tiny.py
# looks for before making anything (the Hugging Face folders' config.json only)
TEST_MODEL_FILES = ("tokenizer/tokenizer.model", "hf-qwen35/config.json", "hf-qwen35-dflash-b8/config.json",
                    "qwen35.gguf", "qwen35-dflash-b8.gguf")

# --------------------------------------------------------------------------- the trimmed tree

# top level of the llama.cpp tree: what CMake reads for libllama, ggml and the tools
KEEP_TOP = {"CMakeLists.txt", "LICENSE", "cmake", "common", "ggml", "include", "src", "vendor", "tools",
            "examples", "pocs", "scripts", "licenses", "grammars"}
# ggml backends: the CPU one, CUDA, RPC; the others' sources are left out (vulkan, metal, sycl, ...)
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-rpc"}
# files kept where their folder is left out: the Qwen2/Qwen3 tokenizer the scale bench's synthetic pairs
# take (dflash_gguf.bench.scale.synth, from the tree's models/)
KEEP_FILES = {"models/ggml-vocab-qwen2.gguf"}
DROP = (
    re.compile(r"^scripts/(?!.*\.cmake$)"),            # scripts/ui-assets.cmake is the one CMake runs
    re.compile(r"^tools/ui/(?!(CMakeLists\.txt|sources\.cmake|[^/]+\.in)$)"),   # the web UI's sources (npm)
    re.compile(r"^tools/(server|mtmd)/tests/"),
    re.compile(r"^tools/mtmd/test-\d\.\w+$"),          # sample images and audio
    re.compile(r"^examples/(llama\.android|llama\.swiftui|model-conversion)/"),
    re.compile(r"^ggml/(tests|examples)/"),
    re.compile(r"(^|/)(__pycache__|\.git|\.github|node_modules)(/|$)"),
    re.compile(r"\.(pyc|png|jpe?g|gif|mp3|mp4|wav|gguf)$"),
)


def keep(rel: str) -> bool:
    """Whether a path of the llama.cpp tree (relative, '/'-separated) goes into the trimmed archive."""
    if rel in KEEP_FILES:
        return True
    parts = rel.split("/")
    if parts[0] not in KEEP_TOP:
        return False
    if rel.startswith("ggml/src/ggml-") and len(parts) > 3 and parts[2] not in KEEP_BACKENDS:
        return False
    return not any(p.search(rel) for p in DROP)


def tree_members(tree: Path) -> list[str]:
    """The trimmed tree's files, sorted: the archive's members (under ``llama.cpp/``)."""
    out = []
    for p in sorted(tree.rglob("*")):
        rel = p.relative_to(tree).as_posix()
        if p.is_file() and not p.is_symlink() and keep(rel):
            out.append(rel)
    return out


# the flash-attention vector kernels ggml-cuda compiles by default (GGML_CUDA_FA_QUANTS; "all" would be 49)
DEFAULT_FA_VEC = ("q4_0-q4_0", "q8_0-q8_0", "f16-f16", "bf16-bf16")


def cuda_sources(members: list[str]) -> dict[str, int]:
    """ggml-cuda's translation units in the trimmed tree, and those a default build compiles."""
    cu = [m for m in members if m.startswith("ggml/src/ggml-cuda/") and m.endswith(".cu")]
    inst = [m for m in cu if "/template-instances/" in m]
    vec = [m for m in inst if "/fattn-vec-instance-" in m]
    default_vec = [m for m in vec if m.split("fattn-vec-instance-")[1][:-3] in DEFAULT_FA_VEC]
    return {"cu_files": len(cu), "template_instances": len(inst), "fattn_vec_instances": len(vec),
            "mmq_instances": sum("mmq-instance" in m for m in inst),
            "compiled_by_default": len(cu) - len(vec) + len(default_vec)}


def write_tree(tree: Path, dest: Path) -> dict:
    members = tree_members(tree)
    with tarfile.open(dest, "w:xz", preset=6) as tf:
        for rel in members:
            info = tf.gettarinfo(str(tree / rel), arcname=f"llama.cpp/{rel}")
            info.uid = info.gid = 0           # the files' own times kept: a newer pack's changes rebuild
            info.uname = info.gname = ""
            with open(tree / rel, "rb") as f:
                tf.addfile(info, f)
    return {"file": dest.name, "members": len(members), "bytes": dest.stat().st_size,
            "unpacked_bytes": sum((tree / m).stat().st_size for m in members), "cuda": cuda_sources(members)}


# --------------------------------------------------------------------------- wheels

def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def pure_wheel(dest_dir: Path, name: str, version: str, packages: dict[str, Path], requires: list[str]) -> Path:
    """A py3-none-any wheel of the ``.py`` (and ``py.typed``) files of ``packages`` (import name: folder)."""
    dist = re.sub(r"[-_.]+", "_", name)
    info = f"{dist}-{version}.dist-info"
    files: dict[str, bytes] = {}
    for pkg, folder in packages.items():
        for p in sorted(folder.rglob("*")):
            if p.is_file() and (p.suffix == ".py" or p.name == "py.typed") and "__pycache__" not in p.parts:
                files[f"{pkg}/{p.relative_to(folder).as_posix()}"] = p.read_bytes()
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
            "Summary: the Python files only (bench/gpu_pack.py; run.sh links its native build in)"]
    files[f"{info}/METADATA"] = ("\n".join(meta + [f"Requires-Dist: {r}" for r in requires]) + "\n").encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: dflash-gguf gpu_pack\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{k},{_record_hash(v)},{len(v)}\n" for k, v in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    out = dest_dir / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in files.items():
            z.writestr(zipfile.ZipInfo(k, (1980, 1, 1, 0, 0, 0)), v, zipfile.ZIP_DEFLATED)
    return out


def _pyproject_deps(pyproject: Path) -> list[str]:
    """``[project] dependencies`` of a pyproject.toml, without a TOML parser (Python 3.10 has none)."""
    m = re.search(r"^dependencies\s*=\s*\[(.*?)\]", pyproject.read_text(), re.S | re.M)
    return [re.sub(r"\s*\((.*)\)", r"\1", d) for d in re.findall(r"['\"]([^'\"]+)['\"]", m.group(1))] if m else []


def _pip(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args, "--disable-pip-version-check", "-q"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"pip {' '.join(args[:3])} ... failed:\n{r.stderr.strip()[-1500:]}")


def download_wheels(dest: Path) -> None:
    """THIRD_PARTY's binary wheels for every Python of PYTHONS (pure ones once)."""
    for py in PYTHONS:
        _pip("download", "--only-binary", ":all:", "--no-deps", "--python-version", py, "--implementation", "cp",
             *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest), *THIRD_PARTY)


def wheel_name_version(whl: Path) -> tuple[str, str]:
    name, version = whl.name.split("-")[:2]
    return name.lower().replace("_", "-"), version


def installs_on(whl: Path, py: str) -> bool:
    """Whether CPython ``py`` (e.g. "3.12") on x86-64 Linux installs this wheel (by its tags)."""
    pytags, abi = whl.stem.split("-")[-3:-1]
    tag = "cp" + py.replace(".", "")
    if abi == "none":
        return any(t == tag or t.startswith("py3") for t in pytags.split("."))
    if abi == "abi3":
        return any(t.startswith("cp3") and int(t[3:]) <= int(tag[3:]) for t in pytags.split("."))
    return abi == tag


def check_wheels(wheels: list[Path]) -> list[str]:
    """Problems: a package of THIRD_PARTY (or of ours) without a wheel each Python of PYTHONS installs."""
    need = {*THIRD_PARTY, "dflash-gguf", "llama-cpp-python", "gguf"}
    return [f"no wheel of {n} for Python {py}" for py in PYTHONS
            for n in sorted(need - {wheel_name_version(w)[0] for w in wheels if installs_on(w, py)})]


# --------------------------------------------------------------------------- test models

def test_models(dest: Path) -> dict:
    """The tiny hybrid pair, made (or found) in this checkout's test-model cache, packed as tar.xz."""
    code = ("import sys; sys.path.insert(0, 'tests'); from conftest import TinyModels, _models_root; "
            "r = _models_root(); TinyModels(r).pair('qwen35', 'dflash', 8); print(r)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit("could not make the tiny hybrid pair of tests/test_offload.py (the test dependencies: "
                         f"make .venv/.test-deps):\n{r.stderr.strip()[-1500:]}")
    root = Path(r.stdout.strip().splitlines()[-1])
    with tarfile.open(dest, "w:xz", preset=6) as tf:
        for rel in TEST_MODEL_FILES:
            tf.add(root / rel, arcname=f"{root.name}/{rel}")
    return {"file": dest.name, "key": root.name, "files": list(TEST_MODEL_FILES), "bytes": dest.stat().st_size}


# --------------------------------------------------------------------------- the pack

def patched_tree() -> tuple[Path, str, str]:
    """The patched sdist root of this checkout's series (the default CPU build's key), its key and series."""
    opts = build.BuildOptions()
    series = paths.patch_series_hash()
    key = build.build_key(series, opts)
    return build.prepare_tree(build.fetch_sdist(opts), key, series, False), key, series


def folder_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def pack(dest: Path) -> dict:
    t0 = time.time()
    sdist_root, key, series = patched_tree()
    llama = sdist_root / "vendor" / "llama.cpp"
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-pack-", dir=dest.parent))
    try:
        wheels = tmp / "wheels"
        wheels.mkdir()
        manifest: dict = {"made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "patch_series": series,
                          "build_key": key, "sdist": build.SDIST_FILE, "pythons": list(PYTHONS)}
        log.info("trimming and packing the patched tree %s", llama)
        manifest["tree"] = write_tree(llama, tmp / "llama.cpp.tar.xz")
        log.info("wheels: llama_cpp (Python files), gguf, dflash_gguf, %d others for Python %s",
                 len(THIRD_PARTY), " and ".join(PYTHONS))
        pure_wheel(wheels, "llama_cpp_python", build.SDIST_VERSION, {"llama_cpp": sdist_root / "llama_cpp"},
                   _pyproject_deps(sdist_root / "pyproject.toml"))
        gguf_version = re.search(r'^version = "([^"]+)"', (llama / "gguf-py" / "pyproject.toml").read_text(), re.M)[1]
        pure_wheel(wheels, "gguf", gguf_version, {"gguf": llama / "gguf-py" / "gguf"},
                   _pyproject_deps(llama / "gguf-py" / "pyproject.toml"))
        _pip("wheel", "--no-deps", "-w", str(wheels), str(ROOT))
        download_wheels(wheels)
        found = sorted(wheels.glob("*.whl"))
        if problems := check_wheels(found):
            raise SystemExit("\n".join(problems))
        manifest["wheels"] = {w.name: w.stat().st_size for w in found}
        reqs = sorted({"{}=={}".format(*wheel_name_version(w)) for w in found})
        (tmp / "requirements.txt").write_text("\n".join(reqs) + "\n")
        log.info("the tiny hybrid pair of tests/test_offload.py")
        manifest["test_models"] = test_models(tmp / "test-models.tar.xz")
        shutil.copytree(ROOT / "tests", tmp / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copyfile(ROOT / "bench" / "gpu_pack_run.sh", tmp / "run.sh")
        (tmp / "run.sh").chmod(0o755)
        manifest["files"] = {p.name: (folder_bytes(p) if p.is_dir() else p.stat().st_size) for p in sorted(tmp.iterdir())}
        manifest["total_bytes"] = sum(manifest["files"].values())
        (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
        manifest["total_bytes"] = folder_bytes(tmp)
        if manifest["total_bytes"] > PACK_LIMIT:
            raise SystemExit(f"the pack is {manifest['total_bytes'] / 2**20:.1f} MiB, over {PACK_LIMIT / 2**20:.0f} MiB")
        if problems := check(tmp):
            raise SystemExit("\n".join(problems))
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    manifest["seconds"] = round(time.time() - t0, 1)
    return manifest


def run_sh_needs(run_sh: str) -> set[str]:
    """The pack's entries run.sh reads: the first path component after each ``$PACK/``."""
    return set(re.findall(r'\$PACK/([\w.-]+)', run_sh))


def check(pack_dir: Path) -> list[str]:
    """Problems with a pack: size, a missing entry run.sh reads, a missing wheel, a tree without ggml-cuda."""
    problems = []
    size = folder_bytes(pack_dir)
    if size > PACK_LIMIT:
        problems.append(f"{size / 2**20:.1f} MiB, over the {PACK_LIMIT / 2**20:.0f} MiB the device tool carries")
    run_sh = pack_dir / "run.sh"
    needs = run_sh_needs(run_sh.read_text()) if run_sh.is_file() else set()
    problems += [f"missing {n}" for n in sorted(set(LAYOUT) | needs) if not (pack_dir / n).exists()]
    if (pack_dir / "wheels").is_dir():
        wheels = sorted((pack_dir / "wheels").glob("*.whl"))
        problems += check_wheels(wheels)
        if (pack_dir / "requirements.txt").is_file():
            listed = {r.split("==")[0] for r in (pack_dir / "requirements.txt").read_text().split()}
            problems += [f"requirements.txt lacks {n}" for n in sorted({wheel_name_version(w)[0] for w in wheels} - listed)]
    tree = pack_dir / "llama.cpp.tar.xz"
    if tree.is_file():
        with tarfile.open(tree) as tf:
            names = set(tf.getnames())
        for need in ("CMakeLists.txt", "ggml/src/ggml-cuda/CMakeLists.txt", "ggml/src/ggml-cuda/ggml-cuda.cu",
                     "src/llama-dflash-stamp.h", "examples/speculative-simple/CMakeLists.txt",
                     "tools/completion/CMakeLists.txt", "tools/server/CMakeLists.txt", "scripts/ui-assets.cmake",
                     *KEEP_FILES):
            if f"llama.cpp/{need}" not in names:
                problems.append(f"llama.cpp.tar.xz lacks {need}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/gpu_pack.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest", nargs="?", default=str(ROOT / "gpu-pack"), help="the pack's folder (default gpu-pack/)")
    ap.add_argument("--check", action="store_true", help="check an existing pack instead of making one")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    dest = Path(args.dest).resolve()
    if args.check:
        problems = check(dest)
        print("\n".join(problems) or f"{dest}: {folder_bytes(dest) / 2**20:.1f} MiB, complete")
        return 1 if problems else 0
    m = pack(dest)
    print(json.dumps({k: m[k] for k in ("tree", "test_models", "files", "total_bytes", "seconds")}, indent=1))
    log.info("%s: %.1f MiB in %.0f s", dest, m["total_bytes"] / 2**20, m["seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
