"""Shared fixtures: tiny synthetic GGUF pairs, made once and cached by the content of tiny.py."""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tiny  # noqa: E402

from dflash_gguf import paths  # noqa: E402
from dflash_gguf.logs import set_log_handler  # noqa: E402

set_log_handler()


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
def models() -> TinyModels:
    return TinyModels(_models_root())


@pytest.fixture(scope="session", autouse=True)
def fresh_calibration(tmp_path_factory):
    """The gate's cost priors (decoding.calibration) measured in this run, not read from the user's cache:
    a prior cached on a busier machine (or by another build) cannot steer what the tests see."""
    from dflash_gguf.decoding import calibration

    root = tmp_path_factory.mktemp("calibration")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(calibration, "cache_file", lambda key: root / f"{key}.json")
        yield root
