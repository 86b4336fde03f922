"""Offline batch generation: many prompts in, completions out, several sequences per step.

For evaluations and dataset generation, in the spirit of vLLM's ``LLM.generate(list)`` and mlx-lm's
``batch_generate``::

    from dflash_gguf.batch import BatchLlama

    with BatchLlama("target.gguf", "drafter.gguf", n_parallel=4) as llm:
        for c in llm.generate(["def fib(n):", "class Stack:"], max_tokens=64, stop=["\\n\\n"]):
            print(c.finish_reason, c.text)
        llm.chat([[{"role": "user", "content": "Hello"}]], max_tokens=32)

``n_parallel`` sequences run at once in one target and one drafter context: each step drafts every
running sequence's block in one drafter decode and verifies all of them in one target decode; a
prompt takes a free slot as soon as one is (in order; the slot whose cache shares the longest prefix
with it). Each completion is exactly what the target alone gives (greedy: token for token; sampled:
the same distribution). ``dflash_gguf.Llama`` stays the single-sequence drop-in for llama_cpp.Llama.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

from dflash_gguf.native.engine import ContextOptions, Model
from dflash_gguf.errors import InvalidArgumentError
from dflash_gguf.runtime import DraftSettings, Runtime
from dflash_gguf.requests.defaults import COMPLETION, GREEDY
from dflash_gguf.requests.prompts import formatted_prompt
from dflash_gguf.requests.responses import finish_reason
from dflash_gguf.requests.stops import StopStrings
from dflash_gguf.decoding.sampling import SamplingParams
from dflash_gguf.decoding.ngram import NgramOptions
from dflash_gguf.decoding.sequence import Request
from dflash_gguf.decoding.stats import GenerationStats

log = logging.getLogger("dflash_gguf.batch")


@dataclass
class Completion:
    """One prompt's result. ``finish_reason`` (:func:`dflash_gguf.requests.responses.finish_reason`, the
    decoder's ends by their own names): "stop" (end of generation, a stop token or string), "length"
    (max_tokens) or "context" (the context is full)."""
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: GenerationStats = field(repr=False, default_factory=GenerationStats)


class BatchLlama:
    """A target (and a drafter) run for many prompts at once. Close it (or use ``with``) to free both."""

    def __init__(self, model_path: str | os.PathLike, draft_model_path: str | os.PathLike | None = None, *,
                 n_parallel: int = 4, n_ctx: int = 2048, n_batch: int = 512, n_threads: int | None = None,
                 draft_adaptive: bool = True, draft_n_max: int | None = None, draft_window: int | None = None,
                 flash_attn: bool | None = None, rollback_memory_mb: float | None = None,
                 prompt_lookup: bool = False, prompt_lookup_num_pred_tokens: int = 10,
                 prompt_lookup_max_ngram_size: int = 2):
        """``rollback_memory_mb`` (hybrid and recurrent targets): the most memory the recurrent-state
        rollback of all ``n_parallel`` sequences together may take. Within it (or with None) every
        sequence keeps a snapshot of its state per drafted token inside llama.cpp (the fastest); past
        it, one host copy per sequence that a rejection restores and replays (``Llama``'s option, for
        the whole batch). ``prompt_lookup``: also draft by copying from each prompt and its text so far, as
        ``Llama``'s option (with no drafter: the only proposer)."""
        if n_parallel < 1:
            raise InvalidArgumentError(f"n_parallel must be >= 1, got {n_parallel}")
        opts = ContextOptions(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads, n_seq=n_parallel,
                              flash_attn=flash_attn)
        draft = DraftSettings(n_max=draft_n_max, adaptive=draft_adaptive, window=draft_window,
                              rollback_memory_mb=rollback_memory_mb,
                              ngram=NgramOptions(max_ngram=prompt_lookup_max_ngram_size,
                                                 n_pred=prompt_lookup_num_pred_tokens) if prompt_lookup else None)
        self._owned: list = []
        try:
            self.model = self._own(Model(model_path))
            self.draft_model = None
            if draft_model_path is not None:
                self.draft_model = self._own(Model(draft_model_path))
            self.runtime = self._own(Runtime.open(self.model, self.draft_model, opts, draft))
        except BaseException:
            self.close()
            raise
        self.target, self.drafter, self.decoder = self.runtime.target, self.runtime.drafter, self.runtime.decoder
        self.n_parallel = n_parallel
        log.info("batch: %d sequences of %d positions, drafter %s (n_draft %d)", n_parallel, self.target.n_ctx,
                 "none" if self.drafter is None else os.fspath(draft_model_path), self.decoder.n_draft)

    def _own(self, handle):
        self._owned.append(handle)
        return handle

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 128, temperature: float = GREEDY,
                 top_k: int = COMPLETION["top_k"], top_p: float = COMPLETION["top_p"], min_p: float = COMPLETION["min_p"],
                 repeat_penalty: float = COMPLETION["repeat_penalty"], seed: int | None = None,
                 stop: Sequence[str] | None = None, add_bos: bool = True, dflash: bool = True) -> list[Completion]:
        """Complete every prompt (text, or token ids as they are); results in prompt order.

        A sampled batch with a ``seed`` gives prompt ``i`` the seed ``seed + i``: the same batch on a fresh
        BatchLlama repeats its text (a seed's text also depends on the batch around it: the drafts, hence
        the random numbers each step uses, do; its distribution does not).
        ``stop``: strings that end a completion (not included in its text), besides end of generation.
        """
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = [self.model.tokenize(p.encode(), add_bos=add_bos, special=True) if isinstance(p, str) else list(p)
               for p in prompts]
        return self._complete(ids, max_tokens, stop or [], dflash, [
            SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                           repeat_penalty=repeat_penalty, seed=None if seed is None else seed + i)
            for i in range(len(ids))])

    def chat(self, conversations: Sequence[Sequence[dict]], **kw) -> list[Completion]:
        """Answer every conversation (OpenAI-style messages) with the chat template in the target's GGUF;
        ``kw`` as for :meth:`generate`. The template's end-of-turn token ends a reply."""
        from dflash_gguf.native.llama import llama_chat_format

        template = self.model.meta("tokenizer.chat_template")
        if not template:
            raise InvalidArgumentError(f"{self.model.path.name} carries no chat template (tokenizer.chat_template)")
        from dflash_gguf.native.llama import llama_low as C
        # the vocabulary's entry, as llama_cpp's handler names the template's tokens (not the token's text:
        # they differ for byte tokens and word-start markers; the end-of-turn entry is also a stop string)
        text = lambda t: C.llama_vocab_get_text(self.model.vocab, t).decode("utf-8", "replace") if t >= 0 else ""  # noqa: E731
        fmt = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token=text(C.llama_vocab_eos(self.model.vocab)),
                                  bos_token=text(C.llama_vocab_bos(self.model.vocab)))
        prompts = []
        stops = list(kw.pop("stop", None) or [])
        for messages in conversations:
            ids, fmt_stops = formatted_prompt(fmt, messages, self.model.tokenize)
            prompts.append(ids)
            for s in fmt_stops:
                if s not in stops:
                    stops.append(s)
        return self.generate(prompts, stop=stops, **kw)

    def _complete(self, ids: list[list[int]], max_tokens: int, stop: Sequence[str], dflash: bool,
                  sps: list[SamplingParams]) -> list[Completion]:
        cuts = [StopStrings(self.model.token_bytes, stop, self.decoder.eog) for _ in ids]
        reqs = [Request(p, max_tokens, sp, use_draft=dflash, stats=GenerationStats(), consumer=c)
                for p, sp, c in zip(ids, sps, cuts)]
        tokens = self.decoder.generate_batch(reqs)
        out = []
        for p, r, toks, c in zip(ids, reqs, tokens, cuts):
            out.append(Completion(c.text(), toks, finish_reason(r.stats.finish, exact=True), len(p), r.stats))
        return out

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        for h in reversed(getattr(self, "_owned", [])):   # the runtime (contexts) before the models
            h.close()
        self._owned = []

    def __enter__(self) -> "BatchLlama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
