"""The offline CUDA check's pack (bench/gpu_pack.py, run by bench/gpu_pack_run.sh as the pack's run.sh).

The pack goes to an NVIDIA machine without network, with at most 64 MiB beside the working tree: what
run.sh reads must be in it and installable there. Checked here without building it (the trim rules on
a small fake tree, the hand-made wheels, the wheel tags, run.sh against the layout); a pack already
built (``gpu-pack/``, ``make gpu-dry-run`` or ``python bench/gpu_pack.py``; about a minute) is checked
whole: size, entries, wheels for Python 3.11 and 3.12, the tree's CUDA sources.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_pack", ROOT / "bench" / "gpu_pack.py")
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)

RUN_SH = ROOT / "bench" / "gpu_pack_run.sh"

KEPT = ["CMakeLists.txt", "LICENSE", "cmake/common.cmake", "src/llama.cpp", "src/llama-dflash-stamp.h",
        "include/llama.h", "common/common.cpp", "vendor/cpp-httplib/httplib.h", "ggml/CMakeLists.txt",
        "ggml/src/ggml.c", "ggml/src/CMakeLists.txt", "ggml/src/ggml-cpu/ggml-cpu.c",
        "ggml/src/ggml-cuda/CMakeLists.txt", "ggml/src/ggml-cuda/ggml-cuda.cu", "ggml/src/ggml-cuda/common.cuh",
        "ggml/src/ggml-cuda/template-instances/mmq-instance-q4_0.cu",
        "ggml/src/ggml-cuda/template-instances/fattn-vec-instance-f16-f16.cu",
        "ggml/src/ggml-cuda/template-instances/fattn-vec-instance-q5_0-q5_0.cu",
        "ggml/src/ggml-rpc/ggml-rpc.cpp", "scripts/ui-assets.cmake", "tools/CMakeLists.txt",
        "tools/ui/CMakeLists.txt", "tools/ui/ui.cpp.in", "tools/ui/sources.cmake", "tools/server/server.cpp",
        "tools/mtmd/clip.cpp", "tools/completion/completion.cpp",
        "examples/speculative-simple/speculative-simple.cpp", "pocs/CMakeLists.txt", "models/ggml-vocab-qwen2.gguf"]
DROPPED = ["docs/build.md", "models/ggml-vocab-llama-bpe.gguf", "models/templates/Qwen-Qwen3-0.6B.jinja",
           "tests/test-backend-ops.cpp", "media/llama.png",
           "gguf-py/gguf/__init__.py", "convert_hf_to_gguf.py", "conversion/base.py", ".github/workflows/build.yml",
           "ggml/src/ggml-vulkan/ggml-vulkan.cpp", "ggml/src/ggml-metal/ggml-metal.m", "ggml/src/ggml-sycl/ggml-sycl.cpp",
           "ggml/src/ggml-opencl/ggml-opencl.cpp", "ggml/src/ggml-hip/CMakeLists.txt", "ggml/src/ggml-musa/CMakeLists.txt",
           "ggml/src/ggml-cann/ggml-cann.cpp", "ggml/src/ggml-cuda/__pycache__/x.pyc", "scripts/sync_vendor.py",
           "tools/ui/src/app.ts", "tools/ui/package-lock.json", "tools/server/tests/test_basic.py",
           "tools/mtmd/test-1.jpeg", "examples/llama.android/build.gradle.kts", "app/CMakeLists.txt"]


def test_trim_keeps_what_a_cuda_build_reads(tmp_path):
    for rel in KEPT + DROPPED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    members = gp.tree_members(tmp_path)
    assert members == sorted(KEPT)
    assert gp.cuda_sources(members) == {"cu_files": 4, "template_instances": 3, "fattn_vec_instances": 2,
                                        "mmq_instances": 1, "compiled_by_default": 3}


def _sha(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_pure_wheel_installs_offline(tmp_path):
    """The hand-made wheel (the Python files of llama_cpp and gguf): RECORD right, pip installs it with
    --no-index, it imports, and its native leftovers are not in it."""
    pkg = tmp_path / "src" / "fakepkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 7\n")
    (pkg / "sub" / "__init__.py").write_text("from fakepkg import VALUE as V\n")
    (pkg / "py.typed").write_text("")
    (pkg / "libfake.so").write_bytes(b"\x7fELF")
    whl = gp.pure_wheel(tmp_path, "fake-pkg", "1.2.3", {"fakepkg": pkg}, ["numpy>=1.20"])
    assert whl.name == "fake_pkg-1.2.3-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        record = z.read("fake_pkg-1.2.3.dist-info/RECORD").decode().splitlines()
        for line in record:
            path, digest, size = line.rsplit(",", 2)
            if path.endswith("RECORD"):
                continue
            data = z.read(path)
            assert digest == _sha(data) and int(size) == len(data), path
        assert "Requires-Dist: numpy>=1.20" in z.read("fake_pkg-1.2.3.dist-info/METADATA").decode()
    assert "fakepkg/libfake.so" not in names and "fakepkg/py.typed" in names
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--disable-pip-version-check", "--target", str(target), str(whl)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", "import fakepkg.sub; print(fakepkg.sub.V)"],
                       env=dict(os.environ, PYTHONPATH=str(target)), capture_output=True, text=True)
    assert r.stdout.strip() == "7", r.stderr


@pytest.mark.parametrize("name, on", [
    ("cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", {"3.12"}),
    ("cffi-2.1.1-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl", {"3.11"}),
    ("safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", {"3.11", "3.12"}),
    ("safetensors-0.8.0-cp313-abi3-manylinux_2_17_x86_64.whl", set()),
    ("pytest-9.2.0-py3-none-any.whl", {"3.11", "3.12"}),
    ("six-1.17.0-py2.py3-none-any.whl", {"3.11", "3.12"}),
])
def test_wheel_tags(name, on):
    assert {py for py in ("3.11", "3.12") if gp.installs_on(Path(name), py)} == on


def test_a_missing_wheel_is_named():
    have = [Path(f"{n.replace('-', '_')}-1.0-py3-none-any.whl") for n in gp.THIRD_PARTY if n != "cffi"]
    have += [Path("cffi-2.1.1-cp312-cp312-manylinux2014_x86_64.whl")]
    have += [Path(f"{n}-1.0-py3-none-any.whl") for n in ("dflash_gguf", "llama_cpp_python", "gguf")]
    assert gp.check_wheels(have) == ["no wheel of cffi for Python 3.11"]


def test_run_sh_reads_only_the_packs_layout():
    text = RUN_SH.read_text()
    needs = gp.run_sh_needs(text)
    assert needs and needs <= set(gp.LAYOUT), needs - set(gp.LAYOUT)
    assert subprocess.run(["bash", "-n", str(RUN_SH)]).returncode == 0


def test_check_names_what_a_pack_lacks(tmp_path):
    (tmp_path / "run.sh").write_text(RUN_SH.read_text())
    (tmp_path / "wheels").mkdir()
    problems = gp.check(tmp_path)
    assert "missing llama.cpp.tar.xz" in problems and "missing requirements.txt" in problems
    assert "no wheel of dflash-gguf for Python 3.12" in problems


def test_built_pack_fits_and_holds_what_run_sh_needs():
    pack = Path(os.environ.get("DFLASH_GGUF_GPU_PACK") or ROOT / "gpu-pack")
    if not (pack / "MANIFEST.json").is_file():
        pytest.skip(f"no GPU pack at {pack} (python bench/gpu_pack.py, about a minute)")
    assert gp.check(pack) == []
    assert gp.folder_bytes(pack) <= gp.PACK_LIMIT
