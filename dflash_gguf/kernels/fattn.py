"""FLASH_ATTN_EXT on ggml's CPU backend, checked against an exact float64 attention, and timed.

The CPU flash-attention path every decode of fewer than 64 query rows takes (a one-token decode, a
block verify, several sequences' blocks in one batch) is patched twice in the series: patch 0016 sums
F16 V in fp32, patch 0020 steps over runs of masked KV cells 16 at a time. This module drives the op
through ggml's C API (ctypes, :class:`dflash_gguf.kernels.mulmat.Ggml`) with masks like a unified KV cache's
(several sequences' cells interleaved in runs; a query row may attend to its own sequence's cells
only) and compares every output with float64 softmax attention over exactly the allowed cells:

    python -m dflash_gguf.kernels.fattn                        # the check grid, JSON lines, exit 1 on a mismatch
    python -m dflash_gguf.kernels.fattn --time 20 --kv 2400 --seqs 8 --rows 8

``--time`` times one op with the interleaved mask beside the same allowed cells packed into one
sequence's span (what a cache with one stream per sequence gives each row), so ``--lib-dir`` A/Bs a
build's skipping of masked cells. Exit codes: 0 every case matches, 1 a case differs. A crash in a
kernel kills the process, so callers (tests) run this in a child process.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_gguf.kernels.mulmat import GGML_TYPES, Ggml, _InitParams, cpu_backend, default_lib_dir, parse_rows, report

log = logging.getLogger(__name__)

GGML_PREC_F32 = 10          # enum ggml_prec (ggml.h): what llama.cpp sets on every flash-attention node
NINF = np.float16(-np.inf)


class Attention:
    """One FLASH_ATTN_EXT graph (F32 Q, F16 K/V and mask) on the CPU backend; calling it sets the inputs,
    computes and returns the output as (rows, heads, DV)."""

    def __init__(self, ggml: Ggml, backend: int, d: int, rows: int, kv: int, heads: int, kv_heads: int,
                 scale: float):
        self.ggml, self.backend = ggml, backend
        self.shape = (d, rows, kv, heads, kv_heads)
        f32, f16 = GGML_TYPES["f32"], GGML_TYPES["f16"]
        self.ctx = ggml.ggml_init(_InitParams(ggml.ggml_tensor_overhead() * 8 + ggml.ggml_graph_overhead(), None, True))
        self.q = ggml.ggml_new_tensor_4d(self.ctx, f32, d, rows, heads, 1)
        self.k = ggml.ggml_new_tensor_4d(self.ctx, f16, d, kv, kv_heads, 1)
        self.v = ggml.ggml_new_tensor_4d(self.ctx, f16, d, kv, kv_heads, 1)
        self.mask = ggml.ggml_new_tensor_4d(self.ctx, f16, kv, rows, 1, 1)
        self.out = ggml.ggml_flash_attn_ext(self.ctx, self.q, self.k, self.v, self.mask, scale, 0.0, 0.0)
        ggml.ggml_flash_attn_ext_set_prec(self.out, GGML_PREC_F32)
        self.graph = ggml.ggml_new_graph(self.ctx)
        ggml.ggml_build_forward_expand(self.graph, self.out)
        self.buf = ggml.ggml_backend_alloc_ctx_tensors_from_buft(self.ctx, ggml.ggml_backend_cpu_buffer_type())
        if not self.buf:
            ggml.ggml_free(self.ctx)
            raise RuntimeError("ggml could not allocate the attention test buffers")

    def set(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> None:
        """q (heads, rows, d) f32; k, v (kv_heads, kv, d) f16; mask (rows, kv) f16."""
        for t, a in ((self.q, q.astype(np.float32)), (self.k, k.astype(np.float16)), (self.v, v.astype(np.float16)),
                     (self.mask, mask.astype(np.float16))):
            a = np.ascontiguousarray(a)
            assert self.ggml.ggml_nbytes(t) == a.nbytes, (self.ggml.ggml_nbytes(t), a.nbytes)
            self.ggml.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)

    def compute(self) -> None:
        status = self.ggml.ggml_backend_graph_compute(self.backend, self.graph)
        if status != 0:
            raise RuntimeError(f"ggml_backend_graph_compute returned {status}")

    def result(self) -> np.ndarray:
        d, rows, _, heads, _ = self.shape
        out = np.zeros((rows, heads, d), dtype=np.float32)
        self.ggml.ggml_backend_tensor_get(self.out, out.ctypes.data, 0, out.nbytes)
        return out

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """:meth:`set`, :meth:`compute`, :meth:`result`."""
        self.set(q, k, v, mask)
        self.compute()
        return self.result()

    def close(self) -> None:
        if self.buf:
            self.ggml.ggml_backend_buffer_free(self.buf)
            self.buf = None
            self.ggml.ggml_free(self.ctx)


def random_qkv(rng: np.random.Generator, d: int, rows: int, kv: int, heads: int, kv_heads: int):
    """Q (heads, rows, d) f32, K and V (kv_heads, kv, d) f16, standard normal."""
    return (rng.standard_normal((heads, rows, d)).astype(np.float32),
            rng.standard_normal((kv_heads, kv, d)).astype(np.float16),
            rng.standard_normal((kv_heads, kv, d)).astype(np.float16))


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """float64 softmax attention over the allowed cells, Q rounded to F16 as ggml's kernel does before its
    F16 K dot products: (rows, heads, d)."""
    heads, kv_heads = q.shape[0], k.shape[0]
    q16 = q.astype(np.float16).astype(np.float64)
    k64, v64 = k.astype(np.float64), v.astype(np.float64)
    allowed = np.isfinite(mask.astype(np.float32))
    out = np.zeros((q.shape[1], heads, v.shape[2]))
    for h in range(heads):
        hk = h // (heads // kv_heads)
        s = scale * (q16[h] @ k64[hk].T) + np.where(allowed, mask.astype(np.float64), 0.0)
        s = np.where(allowed, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        p = np.where(allowed, np.exp(s - m), 0.0)
        out[:, h] = (p @ v64[hk]) / p.sum(axis=1, keepdims=True)
    return out


def interleaved_mask(rows: int, kv: int, seqs: int, rng: np.random.Generator, max_run: int = 40) -> np.ndarray:
    """A unified cache's mask: the kv cells belong to ``seqs`` sequences in runs of 1..max_run cells (as
    rollbacks and joins leave them), row i is sequence i % seqs and may attend to that sequence's
    cells only. Each row keeps at least one cell."""
    owner = np.empty(kv, dtype=np.int64)
    c = 0
    while c < kv:
        n = int(rng.integers(1, max_run + 1))
        owner[c:c + n] = rng.integers(0, seqs)
        c += n
    mask = np.full((rows, kv), NINF, dtype=np.float16)
    for i in range(rows):
        mine = owner == i % seqs
        if not mine.any():
            mine[rng.integers(0, kv)] = True
        mask[i, mine] = 0
    return mask


def edge_masks(rows: int, kv: int) -> list[tuple[str, np.ndarray]]:
    """Masks at the edges of the 16-cell step: along each row, allowed cells between masked runs of
    lengths 0, 1, 2, ... 40 (shifted by one per row, from cell 0 and from cell 5); allowed cells at the
    last cell and just before it; a lone cell 16 from the end after a long run."""
    out = []
    for start in (0, 5):
        m = np.full((rows, kv), NINF, dtype=np.float16)
        for i in range(rows):
            c, j = start, 0
            while c < kv:
                m[i, c] = 0                             # an allowed cell, then a masked run
                c += 1 + (i + j) % 41
                j += 1
        out.append((f"runs-from-{start}", m))
    m = np.full((rows, kv), NINF, dtype=np.float16)
    for i in range(rows):
        m[i, kv - 1 - (i % 3)] = 0                      # the last cell, or one or two before it
    out.append(("last-cells", m))
    m = np.full((rows, kv), NINF, dtype=np.float16)
    m[:, kv - 17] = 0                                   # a lone cell 16 from the end
    m[:, 16] = 0
    out.append(("lone-cells", m))
    return out


@dataclass
class CaseResult:
    mask: str
    rows: int
    kv: int
    heads: int
    threads: int
    err: float          # max |ggml - exact| / max |exact|
    ok: bool


TOLERANCE = 2e-5   # both sides use the same F16 Q, K and V; ggml sums in fp32 (measured up to 1e-6 of the largest
                   # output). A cell skipped or attended to in error moves an output by the size of the values
                   # (order 0.1-1 with these few allowed cells)


def run_grid(ggml: Ggml, rows_list: list[int], kvs: list[int], threads: int, seed: int = 0, d: int = 64,
             heads: int = 4, kv_heads: int = 2):
    """One CaseResult per (rows, kv, mask): the one-chunk path (several rows) and, at one row and 512
    cells or more, the split-KV path (each thread a span of the cells)."""
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(d)
    with cpu_backend(ggml, threads) as backend:
        for rows in rows_list:
            for kv in kvs:
                att = Attention(ggml, backend, d, rows, kv, heads, kv_heads, scale)
                try:
                    masks = [("interleaved-8", interleaved_mask(rows, kv, 8, rng)),
                             ("interleaved-3", interleaved_mask(rows, kv, 3, rng, max_run=70)),
                             *edge_masks(rows, kv)]
                    for name, mask in masks:
                        q, k, v = random_qkv(rng, d, rows, kv, heads, kv_heads)
                        y = att(q, k, v, mask)
                        ref = exact(q, k, v, mask, scale)
                        err = float(np.abs(y - ref).max() / (np.abs(ref).max() or 1.0))
                        yield CaseResult(name, rows, kv, heads, threads, err,
                                         bool(np.isfinite(y).all()) and err <= TOLERANCE)
                    if rows >= 2:
                        yield same_bits(ggml, backend, att, rng, d, rows, kv, heads, kv_heads, scale, threads)
                finally:
                    att.close()


def same_bits(ggml: Ggml, backend: int, att: Attention, rng: np.random.Generator, d: int, rows: int, kv: int,
              heads: int, kv_heads: int, scale: float, threads: int) -> CaseResult:
    """A block of one sequence's rows among others' cells (the one-chunk path) gives the same bits as with
    its cells alone in a cache: the cells attended to, and the order of the sums, are the same. ``err``:
    the largest difference (0 to pass)."""
    mask = interleaved_mask(rows, kv, 8, rng)
    mask[:] = mask[0]                                    # every row is sequence 0's
    mine = np.flatnonzero(np.isfinite(mask[0].astype(np.float32)))
    q, k, v = random_qkv(rng, d, rows, kv, heads, kv_heads)
    y = att(q, k, v, mask)
    alone = Attention(ggml, backend, d, rows, len(mine), heads, kv_heads, scale)
    try:
        diff = float(np.abs(alone(q, k[:, mine], v[:, mine], np.zeros((rows, len(mine)), dtype=np.float16)) - y).max())
    finally:
        alone.close()
    return CaseResult("same-bits-as-alone", rows, kv, heads, threads, diff, diff == 0.0)


def time_masks(ggml: Ggml, rows: int, kv: int, seqs: int, threads: int, repeats: int, d: int = 128,
               heads: int = 16, kv_heads: int = 8, seed: int = 0) -> dict:
    """Fastest of ``repeats`` computes of one op (Qwen3-0.6B's attention shape by default): the cells of
    ``seqs`` sequences interleaved in a ``kv``-cell cache, and each row's cells packed into a cache of
    kv / seqs cells (one stream per sequence). Milliseconds."""
    rng = np.random.default_rng(seed)
    out = {}
    with cpu_backend(ggml, threads) as backend:
        for name, n_kv in (("interleaved", kv), ("packed", kv // seqs)):
            att = Attention(ggml, backend, d, rows, n_kv, heads, kv_heads, 1.0 / np.sqrt(d))
            try:
                mask = interleaved_mask(rows, n_kv, seqs, rng) if name == "interleaved" else \
                    np.zeros((rows, n_kv), dtype=np.float16)
                att.set(*random_qkv(rng, d, rows, n_kv, heads, kv_heads), mask)
                ts = []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    att.compute()
                    ts.append(time.perf_counter() - t0)
                out[name] = round(min(ts[1:]) * 1e3, 4)
            finally:
                att.close()
    return {"rows": rows, "kv": kv, "seqs": seqs, "threads": threads, "ms": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib-dir", type=Path, default=None, help="directory with libggml*.so (default: the llama_cpp wheel's)")
    ap.add_argument("--rows", default="1,2,8,17", help="query rows per op, e.g. 1,2,8 or 1-17")
    ap.add_argument("--kv", default="96,600,1000", help="KV cells (comma list; one row at 512 or more: split-KV path)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time", type=int, default=0, metavar="REPEATS",
                    help="instead of checking, time the interleaved mask beside packed cells (fastest of REPEATS)")
    ap.add_argument("--seqs", type=int, default=8, help="--time: sequences in the cache")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ggml = Ggml(args.lib_dir or default_lib_dir())
    rows, kvs = parse_rows(args.rows), parse_rows(args.kv)
    if args.time:
        for r in rows:
            for kv in kvs:
                print(json.dumps(time_masks(ggml, r, kv, args.seqs, args.threads, args.time, seed=args.seed)), flush=True)
        return 0
    return report(run_grid(ggml, rows, kvs, args.threads, args.seed))


if __name__ == "__main__":
    sys.exit(main())
