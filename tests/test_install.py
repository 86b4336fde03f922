"""``pip install .`` as a user runs it: one command, a working engine, and the user's own llama_cpp untouched.

A fresh virtual environment gets this checkout with plain ``pip install`` (no ``make``, no second build
step): the wheel's build hook makes the patched llama.cpp (from the build cache that ``make build`` already
filled, so this takes seconds) and bundles it as ``dflash_gguf._llama_cpp``. Then a "user's" llama-cpp-python
is installed beside it - a separately built copy of the same release - and both run in one process, each on
its own libraries.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux)")]

_CHECK = r"""
import json
from pathlib import Path
import dflash_gguf
from dflash_gguf import Llama
from dflash_gguf.native import llama as native
d = Path(dflash_gguf.__file__).parent / "data" / "demo"
kw = dict(n_ctx=512, n_threads=1, verbose=False)
prompt = "def fibonacci(n):"
llm = Llama(str(d / "target.gguf"), draft_model_path=str(d / "drafter.gguf"), **kw)
out = llm(prompt, max_tokens=24, temperature=0)
r = {"bundled": native.BUNDLED, "copy": native.llama_cpp.__file__, "ours": out["choices"][0]["text"],
     "drafted": out["dflash"] is not None and out["dflash"]["enabled"]}
try:
    import llama_cpp
except ImportError:
    llama_cpp = None
r["user_llama_cpp"] = None if llama_cpp is None else llama_cpp.__file__
if llama_cpp is not None:
    plain = llama_cpp.Llama(str(d / "target.gguf"), **kw)
    r["plain"] = plain(prompt, max_tokens=24, temperature=0)["choices"][0]["text"]
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    lookup = Llama(str(d / "target.gguf"), draft_model=LlamaPromptLookupDecoding(num_pred_tokens=4), **kw)
    out = lookup(prompt, max_tokens=24, temperature=0)
    r["lookup"] = out["choices"][0]["text"]
    r["lookup_engine"] = out["dflash"] is not None
r["libs"] = sorted({l.split()[-1] for l in open("/proc/self/maps")
                    if ".so" in l and ("llama" in l or "ggml" in l)})
print("RESULT " + json.dumps(r))
"""


def _run(py: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    # the installed package, not a checkout on the caller's PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(py), *args], capture_output=True, text=True, timeout=timeout, cwd="/", env=env)


def _result(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_pip_install_gives_a_working_engine_beside_the_users_own_llama_cpp(tmp_path):
    from dflash_gguf.build import bundle

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env_note = "(needs the package index for the build backend and numpy/cffi)"
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(ROOT)],
                       capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"pip install . failed {env_note}:\n{p.stderr[-3000:]}"
    site = Path(_run(py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())

    # one command: the engine drafts, on the bundled copy; no llama_cpp of the user's exists yet
    alone = _result(_run(py, "-c", _CHECK))
    assert alone["bundled"] and Path(alone["copy"]).is_relative_to(site / "dflash_gguf" / "_llama_cpp")
    assert alone["user_llama_cpp"] is None and alone["drafted"]
    assert alone["ours"]
    assert not (site / "llama_cpp").exists(), "the wheel must not install a top-level llama_cpp"

    # a user's llama-cpp-python beside it (a separately built copy of the release, from the build cache)
    p = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        str(bundle.patched_wheel())], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    both = _result(_run(py, "-c", _CHECK))
    assert both["user_llama_cpp"] and Path(both["user_llama_cpp"]).is_relative_to(site / "llama_cpp")
    assert both["ours"] == both["plain"] == alone["ours"]          # lossless, and the user's copy still works
    assert both["lookup"] == both["plain"] and both["lookup_engine"]   # llama_cpp's own draft model object
    ours = [lib for lib in both["libs"] if Path(lib).name.startswith("libdflash_")]
    theirs = [lib for lib in both["libs"] if not Path(lib).name.startswith("libdflash_")]
    assert {Path(lib).name for lib in ours} >= {"libdflash_llama.so", "libdflash_ggml.so", "libdflash_ggml-base.so"}
    assert all(Path(lib).parent == site / "dflash_gguf" / "_llama_cpp" / "lib" for lib in ours), ours
    assert theirs and all(Path(lib).parent == site / "llama_cpp" / "lib" for lib in theirs), theirs

    # a front door whose extra is missing says which extra brings it
    p = _run(py, "-m", "dflash_gguf", "serve", "-m", "model.gguf")
    assert p.returncode == 2 and "pip install 'dflash-gguf[server]'" in p.stderr, p.stderr[-2000:]
