"""ggml's CPU flash attention with masks like a unified KV cache's (patches 0016 and 0020).

FLASH_ATTN_EXT (F16 K/V, fp32 sums) is checked against float64 attention over exactly the allowed
cells, for several sequences' cells interleaved in runs and for masked runs of every length around
the 16-cell step of patch 0020 (to the last cell, a lone cell after a long run); one query row (the
split-KV path at 512 cells and more, each thread a span of the cells) and several (the one-chunk
path); one and two threads; and on the AVX2 build variant. A block of one sequence among other
sequences' cells must give the same bits as with its cells alone. Runs in child processes (a fault
in the kernel fails the test, not the run)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernel_child

from dflash_gguf import paths


def _grid(extra: list[str], lib_dir: Path | None = None) -> list[dict]:
    args = ["-m", "dflash_gguf.kernels.fattn", *extra] + (["--lib-dir", str(lib_dir)] if lib_dir is not None else [])
    p = kernel_child.python(args, {})
    cases = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode not in (0, 1):
        pytest.fail(f"FLASH_ATTN_EXT: {kernel_child.died(p)}\nlast case that finished: {cases[-1] if cases else None}")
    return cases


def _bad(cases: list[dict]) -> list[str]:
    return [f"{c['mask']} rows={c['rows']} kv={c['kv']} threads={c['threads']}: error {c['err']:.3g}"
            for c in cases if not c["ok"]]


# per (rows, kv): 2 interleaved masks and 4 edge masks, and the same-bits case where rows >= 2
def _expected(rows: list[int], kvs: list[int]) -> int:
    return sum(6 + (r >= 2) for r in rows for _ in kvs)


@pytest.mark.parametrize("threads", [1, 2])
def test_masked_runs_interleaved_sequences_and_edges(threads):
    rows, kvs = [1, 2, 8, 17], [96, 600, 1000]
    cases = _grid(["--rows", ",".join(map(str, rows)), "--kv", ",".join(map(str, kvs)), "--threads", str(threads)])
    assert len(cases) == _expected(rows, kvs)
    assert not _bad(cases), "\n".join(_bad(cases))
    assert sum(c["mask"] == "same-bits-as-alone" for c in cases) == 3 * len(kvs)


def test_avx2_variant():
    d = paths.ggml_variant_dir("avx2")
    if d is None:
        pytest.skip("no avx2 build variant in the build cache (`make test` builds it: "
                    "python -m dflash_gguf.build --ggml-variant avx2)")
    cases = _grid(["--rows", "1,8", "--kv", "600"], d)
    assert len(cases) == _expected([1, 8], [600]) and not _bad(cases), "\n".join(_bad(cases))
