"""Memory settings: the low-memory preset of :class:`dflash_gguf.Llama` (README "Memory").

The drafter's own sizing (block-sized batches, window + block cache) is in
:func:`dflash_gguf.native.engine.drafter_options`; the rollback memory cap in :mod:`dflash_gguf.decoding.rollback`.
"""
from __future__ import annotations

import logging

log = logging.getLogger("dflash_gguf.native.memory")

# Llama(..., low_memory=True): what it sets unless given (measured in BENCHMARKS.md section 7)
LOW_MEMORY = {
    "use_mmap": False,     # repacked CPU weights + the mapped file would both be resident
    "n_batch": 256,
    "n_ubatch": 64,        # compute buffers scale with the ubatch (llama.cpp reserves n_ubatch logits rows)
    "flash_attn": True,    # no n_ctx x n_ubatch x n_head attention-score matrix
    "type_k": 8,           # GGML_TYPE_Q8_0: the KV cache at about half its f16 size (needs flash_attn)
    "type_v": 8,
}
LOW_MEMORY_DRAFT_CACHE = 512     # drafter cache cells: window = 512 - block (496 at block 16)


def low_memory_settings(header) -> dict:
    """:data:`LOW_MEMORY` for a target (its GGUF header): a Q8_0 KV cache needs head sizes that are
    multiples of Q8_0's 32-value block (llama.cpp refuses the context otherwise), else f16 stays."""
    arch = header.arch
    n_embd, n_head = header.get(f"{arch}.embedding_length"), header.get(f"{arch}.attention.head_count")
    per_head = n_embd // n_head if isinstance(n_embd, int) and isinstance(n_head, int) and n_head else 0
    k = header.get(f"{arch}.attention.key_length", per_head)
    v = header.get(f"{arch}.attention.value_length", per_head)
    out = dict(LOW_MEMORY)
    if not (isinstance(k, int) and isinstance(v, int) and k and v and k % 32 == 0 and v % 32 == 0):
        log.info("low_memory: head sizes %s/%s are not multiples of 32, the KV cache stays f16", k, v)
        del out["type_k"], out["type_v"]
    return out


def release_free_heap() -> int:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``); returns 1 if any were.

    Loading a drafter leaves freed loader memory in the heap (its GGUF metadata, and since
    ``patches/0012`` its vocabulary's text -> id map, about 10 MiB at 151,936 tokens), which glibc
    keeps resident until the same process allocates it again. Called once after the drafter is
    loaded; a no-op (0) where the C library has no ``malloc_trim`` (macOS, musl, Android).
    """
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return 0
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return int(trim(0))
