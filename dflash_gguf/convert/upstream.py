"""Run the pinned llama.cpp tree's own ``convert_hf_to_gguf.py`` in a subprocess.

The subprocess keeps torch and transformers out of this process, and uses the tree's
vendored (DFlash-aware) gguf-py. Its output is streamed to logging at DEBUG.
"""
from __future__ import annotations

import collections
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

from dflash_gguf import paths
from dflash_gguf.convert.errors import ConvertError

log = logging.getLogger("dflash_gguf.convert")

OUTTYPES = ("f32", "f16", "bf16", "q8_0")     # what the upstream converter writes itself
_DEPS = ("torch", "transformers", "numpy", "sentencepiece")


def converter_script() -> Path:
    """``convert_hf_to_gguf.py`` of the patched tree the build kept."""
    try:
        tree = paths.upstream_tree()
    except FileNotFoundError as e:
        raise ConvertError(str(e)) from None
    script = tree / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ConvertError(f"{script} is missing from the upstream tree: run `python -m dflash_gguf.build` again")
    return script


def check_dependencies() -> None:
    """Fail early (before any work) when the converter's Python dependencies are missing."""
    missing = [m for m in _DEPS if importlib.util.find_spec(m) is None]
    if missing:
        raise ConvertError(f"the converter needs {', '.join(missing)}: install them with "
                           "`pip install 'dflash-gguf[convert]'`")


def run_converter(hf_dir: Path, out_file: Path, outtype: str, *, target_dir: Path | None = None,
                  threads: int | None = None, what: str = "model") -> None:
    """Convert ``hf_dir`` to ``out_file`` (``--target-model-dir`` for a drafter); raise on failure."""
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    cmd = [sys.executable, "-u", str(converter_script()), str(hf_dir), "--outfile", str(out_file),
           "--outtype", outtype]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NO_LOCAL_GGUF", None)          # the tree's gguf-py knows DFlash, PyPI's does not
    if threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[k] = str(threads)
    log.debug("running %s", " ".join(cmd))
    tail: collections.deque[str] = collections.deque(maxlen=25)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, errors="replace", env=env) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                tail.append(line)
                log.debug("[convert %s] %s", what, line)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if rc != 0 or not out_file.is_file():
        detail = "\n".join(tail)
        hint = ""
        if "No space left on device" in detail:
            hint = " The disk is full: free space next to the output directory."
        raise ConvertError(f"upstream convert_hf_to_gguf.py failed on the {what} {hf_dir} (exit {rc}).{hint}\n"
                           f"Last lines of its output:\n{detail}")
