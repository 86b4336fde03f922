"""``dflash_gguf.Llama``: a drop-in ``llama_cpp.Llama`` with DFlash speculative decoding inside.

Every generation entry point of llama-cpp-python (``__call__``, ``create_completion``,
``create_chat_completion``, streaming or not) funnels into ``Llama.generate``. This class overrides
that one generator: when the request can be served exactly by the DFlash engine it runs
:class:`dflash_gguf.decoding.DFlashDecoder` on the Llama's *own* target context; otherwise it falls back
to ``llama_cpp.Llama.generate`` (see :meth:`Llama.dflash_unsupported`). Stop strings, ``max_tokens``,
UTF-8-safe streaming and the response shapes stay llama_cpp's code.

State contract (one llama.cpp context, two views of it):

* ``self.input_ids[:self.n_tokens]`` (llama_cpp's view) always describes the target KV. After a
  DFlash generation it is set to ``decoder.cache``; ``_requires_eval`` is raised so the plain path
  replays one token before sampling.
* ``decoder.cache`` describes the drafter's KV (target features per position). Before each DFlash
  generation both views are reconciled: only their common prefix is kept in both caches, since the
  drafter has no features for tokens that the plain path (or ``eval``/``load_state``/``reset``)
  put into the target.
"""
from __future__ import annotations

import contextlib
import ctypes
import inspect
import logging
import os
import threading
import weakref
from pathlib import Path
from typing import Iterator, Sequence

from dflash_gguf.native.llama import llama_cpp
from dflash_gguf.native.llama import _internals as internals
from dflash_gguf.native.llama import llama_chat_format

from dflash_gguf.requests.calls import CallState, Request, check_grammar, check_template_kwargs, extended_signature as _signature
from dflash_gguf.decoding.constraints import Constraints, request_constraints
from dflash_gguf.constructors import PairConstructors
from dflash_gguf.native.engine import Context, ContextOptions, DrafterInfo, Model
from dflash_gguf.pair import pair_files
from dflash_gguf.errors import BusyError, ModelFileError, ModelNotFoundError
from dflash_gguf.native.gguf_check import check_gguf
from dflash_gguf.native.memory import LOW_MEMORY_DRAFT_CACHE, low_memory_settings
from dflash_gguf.requests.defaults import COMPLETION as _D
from dflash_gguf.requests.responses import dflash_object
from dflash_gguf.requests.served import Call, plain_reason
from dflash_gguf.native.rpc import RpcTarget
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.decoding.decoder import DFlashDecoder, common_prefix_len
from dflash_gguf.runtime import DraftSettings, Runtime, snapshots
from dflash_gguf.decoding.ngram import NgramOptions
from dflash_gguf.decoding.stats import GenerationStats
from dflash_gguf.requests.stopping import stop_token_ids

log = logging.getLogger("dflash_gguf.api")

_DEFAULT_SEED = llama_cpp.LLAMA_DEFAULT_SEED
_COMPLETION_SIG = inspect.signature(llama_cpp.Llama._create_completion)
_CHAT_SIG = inspect.signature(llama_cpp.Llama.create_chat_completion)


# --------------------------------------------------------------------------- Llama

def _is_prompt_lookup(draft_model) -> bool:
    """llama_cpp's ``LlamaPromptLookupDecoding``: this package's copy of llama-cpp-python's, or the user's own
    ``llama_cpp``'s (installed beside this package's copy: another class of the same name and settings)."""
    if isinstance(draft_model, llama_cpp.llama_speculative.LlamaPromptLookupDecoding):
        return True
    cls = type(draft_model)
    return (cls.__name__ == "LlamaPromptLookupDecoding" and cls.__module__.endswith("llama_cpp.llama_speculative")
            and hasattr(draft_model, "max_ngram_size") and hasattr(draft_model, "num_pred_tokens"))

