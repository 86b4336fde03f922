"""Native handles: a loaded GGUF model and a llama.cpp context, as small owner objects.

Loading and context creation go through llama-cpp-python's ctypes API (it owns the struct
layouts); the hot loop uses the cffi handles of :mod:`dflash_gguf.native._bindings`.
"""
from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_gguf.native.llama import llama_low as C
import numpy as np

from dflash_gguf.native import _bindings as B
from dflash_gguf.errors import (DFlashError, InvalidArgumentError, ModelFileError, PairMismatchError,
                               RollbackError, UnsupportedError)
from dflash_gguf.native.gguf_check import check_gguf

log = logging.getLogger("dflash_gguf.native.engine")

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def end_of_generation_ids(vocab, n_vocab: int) -> list[int]:
    """The end-of-generation token ids of a llama.cpp vocabulary of ``n_vocab`` tokens (``llama_vocab_is_eog``)."""
    from dflash_gguf.native.llama import llama_cpp

    return [t for t in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]


class _Handle:
    """Owner of one native pointer: ``close()`` (or leaving a ``with`` block) frees it once.

    A borrowed handle (``_owned = False``) only forgets the pointer; its owner frees it. A handle
    that others use (a model under its contexts, a target context whose tensors a drafter context
    borrows) is freed after the last of them: closing it earlier only marks it. So the order in which
    they are closed, or collected (a reference cycle's objects are finalized in no set order, as a
    script's globals are at exit), never frees memory that is still in use.
    """
    ptr = None
    _owned = False
    _users = 0          # open handles that use this one's memory
    _held: tuple = ()   # the handles this one uses
    _closing = False    # close() came while users were open: freed with the last of them

    def _free(self, ptr) -> None:
        raise NotImplementedError

    def _hold(self, *handles: "_Handle | None") -> None:
        self._held = tuple(h for h in handles if h is not None)
        for h in self._held:
            h._users += 1

    def close(self) -> None:
        if self.ptr and self._owned:
            if self._users:
                self._closing = True
                return
            self._free(self.ptr)
        self.ptr = None
        held, self._held = self._held, ()
        for h in held:
            h._users -= 1
            if h._closing and not h._users:
                h.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Model(_Handle):
    """A GGUF model loaded by llama.cpp. Free it with :meth:`close` (or a ``with`` block)."""

    rpc_check = None   # with layers on rpc-servers: raises RpcLostError after a decode if one was lost

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, use_mmap: bool = True,
                 devices: int | None = None, rpc_check=None):
        self.path = Path(path)
        self.rpc_check = rpc_check
        if not self.path.is_file():
            raise FileNotFoundError(f"model file not found: {self.path}")
        check_gguf(self.path)   # llama.cpp aborts the process on some inconsistent files: refuse first
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        if not use_mmap:   # this llama_cpp has load_mode, not use_mmap (a ctypes struct takes unknown names silently)
            params.load_mode = C.LLAMA_LOAD_MODE_NONE
        if devices:   # a NULL-terminated ggml_backend_dev_t array (dflash_gguf.native.rpc.RpcDevices.address)
            params.devices = devices
        ptr = C.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise ModelFileError(f"llama.cpp could not load {self.path}: not a valid GGUF, truncated, or an "
                              "architecture this build does not know (see the llama.cpp log above)")
        self._owned = True
        self._describe(ptr)

    @classmethod
    def borrow(cls, ptr, path: str | os.PathLike, rpc_check=None) -> "Model":
        """A view of a ``llama_model`` owned elsewhere (e.g. by ``llama_cpp.Llama``); never freed here."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self._owned = False
        self.rpc_check = rpc_check
        self._describe(ptr)
        return self

    def _describe(self, ptr) -> None:
        self.ptr = ptr
        self.cptr = B.as_model(ptr)
        self.vocab = C.llama_model_get_vocab(ptr)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.n_embd = C.llama_model_n_embd(ptr)
        self.n_layer = C.llama_model_n_layer(ptr)
        self.n_ctx_train = C.llama_model_n_ctx_train(ptr)
        self.arch = self.meta("general.architecture") or "?"
        self.is_recurrent = bool(C.llama_model_is_recurrent(ptr))
        self.is_hybrid = bool(C.llama_model_is_hybrid(ptr))
        eog = end_of_generation_ids(self.vocab, self.n_vocab) if self.n_vocab < 300_000 else []
        self.eog_tokens = np.array(eog, dtype=np.int32)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(512)
        n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n >= len(buf):   # e.g. a chat template: the full length is returned
            buf = ctypes.create_string_buffer(n + 1)
            n = C.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace") if n >= 0 else None

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        n_max = len(text) + 16
        buf = (ctypes.c_int32 * n_max)()
        n = C.llama_tokenize(self.vocab, text, len(text), buf, n_max, add_bos, special)
        if n < 0:
            buf = (ctypes.c_int32 * -n)()
            n = C.llama_tokenize(self.vocab, text, len(text), buf, -n, add_bos, special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens, special: bool = False) -> bytes:
        return b"".join(self.token_bytes(int(t), special) for t in tokens)

    def _free(self, ptr) -> None:
        C.llama_model_free(ptr)


KIND_NAMES = {1: "dflash", 2: "dflash2", 3: "dspark"}


@dataclass
class DrafterInfo:
    """What a drafter GGUF says about itself (``llama_dflash_get_drafter_info``)."""
    kind: str
    block_size: int
    mask_token: int
    selector_top_k: int
    causal: bool
    target_layers: list[int]
    n_embd: int
    n_vocab: int
    draft_max: int = 0          # most tokens one block drafts: block_size - 1, or block_size anchor-first
    sample_from_anchor: bool = False   # block row 0 (the pending token) predicts the first draft (DSpark,
                                       # DeepSpec's DFlash drafters)
    has_confidence: bool = False       # DSpark: a confidence head scores each drafted token
    sliding_window: int = 0     # the drafter's trained attention window (GGUF dflash.attention.sliding_window), 0: none

    @classmethod
    def from_c(cls, info) -> "DrafterInfo":
        return cls(kind=KIND_NAMES.get(info.kind, "?"), block_size=info.block_size, mask_token=info.mask_token,
                   selector_top_k=info.selector_top_k, causal=bool(info.causal),
                   target_layers=[info.target_layers[i] for i in range(info.n_target_layers)],
                   n_embd=info.n_embd, n_vocab=info.n_vocab, draft_max=info.draft_max,
                   sample_from_anchor=bool(info.sample_from_anchor), has_confidence=bool(info.has_confidence))

    @classmethod
    def read(cls, drafter: Model) -> "DrafterInfo":
        info = B.ffi.new("struct llama_dflash_drafter_info *")
        B.check(B.lib.llama_dflash_get_drafter_info(drafter.cptr, info), f"reading drafter {drafter.path.name}")
        out = cls.from_c(info)
        swa = drafter.meta(f"{drafter.arch}.attention.sliding_window")
        out.sliding_window = int(swa) if swa and swa.strip().isdigit() else 0
        return out


def clamp_n_draft(info: DrafterInfo, want: int | None, *, n_batch: int, n_ubatch: int, hybrid: bool = False) -> int:
    """Tokens drafted per step: ``want`` (None: the most) within the block and the batch sizes.

    ``n_batch`` and ``n_ubatch`` bound the verify: the pending token and the drafted ones in one ubatch.
    Hybrid targets roll back by recurrent snapshots, for which llama.cpp needs n_ubatch >= n_rs_seq + 2.
    """
    if want is not None and want < 0:
        raise InvalidArgumentError(f"n_draft must be >= 0 (0: no drafting), got {want}")
    limit = max(0, min(info.draft_max, n_batch - 1, n_ubatch - (2 if hybrid else 1)))
    n = limit if want is None else min(want, limit)
    if want is not None and want > limit:
        log.info("n_draft %d clamped to %d (block size %d)", want, limit, info.block_size)
    return n


def check_compatible(target: Model, drafter: Model) -> None:
    """Refuse a target/drafter pair llama.cpp cannot run together (before any context exists)."""
    info = DrafterInfo.read(drafter)
    fix = "convert the drafter against this target: python -m dflash_gguf.convert TARGET_DIR DRAFTER_DIR -o OUT"
    tappable = B.tappable_archs()
    if target.arch not in tappable:
        raise UnsupportedError(f"target architecture {target.arch!r} exposes no layer taps; "
                               f"supported: {', '.join(tappable)}")
    if info.n_embd != target.n_embd:
        raise PairMismatchError(f"drafter {drafter.path.name} has hidden size {info.n_embd}, target "
                                f"{target.path.name} has {target.n_embd}; {fix}")
    if info.n_vocab != target.n_vocab:
        raise PairMismatchError(f"drafter vocabulary ({info.n_vocab}) differs from the target's ({target.n_vocab}); {fix}")
    taps = info.target_layers
    if any(not 0 <= t < target.n_layer for t in taps):
        raise PairMismatchError(f"drafter taps target layers {taps} but the target has {target.n_layer} layers "
                                f"(GGUF tap ids are HF target_layer_ids + 1, at most n_layer - 1); {fix}")


# a drafter's cache by default: 1024 cells = window + one block (window 1008 at block 16); chosen from
# the window sweep and the memory table in BENCHMARKS.md section 7
DEFAULT_DRAFT_CACHE = 1024


@dataclass
class ContextOptions:
    n_ctx: int = 2048                 # positions per sequence
    n_seq: int = 1                    # sequences (slots) served: n_seq x n_ctx cells in one unified KV cache
    shared: bool = False              # ... or n_ctx cells in all, any sequence up to n_ctx positions as the others
                                      # leave room (llama-server's -np: the server's slots; the decoder's caller
                                      # admits by free cells, dflash_gguf.decoding.scheduling)
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | None = None
    n_rs_seq: int = 0                 # recurrent-state snapshots for rollback (hybrid targets)
    flash_attn: bool | None = None    # None: llama.cpp's auto (flash attention on the CPU)
    n_outputs_max: int = 0            # logits rows one ubatch may output (0: n_batch)
    draft_window: int | None = None   # drafter contexts only: None = the drafter's sliding window if it has one,
                                      # else DEFAULT_DRAFT_CACHE - block; 0 = whole context


def drafter_options(opts: ContextOptions, info: DrafterInfo) -> ContextOptions:
    """A drafter context sized to what the drafter needs, from the target context's options.

    The drafter decodes one block at a time (``block_size`` rows, every one a logits row: its graph
    computes the LM head for all rows) and keeps the features of at most ``draft_window`` context
    positions, so its cache holds window + block cells and its batches, compute buffers and output
    rows are sized to the block. With the target's sizes instead (n_ubatch 512, n_ctx) llama.cpp
    reserves a 512-row LM-head buffer (300 MiB at a 151,936-token vocabulary) and a cache as long as
    the target's.
    """
    window = opts.draft_window
    if window is None:   # the drafter's own sliding window when its GGUF has one (what it was trained with)
        window = info.sliding_window or max(DEFAULT_DRAFT_CACHE - info.block_size, 1)
    if window < 0:
        raise InvalidArgumentError(f"draft_window must be >= 0 (0: the whole context), got {window}")
    n_ctx = opts.n_ctx
    if window and window + info.block_size < n_ctx:
        n_ctx = window + info.block_size
    else:
        window = 0
    b = info.block_size * opts.n_seq   # one batch holds a block of every sequence
    return replace(opts, n_ctx=n_ctx, n_batch=b, n_ubatch=b, n_outputs_max=b, n_rs_seq=0, draft_window=window,
                   shared=False)   # its window per sequence: the target's cells are what the sequences share


class Context(_Handle):
    """A llama.cpp context on a :class:`Model`: ``opts.n_seq`` sequences (ids 0..n_seq-1) of up to
    ``opts.n_ctx`` positions each. Several sequences share one unified KV cache: llama.cpp then splits
    a batch into ubatches in order, so rows keep their batch order for the taps and the outputs."""

    def __init__(self, model: Model, opts: ContextOptions | None = None, *, other: "Context | None" = None):
        opts = opts or ContextOptions()
        self.window = 0   # drafters: context positions kept in the cache (0: all)
        if model.arch == "dflash":
            opts = drafter_options(opts, DrafterInfo.read(model))
            self.window = opts.draft_window
        self.model = model
        self.opts = opts
        if opts.n_seq < 1:
            raise InvalidArgumentError(f"n_seq must be >= 1, got {opts.n_seq}")
        p = C.llama_context_default_params()
        p.n_ctx = opts.n_ctx if opts.shared else opts.n_ctx * opts.n_seq
        p.n_batch = opts.n_batch
        p.n_ubatch = min(opts.n_ubatch, opts.n_batch)
        p.n_seq_max = opts.n_seq
        p.kv_unified = opts.n_seq > 1
        p.n_outputs_max = opts.n_outputs_max
        threads = opts.n_threads or max(1, os.cpu_count() or 1)
        p.n_threads = threads
        p.n_threads_batch = threads
        p.n_rs_seq = opts.n_rs_seq
        p.no_perf = True
        # several sequences may take flash attention: its CPU kernel sums in fp32 (patch 0016; an fp16
        # sum's rounding follows how a sequence's KV cells interleave with the others' and flipped a
        # near-tie argmax between a sequence alone and in a batch)
        if opts.flash_attn is not None:
            p.flash_attn_type = 1 if opts.flash_attn else 0
        if other is not None:
            if model.arch == "dflash":
                check_compatible(other.model, model)   # llama.cpp aborts on a mismatched pair: refuse first
            p.ctx_other = other.ptr
        ptr = C.llama_init_from_model(model.ptr, p)
        if not ptr:
            raise DFlashError(f"llama.cpp could not create a context for {model.path.name} "
                              f"(n_ctx={opts.n_ctx}); lower n_ctx or free memory")
        self._owned = True
        self._describe(ptr)
        self._hold(model, other)   # both stay alive, and are freed after this context (a drafter borrows the target's tensors)

    @classmethod
    def borrow(cls, model: Model, ptr, opts: ContextOptions | None = None) -> "Context":
        """A view of a ``llama_context`` owned elsewhere (e.g. by ``llama_cpp.Llama``); never freed here."""
        self = cls.__new__(cls)
        self.model, self.opts, self._owned = model, opts or ContextOptions(), False
        self.window = 0
        self._describe(ptr)
        return self

    def _describe(self, ptr) -> None:
        self.ptr = ptr
        self.cptr = B.as_ctx(ptr)
        self.mem = B.lib.llama_get_memory(self.cptr)
        self.n_seq = max(int(self.opts.n_seq), 1)
        self.n_cells = B.lib.llama_n_ctx(self.cptr)               # KV cells, all sequences together
        self.n_ctx = self.n_cells if self.opts.shared else self.n_cells // self.n_seq   # positions per sequence
        self.n_batch = B.lib.llama_n_batch(self.cptr)
        self.n_ubatch = B.lib.llama_n_ubatch(self.cptr)
        self.n_rs_seq = B.lib.llama_n_rs_seq(self.cptr)
        if self.n_rs_seq and self.n_ubatch <= self.n_rs_seq + 1:
            # llama.cpp keeps the last n_rs_seq + 1 tokens in one ubatch and aborts the process
            # (GGML_ASSERT in split_equal) on the first decode otherwise: refuse here instead
            self.close()
            raise InvalidArgumentError(f"n_rs_seq={self.n_rs_seq} needs n_ubatch >= {self.n_rs_seq + 2} "
                                       f"(and n_batch as large), got n_ubatch={self.n_ubatch}")

    # memory ---------------------------------------------------------------
    def clear(self) -> None:
        B.lib.llama_memory_clear(self.mem, True)

    def clear_seq(self, seq: int) -> None:
        """Forget everything of sequence ``seq``."""
        B.lib.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def pos_min(self, seq: int = 0) -> int:
        return B.lib.llama_memory_seq_pos_min(self.mem, seq)

    def pos_max(self, seq: int = 0) -> int:
        return B.lib.llama_memory_seq_pos_max(self.mem, seq)

    def forget_before(self, pos: int, seq: int = 0) -> bool:
        """Drop positions [0, pos) (a drafter's window sliding on)."""
        return bool(B.lib.llama_memory_seq_rm(self.mem, seq, 0, pos)) if pos > 0 else True

    def truncate(self, n_keep: int, seq: int = 0) -> bool:
        """Keep positions [0, n_keep); False if the memory refuses a partial removal."""
        return bool(B.lib.llama_memory_seq_rm(self.mem, seq, n_keep, -1))

    def save_seq(self, seq: int = 0) -> bytes:
        """Host copy of the sequence's recurrent part (attention KV excluded)."""
        n = B.lib.llama_state_seq_get_size_ext(self.cptr, seq, PARTIAL_ONLY)
        buf = B.ffi.new("uint8_t[]", n)
        got = B.lib.llama_state_seq_get_data_ext(self.cptr, buf, n, seq, PARTIAL_ONLY)
        if got != n:
            raise RollbackError(f"saving the recurrent state failed ({got} of {n} bytes)")
        return bytes(B.ffi.buffer(buf, n))

    def restore_seq(self, data: bytes, seq: int = 0) -> None:
        got = B.lib.llama_state_seq_set_data_ext(self.cptr, data, len(data), seq, PARTIAL_ONLY)
        if got != len(data):
            raise RollbackError("restoring the recurrent state failed")

    # decoding -------------------------------------------------------------
    def decode(self, tokens: np.ndarray, pos0: int, out_row0: int | None = None,
               argmax: np.ndarray | None = None, seq: int = 0) -> None:
        """Decode ``tokens`` at ``pos0``; outputs from ``out_row0`` (default: none unless argmax)."""
        n = len(tokens)
        if out_row0 is None:
            out_row0 = n if argmax is None else n - len(argmax)
        ap = B.ffi.NULL if argmax is None else B.ffi.from_buffer("llama_token[]", argmax)
        rc = B.lib.llama_dflash_decode(self.cptr, seq, pos0, B.ffi.from_buffer("llama_token[]", tokens),
                                       n, out_row0, ap)
        if self.model.rpc_check is not None:
            self.model.rpc_check()   # a lost rpc-server first: it explains a failed decode
        B.check(rc, f"decode of {n} tokens at position {pos0}")

    def decode_seqs(self, seqs: np.ndarray, pos0: np.ndarray, n_tokens: np.ndarray, tokens: np.ndarray,
                    argmax: np.ndarray | None = None, out_row0: np.ndarray | None = None) -> None:
        """One decode of several sequences' rows (``tokens``: each sequence's ``n_tokens[i]`` tokens at
        ``pos0[i]..``, concatenated; int32 arrays); each sequence's rows from ``out_row0[i]`` on (default:
        all) are outputs, ``argmax`` gets each output row's argmax id, in row order. Rows keep that order
        for :meth:`logits_row` and the taps."""
        i32 = "int32_t[]"
        out0 = np.zeros(len(seqs), dtype=np.int32) if out_row0 is None else np.ascontiguousarray(out_row0, dtype=np.int32)
        ap = B.ffi.NULL if argmax is None else B.ffi.from_buffer("llama_token[]", argmax)
        rc = B.lib.llama_dflash_decode_seqs(self.cptr, len(seqs), B.ffi.from_buffer(i32, seqs),
                                            B.ffi.from_buffer(i32, pos0), B.ffi.from_buffer(i32, n_tokens),
                                            B.ffi.from_buffer(i32, out0), B.ffi.from_buffer("llama_token[]", tokens), ap)
        if self.model.rpc_check is not None:
            self.model.rpc_check()   # a lost rpc-server first: it explains a failed decode
        B.check(rc, f"decode of {len(tokens)} rows of {len(seqs)} sequences")

    def logits_row(self, i: int) -> np.ndarray:
        """Zero-copy view of batch row ``i``'s logits from the last decode."""
        p = B.lib.llama_get_logits_ith(self.cptr, i)
        if p == B.ffi.NULL:
            raise DFlashError(f"no logits for batch row {i}")
        return np.frombuffer(B.ffi.buffer(p, 4 * self.model.n_vocab), dtype=np.float32)

    def _free(self, ptr) -> None:
        C.llama_free(ptr)
