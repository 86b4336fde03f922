"""What CPU this is (Linux: /proc/cpuinfo): its model name and feature flags, read in one place."""
from __future__ import annotations

from pathlib import Path


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_flags() -> set[str]:
    """The CPU feature flags of this Linux machine (empty elsewhere)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str | None:
    """The CPU's model name (``AMD EPYC``, ``Intel(R) Xeon(R) ...``), or None where it is not known."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None