class Llama(PairConstructors, RpcTarget, llama_cpp.Llama):
    """``llama_cpp.Llama`` plus a DFlash/DFlash2 drafter.

    Extra arguments (everything else is ``llama_cpp.Llama``'s):
        draft_model_path: the drafter GGUF (converted against this target). Without it this
            class behaves exactly like ``llama_cpp.Llama``.
        draft_n_max: tokens drafted per block (default and maximum: the drafter's block size - 1).
        draft_adaptive: the speed gate (default on): draft per step as many tokens as currently
            pays (at most draft_n_max, down to plain decoding), from step costs measured on this
            machine and the running acceptance (see dflash_gguf.decoding.gate), for greedy requests and for
            sampled ones without a seed of the user's (``seed=`` per call, ``Llama(seed=...)`` or
            ``set_seed()`` keep fixed drafting, so that the text repeats). False: draft
            draft_n_max tokens every step.
        dflash: default for every call; each call can override it with ``dflash=True/False``.
        draft_n_gpu_layers: layers of the drafter to offload (default: as the target).
        draft_use_mmap: map the drafter file instead of reading it into memory (default False: a
            drafter is small, and a mapped file that is truncated or rewritten in place kills the
            process with SIGBUS; the target follows llama_cpp's ``use_mmap``, default True).
        draft_window: context positions the drafter attends to (default None: the drafter's own sliding
            window when its GGUF has one, else 1024 minus the block size: a 1024-cell cache; 0: the whole
            context). Its cache holds window + block positions whatever n_ctx; output is exact either
            way, only acceptance far into a long context can change (BENCHMARKS.md section 7).
        rollback_memory_mb: hybrid (recurrent) targets only: the most memory rollback may take. By
            default llama.cpp keeps one snapshot of the recurrent state per drafted token (fastest);
            when those copies exceed the cap, one host checkpoint with a replay of the committed
            rows is used instead; a cap below one copy is an error.
        low_memory: the low-memory preset (``dflash_gguf.native.memory.LOW_MEMORY``, README "Memory"): weights read
            into memory rather than mapped (with llama.cpp's repacked CPU weights a mapped file is
            resident twice), smaller batches, flash attention, a Q8_0 KV cache, a 512-cell drafter
            cache (drafter window 512 - block).
            Arguments given explicitly win over the preset.
        rpc_servers, draft_rpc_servers: ``["host:port", ...]`` of llama.cpp ``rpc-server`` processes for the
            target's layers (with ``tensor_split``), or the drafter's (default: local); see dflash_gguf.native.rpc.
        n_seq_max: sequences the context holds in one unified KV cache of ``n_ctx`` cells (default 1): the
            server's slots borrow it (:meth:`serve_sequences`, which also remakes a context made with 1).
        prompt_lookup: also draft by prompt lookup (dflash_gguf.decoding.ngram): copy up to
            ``prompt_lookup_num_pred_tokens`` tokens that followed the last ``prompt_lookup_max_ngram_size``
            tokens' latest earlier occurrence in the prompt and the text so far. Without a drafter it is the
            only proposer (any GGUF llama.cpp decodes); beside one, a step copies where that is expected to
            give more tokens per second than the drafter's block (draft_adaptive: through the speed gate).
            llama_cpp's ``draft_model=LlamaPromptLookupDecoding(max_ngram_size=..., num_pred_tokens=...)``
            turns it on with those settings (served by the engine, not llama_cpp's Python loop).

    After each generation ``self.last_dflash_stats`` holds its :class:`GenerationStats` (``None``
    after a plain fallback) and responses carry the same numbers as a top-level ``"dflash"`` object
    (and a stream's last chunk its ``usage``). Without a drafter and without prompt lookup responses
    are llama_cpp's, key for key.
    """

    last_usage: dict | None = None   # the last completion's usage (streams without a drafter carry none)

    def __init__(self, model_path: str, *, draft_model_path: str | os.PathLike | None = None,
                 draft_n_max: int | None = None, draft_adaptive: bool = True, dflash: bool = True,
                 draft_n_gpu_layers: int | None = None, draft_use_mmap: bool = False,
                 draft_window: int | None = None, low_memory: bool = False,
                 rollback_memory_mb: float | None = None, rpc_servers=None, draft_rpc_servers=None,
                 prompt_lookup: bool = False, prompt_lookup_num_pred_tokens: int = 10,
                 prompt_lookup_max_ngram_size: int = 2, n_seq_max: int = 1, **kwargs):
        # checked before anything loads (the runtime takes them as DraftSettings)
        DraftSettings(n_max=draft_n_max, window=draft_window, rollback_memory_mb=rollback_memory_mb)
        self._runtime: Runtime | None = None
        self._decoder: DFlashDecoder | None = None
        self._call = CallState()
        # a seed the user chose (here, per call or with set_seed) makes sampled requests repeatable;
        # llama_cpp's own per-call seeds (derived from the previous one) do not
        self._seed_given = kwargs.get("seed") not in (None, 0, _DEFAULT_SEED)   # llama_cpp: seed or default
        self.last_dflash_stats: GenerationStats | None = None
        self._interrupt = threading.Event()
        self.dflash = dflash
        self.draft_model_path = str(draft_model_path) if draft_model_path else None
        self.draft_n_max = draft_n_max
        self.draft_adaptive = draft_adaptive
        self.draft_n_gpu_layers = draft_n_gpu_layers
        self.draft_use_mmap = draft_use_mmap
        self.rollback_memory_mb = rollback_memory_mb
        # llama_cpp's prompt lookup draft model: the engine's, with its settings (llama_cpp keeps the object
        # for the generations the engine leaves to its plain path)
        lookup = kwargs.get("draft_model")
        self._lookup_draft_model = _is_prompt_lookup(lookup)
        if self._lookup_draft_model:
            prompt_lookup = True
            prompt_lookup_num_pred_tokens = lookup.num_pred_tokens
            prompt_lookup_max_ngram_size = lookup.max_ngram_size
        self.prompt_lookup = prompt_lookup
        self.prompt_lookup_num_pred_tokens = prompt_lookup_num_pred_tokens
        self.prompt_lookup_max_ngram_size = prompt_lookup_max_ngram_size
        self._ngram = NgramOptions(max_ngram=prompt_lookup_max_ngram_size,
                                   n_pred=prompt_lookup_num_pred_tokens) if prompt_lookup else None
        self._owner_lock = threading.RLock()
        self._owner: tuple[int, weakref.ref] | None = None   # (thread, generation) in flight
        # llama.cpp aborts the process on some inconsistent files: check both before it loads either
        headers = {}
        for path, role in ((model_path, "target"), (self.draft_model_path, "drafter")):
            if path and not Path(path).is_file():
                raise ModelNotFoundError(f"{role} model file not found: {path}")
            if path:
                headers[role] = check_gguf(path, role=role)
        self.low_memory = low_memory
        if low_memory:
            for key, value in low_memory_settings(headers["target"]).items():
                kwargs.setdefault(key, value)
        self.draft_window = draft_window   # None with low_memory: 512 - block (the drafter's, see _open_drafter)
        self._rpc_setup(rpc_servers, draft_rpc_servers, kwargs)   # probed before anything loads
        try:
            super().__init__(model_path, **kwargs)
        except ValueError as e:
            if str(e).startswith("Failed to load model"):
                raise ModelFileError(f"llama.cpp could not load {model_path} (see the llama.cpp log)") from e
            raise
        if n_seq_max > 1 and not self.context_params.embeddings:
            # the server's slots: one unified KV cache of n_ctx cells for n_seq_max sequences (serve_sequences),
            # made before the engine opens on it (llama_cpp makes its context before a subclass can say so)
            self.context_params.n_seq_max, self.context_params.kv_unified = n_seq_max, True
            self._recreate_context(n_rs_seq=self.context_params.n_rs_seq)
        if self.draft_model_path:
            self._stack.callback(self._close_dflash)   # LIFO: freed before the target context
            self._open_drafter()
        elif self._ngram is not None:
            self._stack.callback(self._close_dflash)
            self._open_lookup()
        elif kwargs.get("draft_model") is None:
            log.info("no draft_model_path: %s decodes plainly", Path(model_path).name)

    def draft_settings(self) -> DraftSettings:
        """How this Llama drafts, as every runtime of it (the server's slots too) takes it."""
        window = self.draft_window
        if window is None and self.low_memory and getattr(self, "_draft_model", None) is not None:
            window = max(LOW_MEMORY_DRAFT_CACHE - DrafterInfo.read(self._draft_model).block_size, 1)
        return DraftSettings(n_max=self.draft_n_max, adaptive=self.draft_adaptive, window=window,
                             rollback_memory_mb=self.rollback_memory_mb, ngram=self._ngram)

    def _open_drafter(self) -> None:
        self._draft_model = Model(self.draft_model_path, use_mmap=self.draft_use_mmap, **self._draft_devices())
        draft = self.draft_settings()
        flash = self.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        opts = ContextOptions(n_ctx=self._n_ctx, n_batch=self.n_batch, n_ubatch=self.context_params.n_ubatch,
                              n_threads=self.n_threads, flash_attn=flash)

        def borrowed() -> Context:
            model = Model.borrow(self._model.model, self.model_path, self._rpc_hook)
            return Context.borrow(model, self._ctx.ctx, opts)
        n_rs_seq = snapshots(borrowed().model, self._draft_model, opts, draft, measure_on=borrowed())
        if n_rs_seq:
            # llama_cpp made its context before this class could ask for the snapshots: made again with them
            self._recreate_context(n_rs_seq=n_rs_seq)
            self._stack.callback(self._close_dflash)   # again: the drafter must go before the new context
        self._runtime = Runtime(borrowed(), self._draft_model, draft)
        self._decoder = self._runtime.decoder
        self._draft_ctx = self._runtime.drafter
        self.n_tokens = 0   # the decoder cleared the target memory
        log.info("DFlash ready: %s drafter %s, block %d, %d drafted per step, rollback %s",
                 self._decoder.info.kind, Path(self.draft_model_path).name, self._decoder.info.block_size,
                 self._decoder.n_draft, self._decoder.rollback)

    def _open_lookup(self) -> None:
        """Prompt lookup with no drafter: the engine on the target's own context alone."""
        model = Model.borrow(self._model.model, self.model_path, self._rpc_hook)
        opts = ContextOptions(n_ctx=self._n_ctx, n_batch=self.n_batch, n_ubatch=self.context_params.n_ubatch,
                              n_threads=self.n_threads)
        self._runtime = Runtime(Context.borrow(model, self._ctx.ctx, opts), None, self.draft_settings())
        self._decoder = self._runtime.decoder
        self.n_tokens = 0   # the decoder cleared the target memory
        log.info("prompt lookup ready: up to %d tokens copied per step (n-grams of up to %d), rollback %s",
                 self._decoder.n_copy, self._ngram.max_ngram, self._decoder.rollback)

    def serve_sequences(self, n_seq: int) -> bool:
        """Make this Llama's own context hold ``n_seq`` sequences in one unified KV cache of its ``n_ctx``
        cells (llama-server's ``-np``: memory is what one context costs, any sequence may use every cell as the
        others leave room), for the server's slots to borrow (:mod:`dflash_gguf.server.slots`) instead of
        a context of their own beside it. The context is made again (empty) with those parameters, the
        DFlash engine on it too; generation through this Llama is as before (sequence 0, positions up to
        ``n_ctx``). False where it cannot (a context llama_cpp made for embeddings, a LoRA adapter: the
        caller keeps contexts of its own). Whoever then decodes other sequences on it owns the cache while
        they run: llama_cpp's own path removes positions of every sequence (``kv_cache_seq_rm(-1, ...)``)."""
        cp = self.context_params
        if n_seq <= 1 or (cp.n_seq_max >= n_seq and cp.kv_unified):
            return cp.n_seq_max >= n_seq
        if self.context_params.embeddings or self._lora_adapter is not None:
            return False
        self._check_free()
        had_engine = self._runtime is not None
        self._close_dflash()               # the drafter's context borrows the target's: freed first
        cp.n_seq_max, cp.kv_unified = n_seq, True
        self._recreate_context(n_rs_seq=cp.n_rs_seq)
        if had_engine:
            self._stack.callback(self._close_dflash)   # the engine goes before the new context
            if self.draft_model_path:
                self._open_drafter()
            else:
                self._open_lookup()
        return True

    def _recreate_context(self, n_rs_seq: int) -> None:
        """Rebuild the target context with ``n_rs_seq`` recurrent snapshots (hybrid targets).

        ``llama_cpp.Llama.__init__`` creates its context before a subclass can set ``n_rs_seq``,
        so the first context (still empty) is freed and made again with the same parameters.
        """
        self._ctx.close()
        self.context_params.n_rs_seq = n_rs_seq
        self._ctx = self._stack.enter_context(contextlib.closing(
            internals.LlamaContext(model=self._model, params=self.context_params, verbose=self.verbose)))
        if self._lora_adapter is not None:
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(self._lora_adapter)
            scales = (ctypes.c_float * 1)(self.lora_scale)
            if llama_cpp.llama_set_adapters_lora(self._ctx.ctx, adapters, 1, scales):
                raise RuntimeError(f"Failed to set LoRA adapter from lora path: {self.lora_path}")
        self.n_tokens = 0
        self._requires_eval = True

    def _close_dflash(self) -> None:
        self._finish_live()
        self._decoder = self._draft_ctx = None
        for name in ("_runtime", "_draft_model"):   # the drafter's context before its model
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
                setattr(self, name, None)

    def __getstate__(self):
        state = super().__getstate__()
        state.update(draft_model_path=self.draft_model_path, draft_n_max=self.draft_n_max, dflash=self.dflash,
                     draft_n_gpu_layers=self.draft_n_gpu_layers, draft_adaptive=self.draft_adaptive,
                     draft_use_mmap=self.draft_use_mmap, draft_window=self.draft_window,
                     rollback_memory_mb=self.rollback_memory_mb, low_memory=self.low_memory,
                     prompt_lookup=self.prompt_lookup and not self._lookup_draft_model,
                     prompt_lookup_num_pred_tokens=self.prompt_lookup_num_pred_tokens,
                     prompt_lookup_max_ngram_size=self.prompt_lookup_max_ngram_size)
        return state

    # ------------------------------------------------------------------ introspection
    @property
    def decoder(self) -> DFlashDecoder | None:
        """The DFlash engine on this Llama's context (None without a drafter)."""
        return self._decoder

    @property
    def dflash_info(self) -> dict | None:
        """The drafter's kind, block size, drafted tokens per step and rollback kind."""
        d = self._decoder
        if d is None:
            return None
        if d.info is None:    # prompt lookup alone
            return {"kind": "ngram", "block_size": d.n_copy + 1, "n_draft": d.n_copy, "rollback": d.rollback,
                    "drafter": None, "enabled": self.dflash}
        return {"kind": d.info.kind, "block_size": d.info.block_size, "n_draft": d.n_draft,
                "rollback": d.rollback, "drafter": self.draft_model_path, "enabled": self.dflash,
                **({"n_copy": d.n_copy} if d.n_copy else {})}

    # ------------------------------------------------------------------ per-call options
    def interrupt(self) -> None:
        """Stop the generation in flight at its next token (thread-safe; DFlash and plain paths alike).

        The call returns (or its stream ends) with what was generated so far, with finish_reason
        "stop" as if the model had ended there, and the caches are rolled back to the consumed tokens.
        The flag is cleared when the next call starts (``create_completion``, ``create_chat_completion``,
        ``__call__``, or a direct ``generate``).
        """
        self._interrupt.set()

    @contextlib.contextmanager
    def _call_options(self, dflash: bool | None):
        self._interrupt.clear()
        prev = self._call.dflash
        if dflash is not None:
            self._call.dflash = dflash
        try:
            yield
        finally:
            self._call.dflash = prev

    def create_completion(self, *args, dflash: bool | None = None, **kwargs):
        """``llama_cpp.Llama.create_completion`` plus ``dflash=`` (None: the instance default)."""
        with self._call_options(dflash):
            return super().create_completion(*args, **kwargs)

    def __call__(self, *args, dflash: bool | None = None, **kwargs):
        with self._call_options(dflash):
            return super().__call__(*args, **kwargs)

    def set_seed(self, seed: int):
        """``llama_cpp.Llama.set_seed``; called by the user it makes later sampled requests repeatable
        (fixed drafting), called by llama_cpp's own completion body (a per-call seed) it does not."""
        super().set_seed(seed)
        if self._call.body_sets_seed:
            self._call.body_sets_seed = False     # llama_cpp's completion body: its per-call (or derived) seed
        else:
            self._seed_given = True

    def create_chat_completion(self, *args, dflash: bool | None = None,
                               chat_template_kwargs: dict | None = None, **kwargs):
        """``llama_cpp.Llama.create_chat_completion`` plus ``dflash=`` and ``chat_template_kwargs=``.

        ``chat_template_kwargs`` become variables of the chat template (Jinja templates from the
        GGUF), e.g. ``{"enable_thinking": False}`` for Qwen3-class thinking models: thinking text
        is much harder to draft, so turning it off raises acceptance a lot. Built-in formats
        (``chat_format="chatml"``, ...) ignore them.
        """
        with self._call_options(dflash):
            self._call.created = None
            if chat_template_kwargs:
                result = self._chat_with_template_kwargs(args, kwargs, chat_template_kwargs)
            else:
                result = super().create_chat_completion(*args, **kwargs)
            req, self._call.created = self._call.created, None
        if isinstance(result, dict):
            if self._decoder is not None:   # no engine (no drafter, no prompt lookup): llama_cpp's answer as it is
                result["dflash"] = self._stats_dict(req)
            return result
        return self._chat_stream(result, req)

    def _chat_with_template_kwargs(self, args, kwargs, extra: dict):
        bound = _CHAT_SIG.bind(self, *args, **kwargs)
        bound.apply_defaults()
        call = {k: v for k, v in bound.arguments.items() if k != "self"}
        check_template_kwargs(extra)
        handler = (self.chat_handler or self._chat_handlers.get(self.chat_format)
                   or llama_chat_format.get_chat_completion_handler(self.chat_format))
        return handler(llama=self, **call, **extra)

    def _chat_stream(self, chunks, req: Request | None):
        try:
            for chunk in chunks:
                if self._decoder is not None and chunk.get("choices") and \
                        chunk["choices"][0].get("finish_reason") is not None:
                    chunk["dflash"] = self._stats_dict(req)
                    if req is not None:
                        chunk.setdefault("usage", req.usage())
                yield chunk
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()

    def _create_completion(self, *args, **kwargs):
        bound = _COMPLETION_SIG.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        req = Request(max_tokens=a["max_tokens"], logprobs=a["logprobs"], dflash=self._call.dflash,
                      seeded=a["seed"] is not None or self._seed_given)
        self._call.created = req
        return self._completion_chunks(req, super()._create_completion(*args, **kwargs))

    def _completion_chunks(self, req: Request, chunks):
        # Set right before llama_cpp's body runs: it calls self.generate() within this same resume.
        self._call.handoff = req
        # llama_cpp's body calls set_seed once before its first chunk (the call's seed, or one derived from
        # the instance's): that call is not the user's and must not make later requests repeatable
        self._call.body_sets_seed = True
        try:
            for chunk in chunks:
                self._call.body_sets_seed = False
                finish = chunk["choices"][0]["finish_reason"]
                if finish is not None:
                    self.last_usage = req.usage()   # streams carry none without a drafter (as llama_cpp's)
                if finish is not None and self._decoder is not None:
                    if req.stats is not None and req.stats.finish is None:
                        req.stats.finish = finish      # the consumer stopped the decoder (stop string, budget)
                    chunk["dflash"] = self._stats_dict(req)
                    chunk.setdefault("usage", req.usage())   # streams: what the response would report
                yield chunk
        finally:
            if self._call.handoff is req:
                self._call.handoff = None
            chunks.close()

    def _stats_dict(self, req: Request | None) -> dict | None:
        """The response's ``dflash`` object (with a drafter): the statistics, or why plain decoding
        served it."""
        if req is None or self._decoder is None:
            return None
        return dflash_object(req.stats if req.served else None, req.reason or "plain decoding")

    # ------------------------------------------------------------------ generation
    def dflash_unsupported(self, *, sampling: SamplingParams, reset: bool = True,
                           stopping_criteria=None, request: Request | None = None) -> str | None:
        """Why a generation must use the plain path (None when DFlash serves it exactly):
        :func:`dflash_gguf.requests.served.plain_reason`."""
        want = self.dflash if request is None or request.dflash is None else request.dflash
        return plain_reason(Call(
            sampling=sampling, drafter=self._decoder is not None, want=bool(want), default=bool(self.dflash),
            draft_model=self.draft_model is not None and not self._lookup_draft_model, reset=reset,
            stopping_criteria=stopping_criteria))

    def _check_free(self) -> None:
        """Raise BusyError when another thread has a generation in flight on this Llama."""
        with self._owner_lock:
            owner = self._owner
            if owner is None or owner[0] == threading.get_ident():
                return
            gen = owner[1]()
            busy = gen is not None and gen.gi_frame is not None   # alive and not finished
            del gen   # no strong reference may outlive this frame (a traceback would keep it alive)
            if busy:
                raise BusyError("this Llama is generating in another thread; llama.cpp contexts are not "
                                "thread-safe: use one Llama per thread or serialize the calls")

    def generate(self, *args, **kwargs):
        """Token generator (``llama_cpp.Llama.generate``'s signature), through DFlash when possible.

        One generation at a time: a call from a second thread while one is in flight raises
        :class:`~dflash_gguf.errors.BusyError` (the caches are never touched by two threads).
        """
        with self._owner_lock:
            self._check_free()
            guarded = self._guarded(self._generate(*args, **kwargs))
            self._owner = (threading.get_ident(), weakref.ref(guarded))
            return guarded

    @staticmethod
    def _guarded(gen):
        return (yield from gen)

    def _generate(self, tokens: Sequence[int], top_k: int = _D["top_k"], top_p: float = _D["top_p"],
                  min_p: float = _D["min_p"], typical_p: float = _D["typical_p"], temp: float = _D["temperature"],
                  repeat_penalty: float = _D["repeat_penalty"], reset: bool = True,
                  frequency_penalty: float = _D["frequency_penalty"], presence_penalty: float = _D["presence_penalty"],
                  tfs_z: float = 1.0, mirostat_mode: int = _D["mirostat_mode"], mirostat_tau: float = _D["mirostat_tau"],
                  mirostat_eta: float = _D["mirostat_eta"], penalize_nl: bool = True, logits_processor=None,
                  stopping_criteria=None, grammar=None):
        """Token generator (``llama_cpp.Llama.generate``'s signature), through DFlash when possible.

        Yields exactly the tokens the plain path would (greedy: the same ids; sampling: the same
        distribution). Values sent into the generator are ignored (llama_cpp sends none).
        """
        req, self._call.handoff = self._call.handoff, None
        if req is None:
            self._interrupt.clear()     # a direct call (create_* clear the flag when they start)
        self._finish_live()
        if grammar is not None:
            check_grammar(self, grammar)
        seed = None if self._seed in (None, _DEFAULT_SEED) else int(self._seed)
        sp = SamplingParams(temperature=float(temp), top_k=int(top_k), top_p=float(top_p), min_p=float(min_p),
                            typical_p=float(typical_p), repeat_penalty=float(repeat_penalty),
                            frequency_penalty=float(frequency_penalty), presence_penalty=float(presence_penalty),
                            penalty_last_n=int(self.last_n_tokens_size), mirostat_mode=int(mirostat_mode),
                            mirostat_tau=float(mirostat_tau), mirostat_eta=float(mirostat_eta), seed=seed,
                            repeatable=req.seeded if req is not None else self._seed_given)
        why = self.dflash_unsupported(sampling=sp, reset=reset, stopping_criteria=stopping_criteria, request=req)
        if why is not None:
            if req is not None:
                req.reason = why
            if self._decoder is not None:
                log.debug("plain decoding: %s", why)
            self.last_dflash_stats = None
            return self._watched(req, len(tokens), super().generate(
                tokens, top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                repeat_penalty=repeat_penalty, reset=reset, frequency_penalty=frequency_penalty,
                presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, penalize_nl=penalize_nl,
                logits_processor=logits_processor, stopping_criteria=stopping_criteria, grammar=grammar))
        stats = GenerationStats()
        if req is not None:
            req.served, req.stats = True, stats
        self.last_dflash_stats = stats
        # processors (logit_bias among them) and the grammar judge every verify row, as llama_cpp's chain
        limits = request_constraints(self, tokens, grammar, logits_processor=logits_processor)
        gen = self._dflash_tokens(list(tokens), sp, stats, req, stop_token_ids(stopping_criteria) or set(), limits)
        self._call.live = weakref.ref(gen)
        return self._watched(req, len(tokens), gen)

    def _watched(self, req: Request | None, n_prompt: int, gen) -> Iterator[int]:
        """``gen`` counted for usage and stopped by :meth:`interrupt` (before each token)."""
        if req is not None:
            req.n_prompt, req.n_completion = n_prompt, 0
        vocab = self._model.vocab
        try:
            while not self._interrupt.is_set():
                try:
                    tok = next(gen)
                except StopIteration:
                    return
                if req is not None and not llama_cpp.llama_vocab_is_eog(vocab, tok):
                    req.n_completion += 1     # llama_cpp appends every token but an end-of-generation one
                yield tok
            log.info("generation interrupted")
            eos = self.token_eos()
            if eos >= 0 and llama_cpp.llama_vocab_is_eog(vocab, eos):
                # llama_cpp fills the response text only where it stops by itself: an end-of-generation
                # token makes it return the text so far (finish "stop"); it is neither evaluated nor counted
                yield eos
        finally:
            gen.close()

    def _dflash_tokens(self, prompt: list[int], sp: SamplingParams, stats: GenerationStats,
                       req: Request | None, stop_ids: set[int], limits: Constraints | None) -> Iterator[int]:
        room = max(self._n_ctx - len(prompt), 0)
        want = req.max_tokens if req is not None else None
        # Draft no further than the request needs. llama_cpp reads on past max_tokens while a UTF-8
        # character is incomplete: +3 covers one character, and a greedy run without penalties can
        # resume exactly if it wants more. Otherwise the decoder runs unbounded and the consumer stops it.
        resumable = sp.greedy and not sp.has_penalties and not limits
        budget = min(want + 3, room) if (want is not None and want > 0 and resumable) else room
        dec = self._decoder
        stop = dec.eog | stop_ids   # stop ids of the criteria: the engine stops exactly after them
        self._adopt_llama_view()
        emitted: list[int] = []
        inner = None
        try:
            if stop_ids and prompt[-1] in stop_ids:
                stats.finish = "stop"   # llama_cpp's criterion fires before the first token
                return
            inner = dec.generate(prompt, budget, sampling=sp, stats=stats, stop_tokens=stop, constraints=limits,
                                 logits_sink=self._score_row if self._logits_all else None)
            for tok in inner:
                emitted.append(tok)
                yield tok
            if stats.finish == "length" and budget < room:
                head = (stats.n_prompt, stats.n_reused)
                inner = dec.generate(prompt + emitted, room - len(emitted), sampling=sp, stats=stats, stop_tokens=stop,
                                     logits_sink=self._score_row if self._logits_all else None)
                for tok in inner:
                    emitted.append(tok)
                    yield tok
                stats.n_prompt, stats.n_reused = head
            if stats.finish == "stop" and emitted and emitted[-1] in stop_ids - dec.eog:
                # llama_cpp evaluates a stop id before its criterion ends the generation (and reports
                # finish "stop" from the evaluated tokens): evaluate it too
                inner.close()
                dec.feed(emitted[-1:])
        finally:
            if inner is not None:
                inner.close()           # the decoder rolls both caches back to the consumed tokens
            self._publish_cache()

    def _score_row(self, pos: int, row) -> None:
        """logits_all: a row of llama_cpp's scores, as its eval would keep it (its logprobs read them,
        streamed ones while the generation runs: n_tokens follows)."""
        if pos < len(self.scores):
            self.scores[pos, :] = row
            self.n_tokens = pos + 1

    def _finish_live(self) -> None:
        """Close a DFlash generator that its consumer abandoned without closing it."""
        ref, self._call.live = self._call.live, None
        live = ref() if ref is not None else None
        if live is not None:
            try:
                live.close()
            except ValueError:   # closed from inside its own consumer: it rolls back when it ends
                pass

    def _adopt_llama_view(self) -> None:
        """Keep only what both views agree on: llama_cpp's tokens vs the drafter's features."""
        dec = self._decoder
        view = self.input_ids[: self.n_tokens]
        m = common_prefix_len(dec.cache, view)
        if m == len(dec.cache) == self.n_tokens:
            return
        self.n_tokens = dec.keep_prefix(m)
        self._requires_eval = True

    def _publish_cache(self) -> None:
        """Make llama_cpp's view describe the target KV the decoder left behind."""
        cache = self._decoder.cache
        n = len(cache)
        # llama_cpp sizes input_ids by the n_ctx asked for and stores no further (llama.cpp may pad
        # the context past it, 1000 -> 1024, and generation runs to the padded end): so here
        held = min(n, len(self.input_ids))
        self.input_ids[:held] = cache[:held]
        self.n_tokens = n
        self._requires_eval = True

    # ------------------------------------------------------------------ overrides keeping views in step
    def reset(self):
        self._check_free()
        self._finish_live()
        super().reset()

    def eval(self, tokens: Sequence[int]):
        self._check_free()
        try:
            super().eval(tokens)
        finally:   # a lost rpc-server fails the plain path too (typed), before its logits are sampled
            self._rpc_check()

    def load_state(self, state) -> None:
        self._check_free()
        self._finish_live()
        super().load_state(state)

    def save_state(self):
        self._check_free()
        self._finish_live()
        return super().save_state()

    def close(self) -> None:
        self._close_dflash()
        super().close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:   # interpreter shutdown: the library may already be gone
            pass


Llama.generate.__signature__ = inspect.signature(Llama._generate)
Llama.create_completion.__signature__ = _signature(llama_cpp.Llama.create_completion, dflash=None)
Llama.__call__.__signature__ = _signature(llama_cpp.Llama.__call__, dflash=None)
Llama.create_chat_completion.__signature__ = _signature(llama_cpp.Llama.create_chat_completion, dflash=None,
                                                        chat_template_kwargs=None)
Llama.__init__.__signature__ = _signature(llama_cpp.Llama.__init__, draft_model_path=None, draft_n_max=None,
                                          draft_adaptive=True, dflash=True, draft_n_gpu_layers=None,
                                          draft_use_mmap=False, draft_window=None, low_memory=False,
                                          rollback_memory_mb=None, rpc_servers=None, draft_rpc_servers=None,
                                          prompt_lookup=False, prompt_lookup_num_pred_tokens=10,
                                          prompt_lookup_max_ngram_size=2, n_seq_max=1)

__all__ = ["Llama", "check_grammar", "pair_files"]
