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
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from dflash_gguf.engine import Context, ContextOptions, DrafterInfo, Model, clamp_n_draft
from dflash_gguf.errors import InvalidArgumentError
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.decoding.decoder import DFlashDecoder, SpecOptions
from dflash_gguf.decoding.ngram import NgramOptions
from dflash_gguf.decoding.rollback import choose_for_memory, recurrent_state_bytes
from dflash_gguf.decoding.sequence import Request
from dflash_gguf.decoding.stats import GenerationStats

log = logging.getLogger("dflash_gguf.batch")


@dataclass
class Completion:
    """One prompt's result. ``finish_reason``: "stop" (end of generation, a stop token or string),
    "length" (max_tokens) or "context" (the context is full)."""
    text: str
    tokens: list[int]
    finish_reason: str
    prompt_tokens: int
    stats: GenerationStats = field(repr=False, default_factory=GenerationStats)


class StopStrings:
    """A request's consumer (see :class:`dflash_gguf.decoding.decoder.Request`): keeps tokens until the text
    holds one of ``stops``, then ends the request after the token that completed it. ``silent``: tokens
    that add no text (end-of-generation tokens: llama_cpp ends on one without its text, which for some
    vocabularies is an ordinary byte)."""

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str], silent: frozenset = frozenset()):
        self.piece, self.stops, self.silent = piece, [s for s in stops if s], silent
        self.longest = max((len(s) for s in self.stops), default=0)
        self.raw = b""
        self.seen = 0                  # characters of text already searched (less a stop string's length)
        self.cut: int | None = None    # character offset of the first stop string found

    def text(self) -> str:
        """The completion's text: bytes that are not UTF-8 left out, as llama_cpp does."""
        text = self.raw.decode("utf-8", "ignore")
        return text if self.cut is None else text[:self.cut]

    def __call__(self, tokens: list[int]) -> int | None:
        for j, tok in enumerate(tokens):
            if tok in self.silent:
                continue
            self.raw += self.piece(tok)
            if self.stops:
                text = self.raw.decode("utf-8", "ignore")
                start = max(0, self.seen - self.longest)
                hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
                self.seen = len(text)
                if hits:
                    self.cut = min(hits)
                    return j + 1
        return None


def formatted_prompt(fmt, messages: Sequence[dict], tokenize, **extra) -> tuple[list[int], list[str]]:
    """The prompt ids and stop strings of a llama_cpp chat formatter for ``messages``, tokenized as
    llama_cpp's chat handler does it (``tokenize``: a ``tokenize(text, add_bos=, special=)``; ``extra``:
    what the handler passes on to the formatter: ``tools``, ``tool_choice``, template variables)."""
    r = fmt(messages=list(messages), **extra)
    ids = tokenize(r.prompt.encode("utf-8"), add_bos=not r.added_special, special=True)
    return ids, [r.stop] if isinstance(r.stop, str) else list(r.stop or [])


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
                              flash_attn=flash_attn, draft_window=draft_window)
        self._owned: list = []
        try:
            self.model = self._own(Model(model_path))
            self.drafter = self.draft_model = None
            if draft_model_path is not None:
                self.draft_model = self._own(Model(draft_model_path))
            n_rs_seq = self._snapshots(opts, draft_n_max, rollback_memory_mb)
            self.target = self._own(Context(self.model, replace(opts, n_rs_seq=n_rs_seq)))
            if self.draft_model is not None:
                self.drafter = self._own(Context(self.draft_model, opts, other=self.target))
            self.decoder = DFlashDecoder(self.target, self.drafter,
                                         SpecOptions(n_draft=draft_n_max, adaptive=draft_adaptive,
                                                     keep_history=True,
                                                     ngram=NgramOptions(max_ngram=prompt_lookup_max_ngram_size,
                                                                        n_pred=prompt_lookup_num_pred_tokens)
                                                     if prompt_lookup else None))
        except BaseException:
            self.close()
            raise
        self.n_parallel = n_parallel
        log.info("batch: %d sequences of %d positions, drafter %s (n_draft %d)", n_parallel, self.target.n_ctx,
                 "none" if self.drafter is None else os.fspath(draft_model_path), self.decoder.n_draft)

    def _snapshots(self, opts: ContextOptions, draft_n_max: int | None, cap_mb: float | None) -> int:
        """Recurrent-state snapshots per sequence for a hybrid or recurrent target that drafts (0: none,
        rollback by host checkpoints); under a cap, one sequence's state is measured on a small context
        of its own (the batch's target is then made once, with its snapshots)."""
        m = self.model
        if self.draft_model is None or not (m.is_hybrid or m.is_recurrent):
            return 0
        per_seq = opts.n_batch // opts.n_seq      # the decoder verifies a block of every sequence in one batch
        n_draft = clamp_n_draft(DrafterInfo.read(self.draft_model), draft_n_max, n_batch=per_seq,
                                n_ubatch=per_seq, hybrid=True)
        if n_draft == 0:
            return 0
        cap = None if cap_mb is None else int(cap_mb * 2**20)
        state = 0
        if cap is not None:
            with Context(m, ContextOptions(n_ctx=256, n_batch=256, n_ubatch=256, n_threads=opts.n_threads)) as probe:
                state = recurrent_state_bytes(probe)
        kind = choose_for_memory(state, n_draft * opts.n_seq, cap)
        log.info("batch: recurrent state %.1f MiB per copy, %d sequences x %d snapshots -> %s rollback",
                 state / 2**20, opts.n_seq, n_draft, kind)
        return n_draft if kind == "snapshot" else 0

    def _own(self, handle):
        self._owned.append(handle)
        return handle

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 seed: int | None = None, stop: Sequence[str] | None = None, add_bos: bool = True,
                 dflash: bool = True) -> list[Completion]:
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
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        template = self.model.meta("tokenizer.chat_template")
        if not template:
            raise InvalidArgumentError(f"{self.model.path.name} carries no chat template (tokenizer.chat_template)")
        import llama_cpp.llama_cpp as C
        # the vocabulary's entry, as llama_cpp's handler names the template's tokens (not the token's text:
        # they differ for byte tokens and word-start markers; the end-of-turn entry is also a stop string)
        text = lambda t: C.llama_vocab_get_text(self.model.vocab, t).decode("utf-8", "replace") if t >= 0 else ""  # noqa: E731
        fmt = Jinja2ChatFormatter(template=template, eos_token=text(C.llama_vocab_eos(self.model.vocab)),
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
            out.append(Completion(c.text(), toks, "stop" if r.stats.finish == "stop" else r.stats.finish or "length",
                                  len(p), r.stats))
        return out

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if getattr(self, "decoder", None) is not None:
            self.decoder.closed = True
        for h in reversed(getattr(self, "_owned", [])):
            h.close()
        self._owned = []

    def __enter__(self) -> "BatchLlama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
