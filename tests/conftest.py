"""Shared fixtures: tiny synthetic GGUF pairs, made once and cached by the content of tiny.py.

Nothing here imports the native build at import time, so the files marked ``pure`` run without it:
``pytest --pure`` collects only those files and makes the native modules (and the torch stack) fail
to import, which proves they stay pure.
"""
from __future__ import annotations

import hashlib
import importlib.abc
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tiny  # noqa: E402

from dflash_gguf import paths  # noqa: E402

# what a pure test must not need: the patched llama.cpp (through llama_cpp and our cffi bindings) and
# the conversion stack the tiny models are made with
NATIVE = ("llama_cpp", "dflash_gguf.native._bindings", "cffi", "_cffi_backend", "torch", "transformers")
PURE_MARK = re.compile(r"^pytestmark\s*=.*\bpytest\.mark\.pure\b", re.M)


class _NativeBlocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in NATIVE):
            raise ModuleNotFoundError(f"{name} is blocked under --pure: a pure test must not need it", name=name)
        return None


def pytest_addoption(parser):
    parser.addoption("--pure", action="store_true",
                     help="run only the files marked pure, with the native modules unimportable")


def pytest_configure(config):
    if not config.getoption("pure"):
        from dflash_gguf.native.logs import set_log_handler
        set_log_handler()
        return
    loaded = sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in NATIVE))
    if loaded:      # a plugin imported one first: blocking now would prove nothing
        raise pytest.UsageError(f"--pure: already imported before the tests: {', '.join(loaded)}")
    sys.meta_path.insert(0, _NativeBlocker())


def pytest_ignore_collect(collection_path, config):
    if (config.getoption("pure") and collection_path.suffix == ".py" and collection_path.name.startswith("test_")
            and not PURE_MARK.search(collection_path.read_text())):
        return True
    return None


def _models_root() -> Path:
    key = hashlib.sha256(Path(tiny.__file__).read_bytes() + paths.patch_series_hash().encode()).hexdigest()[:16]
    root = Path(os.environ.get("DFLASH_GGUF_TEST_MODELS") or paths.cache_dir() / "test-models") / key
    root.mkdir(parents=True, exist_ok=True)
    return root


@dataclass
class Pair:
    target: Path          # target GGUF
    drafter: Path         # drafter GGUF
    target_hf: Path
    drafter_hf: Path


class TinyModels:
    def __init__(self, root: Path):
        self.root = root
        self.tok = tiny.make_tokenizer(root / "tokenizer").parent

    def target(self, arch: str = "qwen3") -> tuple[Path, Path]:
        hf = tiny.make_target(self.root / f"hf-{arch}", self.tok, arch)
        return hf, tiny.upstream_convert(hf, self.root / f"{arch}.gguf")

    def pair(self, arch: str = "qwen3", kind: str = "dflash", block_size: int = 8, **kw) -> Pair:
        t_hf, t_gguf = self.target(arch)
        tag = f"{arch}-{kind}-b{block_size}" + "".join(f"-{k}{v}" for k, v in sorted(kw.items()))
        d_hf = tiny.make_drafter(self.root / f"hf-{tag}", t_hf, kind=kind, block_size=block_size, **kw)
        d_gguf = tiny.upstream_convert(d_hf, self.root / f"{tag}.gguf", target_dir=t_hf)
        return Pair(t_gguf, d_gguf, t_hf, d_hf)


@pytest.fixture(scope="session")
def models(pytestconfig) -> TinyModels:
    if pytestconfig.getoption("pure"):
        pytest.fail("a pure test asked for the tiny models (they need torch and the native build)")
    return TinyModels(_models_root())


@pytest.fixture(scope="session", autouse=True)
def fresh_calibration(tmp_path_factory, pytestconfig):
    """The gate's cost priors (decoding.calibration) measured in this run, not read from the user's cache:
    a prior cached on a busier machine (or by another build) cannot steer what the tests see. Under
    --pure there is no decoder to calibrate (and calibration needs the native build)."""
    if pytestconfig.getoption("pure"):
        yield None
        return
    from dflash_gguf.decoding import calibration

    root = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "cache_file", lambda key: root / f"{key}.json")
        yield root
