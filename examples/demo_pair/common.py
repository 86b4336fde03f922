"""Constants, logging, the budget clock, stage markers and the helpers the stages share."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

MASK_PIECE = "<|mask|>"
REPO = Path(__file__).resolve().parents[2]   # examples/demo_pair/common.py -> the repository root
EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "dist-packages"}

# prompts for the eyeball check and the verification (the demo's built-in prompt is the first)
CHECK_PROMPTS = [
    "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "    def __repr__(self):\n",
    "    for key, value in sorted(items.items()):\n",
    "def _check_type(obj, expected):\n    if not isinstance(obj, expected):\n",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


CLOCK = {"kind": "cpu", "threads": 2}


def clock() -> float:
    """Seconds on the budget clock. ``cpu``: this process's CPU time / threads, so a budget buys the
    same training on a busy machine as on an idle one (wall time stretches instead); ``wall``: wall time."""
    if CLOCK["kind"] == "wall":
        return time.time()
    return time.process_time() / CLOCK["threads"]


def done(work: Path, stage: str) -> bool:
    return (work / f".done-{stage}").exists()


def mark(work: Path, stage: str, info: dict | None = None) -> None:
    (work / f".done-{stage}").write_text(json.dumps(info or {}, indent=2))



def lr_at(frac: float, step: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def save_ckpt(obj, path: Path) -> None:
    """Atomic checkpoint (a run stopped mid-write keeps the previous one)."""
    import torch

    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    tmp.replace(path)
