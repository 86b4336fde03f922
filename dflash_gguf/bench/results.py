"""Benchmark records: one mode's results over all trials, machine facts, versions, peak memory."""
from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf.kernels.cpu import cpu_flags, cpu_model
from dflash_gguf.decoding.stats import GenerationStats


# --------------------------------------------------------------------------- machine facts
def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def machine_info() -> dict:
    cpu = cpu_model() or platform.processor() or platform.machine()
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "amx_bf16", "fma", "f16c"})
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu, "cpu_flags": flags,
            "cores": os.cpu_count(), "mem_gb": round(mem, 1) if mem else None, "gpu": None,
            "python": platform.python_version()}


def versions() -> dict:
    v = {"dflash_gguf": None, "llama_cpp_python": None, "patch_series": None}
    from dflash_gguf import __version__

    v["dflash_gguf"] = __version__
    try:
        from dflash_gguf.native.llama import llama_cpp
        v["llama_cpp_python"] = getattr(llama_cpp, "__version__", None)
    except Exception:  # noqa: BLE001
        pass
    try:
        from dflash_gguf import paths
        v["patch_series"] = paths.patch_series_hash()[:16]
    except Exception:  # noqa: BLE001
        pass
    return v


# --------------------------------------------------------------------------- our columns
@dataclass
class ModeResult:
    """One mode over all trials. A trial runs every prompt once."""
    name: str
    trial_tps: list[float] = field(default_factory=list)     # tokens / decode seconds, per trial
    tokens: dict[str, list[int]] = field(default_factory=dict)  # per prompt, from the first trial
    texts: dict[str, str] = field(default_factory=dict)
    raw: dict[str, bytes] = field(default_factory=dict)        # pieces as upstream prints them (special=True)
    stats: GenerationStats = field(default_factory=GenerationStats)   # counts over all trials
    phase: dict[str, float] = field(default_factory=dict)    # seconds, summed over all trials
    per_prompt: dict[str, dict] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        tps = self.trial_tps
        d = {"tokens_per_second": {"median": _r(statistics.median(tps)) if tps else None,
                                   "min": _r(min(tps)) if tps else None, "max": _r(max(tps)) if tps else None,
                                   "trials": [_r(x) for x in tps]},
             "n_generated": self.stats.n_generated}
        st = self.stats
        if st.steps:
            d["acceptance_length"] = _r(st.tau, 4)
            d["accept_rate"] = _r(st.accept_rate, 4)
            d["steps"], d["drafted"], d["accepted"] = st.steps, st.drafted, st.accepted
            d["per_position_acceptance"] = [_r(a / n, 4) if n else None
                                            for a, n in zip(st.accepted_per_pos, st.drafted_per_pos)]
        if self.phase:
            tot = sum(self.phase.values()) or 1.0
            d["time_s"] = {k: _r(v, 4) for k, v in self.phase.items()}
            d["time_share"] = {k: _r(v / tot, 4) for k, v in self.phase.items()}
        d["per_prompt"] = self.per_prompt
        d.update(self.extra)
        return d


def _r(x, nd: int = 2):
    return None if x is None else round(float(x), nd)


def _add_stats(res: ModeResult, st: GenerationStats) -> None:
    res.stats.merge(st)
    for k, v in st.phase_times().items():
        res.phase[k] = res.phase.get(k, 0.0) + v
