"""Large ggml buffers ask for transparent huge pages (patches/0024).

``ggml_aligned_malloc`` (what the CPU backend's buffers come from: repacked weights, KV caches, compute
buffers) advises MADV_HUGEPAGE over the 2 MiB-aligned interior of an allocation of 32 MiB and more; the
kernel marks such a mapping (smaps ``VmFlags: hg``) and, where THP is enabled ("madvise" or "always"),
backs its touched memory with huge pages. Smaller allocations and any under ``GGML_HUGE_PAGES=0`` are
left alone; every one goes back to the system on ``ggml_aligned_free``. The allocations run in a fresh
child process: in a long one, a small buffer can land in heap memory that numpy (which advises huge
pages for its own large arrays) or an earlier buffer left advised."""
from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import pytest

import kernel_child

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MIB = 1 << 20

pytestmark = pytest.mark.skipif(not THP.exists(), reason="this kernel has no transparent huge pages "
                                "(/sys/kernel/mm/transparent_hugepage): MADV_HUGEPAGE cannot be given")


def _mapping(addr: int) -> dict | None:
    """The smaps entry of the mapping holding ``addr``: its bounds, flags and AnonHugePages (kB), or None."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if found is not None:
                return found
            if lo <= addr < hi:
                found = {"start": lo, "end": hi}
        elif found is not None and line.startswith("AnonHugePages:"):
            found["huge_kb"] = int(head[1])
        elif found is not None and line.startswith("VmFlags:"):
            found["flags"] = head[1:]
    return found


def _child(cases: list[tuple[int, str | None]]) -> None:
    """Allocate, touch, look at and free each (size, GGML_HUGE_PAGES) in turn; one JSON line each."""
    import llama_cpp.llama_cpp as low
    ggml = ctypes.CDLL(str(Path(low._lib._name).parent / "libggml-base.so"))   # the one llama_cpp loaded
    ggml.ggml_aligned_malloc.restype = ctypes.c_void_p
    ggml.ggml_aligned_malloc.argtypes = [ctypes.c_size_t]
    ggml.ggml_aligned_free.restype = None
    ggml.ggml_aligned_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    for size, env in cases:
        if env is None:
            os.environ.pop("GGML_HUGE_PAGES", None)
        else:
            os.environ["GGML_HUGE_PAGES"] = env
        ptr = ggml.ggml_aligned_malloc(size)
        ctypes.memset(ptr, 1, size)              # touched: the kernel has to back all of it now
        mid = ptr + size // 2
        seen = _mapping(mid)
        ggml.ggml_aligned_free(ptr, size)
        print(json.dumps({"size": size, "env": env, "ptr": ptr, "mapping": seen, "after": _mapping(mid)}), flush=True)


def _run(cases: list[tuple[int, str | None]]) -> list[dict]:
    p = kernel_child.python([__file__, json.dumps(cases)], {"GGML_HUGE_PAGES": None}, timeout=120)
    assert p.returncode == 0, kernel_child.died(p)
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def test_a_large_buffer_asks_for_huge_pages_and_is_freed():
    size = 96 * MIB + 12345
    (r,) = _run([(size, None)])
    m, ptr = r["mapping"], r["ptr"]
    assert ptr and ptr % 64 == 0, r
    assert m is not None and "hg" in m["flags"], f"no MADV_HUGEPAGE on a {size}-byte buffer: {m}"
    # the advice covers the buffer's 2 MiB-aligned interior and nothing outside the buffer
    assert m["start"] >= ptr - 2 * MIB and m["end"] <= ptr + size + 2 * MIB, m
    mode = THP.read_text()
    if "[never]" not in mode:
        # THP on ("madvise" or "always"): most of 96 touched MiB on 2 MiB pages
        assert m["huge_kb"] >= 48 * 1024, f"THP {mode.strip()!r}: only {m['huge_kb']} kB on huge pages"
    after = r["after"]
    assert after is None or "hg" not in after["flags"], f"the buffer's mapping outlived its free: {after}"


def test_small_buffers_and_huge_pages_off_are_left_alone():
    for r in _run([(31 * MIB, None), (96 * MIB, "0")]):
        m = r["mapping"]
        assert m is not None and "hg" not in m["flags"], \
            f"{r['size'] >> 20} MiB with GGML_HUGE_PAGES={r['env']}: the mapping was advised: {m}"
        assert m["huge_kb"] == 0 or "[always]" in THP.read_text(), m


if __name__ == "__main__":
    _child([tuple(c) for c in json.loads(sys.argv[1])])
