"""What a request constrains beyond its sampling parameters: a llama.cpp grammar and logits processors.

llama-cpp-python's sampler chain is ``logits_processor`` (``logit_bias`` becomes one) -> penalties ->
grammar -> greedy, or top-k -> typical -> top-p -> min-p -> temperature -> sample.
:class:`dflash_gguf.decoding.sampling.TokenChooser` runs that chain on every verify row; this module holds
the two parts that are not pure functions of the row's logits:

* :class:`Grammar` - one llama.cpp grammar sampler (``llama_sampler_init_grammar``, as ``llama_cpp``
  builds it from a :class:`llama_cpp.LlamaGrammar`), asked which candidate ids it allows and advanced
  by the tokens a request keeps;
* :class:`Constraints` - a request's processors and grammar. Row ``j`` of a verify block is judged
  with the processors called on the ids up to that row (prompt, kept tokens, the block's tokens
  before ``j``) and under the grammar state advanced along those same tokens; the state kept between
  steps advances only by the tokens the request keeps (a rejected row leaves nothing behind).

Exactness: a grammar is exact (its state is a function of the tokens accepted). A processor is
exact when it is a function of ``(input_ids, scores)``: it is called once per verify row, rows that
are then rejected included, so one that counts its calls or keeps state of its own sees more calls
than under plain decoding.
"""
from __future__ import annotations

import ctypes
import json
from typing import Callable, Sequence

import numpy as np

from dflash_gguf.errors import InvalidArgumentError

# llama_cpp (which loads the native library) is imported where a grammar or a vocabulary is used, so
# the processors and Constraints stay importable without the build (tests/test_sampling_rules.py)

# llama_token_data {id, logit, p} as llama.h lays it out
TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")], align=True)


class Grammar:
    """A llama.cpp grammar sampler: which tokens it allows next, advanced token by token."""

    def __init__(self, vocab, text: str, root: str = "root", *, _ptr=None):
        from dflash_gguf.native.llama import llama_cpp

        self.vocab = vocab
        self.ptr = _ptr if _ptr is not None else llama_cpp.llama_sampler_init_grammar(
            vocab, text.encode("utf-8"), root.encode("utf-8"))
        if not self.ptr:
            raise InvalidArgumentError("invalid grammar: llama.cpp could not parse it (its log says where)")

    @classmethod
    def of(cls, llm, grammar) -> "Grammar":
        """The grammar of a :class:`llama_cpp.LlamaGrammar` on ``llm``'s vocabulary."""
        return cls(llm._model.vocab, grammar._grammar, grammar._root)

    def clone(self) -> "Grammar":
        from dflash_gguf.native.llama import llama_cpp

        return Grammar(self.vocab, "", _ptr=llama_cpp.llama_sampler_clone(self.ptr))

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` the grammar allows next (bool per id)."""
        from dflash_gguf.native.llama import llama_cpp

        buf = np.zeros(len(ids), dtype=TOKEN_DATA)
        buf["id"] = ids
        arr = llama_cpp.llama_token_data_array(
            data=buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data)), size=len(ids), selected=-1,
            sorted=False)
        llama_cpp.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        return buf["logit"] != -np.inf

    def accept(self, token: int) -> None:
        """Advance by ``token`` (which must be allowed: llama.cpp aborts on an end-of-generation token
        the grammar does not allow)."""
        from dflash_gguf.native.llama import llama_cpp

        llama_cpp.llama_sampler_accept(self.ptr, int(token))

    def close(self) -> None:
        ptr, self.ptr = self.ptr, None
        if ptr:
            from dflash_gguf.native.llama import llama_cpp

            llama_cpp.llama_sampler_free(ptr)

    def __del__(self):
        try:
            self.close()
        except Exception:   # interpreter shutdown
            pass


def logit_bias_processor(bias: dict) -> Callable:
    """llama_cpp's ``logit_bias`` as a processor: ``{token id: added logit}`` (ids as str or int)."""
    ids = np.array([int(k) for k in bias], dtype=np.int64)
    add = np.array([float(v) for v in bias.values()], dtype=np.float32)

    def processor(input_ids, scores):
        out = np.array(scores, dtype=np.float32)
        out[ids] = scores[ids] + add
        return out
    return processor

def masked(bias: dict | None, ids) -> dict:
    """``bias`` (a ``logit_bias``) with a bias of -inf on ``ids``, over any it gives them: llama-server's
    ``ignore_eos`` with the end-of-generation ids (none is chosen; a reply runs to its ``max_tokens``)."""
    out = dict(bias or {})
    out.update((int(t), float("-inf")) for t in ids)
    return out


def tool_call_grammar(tools: list | None, tool_choice) -> tuple[str, object] | None:
    """The function a chat request forces, as llama_cpp's chat handlers read it: a ``tool_choice`` of
    ``{"type": "function", "function": {"name": NAME}}`` with ``tools`` given; then (NAME, the grammar of
    that function's parameters' JSON schema, any JSON where the schema cannot become one). None for
    ``"auto"``, ``"none"`` or no tools (the template sees the tools; the reply is text)."""
    if not isinstance(tool_choice, dict) or tools is None:
        return None
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidArgumentError('tool_choice must be "none", "auto" or {"type": "function", '
                                   '"function": {"name": NAME}}')
    tool = next((t for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
                 and t["function"].get("name") == name), None)
    if tool is None:
        raise InvalidArgumentError(f"Tool choice '{name}' not found in tools.")
    from dflash_gguf.native.llama import llama_grammar

    try:
        grammar = llama_grammar.LlamaGrammar.from_json_schema(json.dumps(tool["function"]["parameters"]),
                                                              verbose=False)
    except Exception:   # llama_cpp's own fallback (a function without parameters too): any JSON value
        grammar = llama_grammar.LlamaGrammar.from_string(llama_grammar.JSON_GBNF, verbose=False)
    return name, grammar


def request_constraints(llm, prompt: Sequence[int], grammar=None, logit_bias: dict | None = None,
                        response_format: dict | None = None, logits_processor=None) -> Constraints | None:
    """A request's constraints as llama_cpp builds them: ``grammar`` (a :class:`llama_cpp.LlamaGrammar`),
    or a chat ``response_format`` of type ``json_object`` (with an optional ``schema``; it replaces the
    grammar, as in llama_cpp's chat handlers), then ``logits_processor`` and ``logit_bias``."""
    if response_format is not None and response_format.get("type") == "json_object":
        from dflash_gguf.native.llama import llama_chat_format

        grammar = llama_chat_format._grammar_for_response_format(response_format)
    procs = list(logits_processor or ())
    if logit_bias:
        procs.append(logit_bias_processor(logit_bias))
    if grammar is None and not procs:
        return None
    return Constraints(procs, Grammar.of(llm, grammar) if grammar is not None else None, prompt)


class Constraints:
    """One request's logits processors and grammar (either may be absent), for its TokenChooser."""

    def __init__(self, processors: Sequence[Callable] = (), grammar: Grammar | None = None,
                 prompt: Sequence[int] = ()):
        self.processors = list(processors)
        self.grammar = grammar
        self.prompt = [int(t) for t in prompt]
        self._work: Grammar | None = None     # the grammar advanced along self._work_ids (this step's rows)
        self._work_ids: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.processors) or self.grammar is not None

    def process(self, logits: np.ndarray, generated: list[int]) -> np.ndarray:
        """The processors' scores for a row whose input ids are the prompt and ``generated``."""
        if not self.processors:
            return logits
        ids = np.asarray(self.prompt + generated, dtype=np.intc)
        scores = np.array(logits, dtype=np.float32)
        for f in self.processors:
            scores = np.asarray(f(ids, scores), dtype=np.float32)
        return scores

    def allowed(self, extra: list[int]) -> Callable[[np.ndarray], np.ndarray] | None:
        """The grammar's test for the next token after the kept tokens and ``extra`` (None: no grammar)."""
        if self.grammar is None:
            return None
        if not extra:
            return self.grammar.allowed
        if self._work is None or self._work_ids != extra[:len(self._work_ids)]:
            self._drop_work()
            self._work, self._work_ids = self.grammar.clone(), []
        for t in extra[len(self._work_ids):]:
            self._work.accept(t)
            self._work_ids.append(int(t))
        return self._work.allowed

    def allowed_prefix(self, draft: np.ndarray) -> int:
        """How many of the drafted tokens the grammar allows in a row (a forbidden one is a sure
        rejection: the block is cut before it)."""
        if self.grammar is None or len(draft) == 0:
            return len(draft)
        if not self.grammar.allowed(draft[:1])[0]:
            return 0
        g = self.grammar.clone()
        try:
            for j in range(1, len(draft)):
                g.accept(int(draft[j - 1]))
                if not g.allowed(draft[j:j + 1])[0]:
                    return j
            return len(draft)
        finally:
            g.close()

    def accept(self, tokens: Sequence[int]) -> None:
        """The request kept ``tokens``: the grammar advances by them."""
        if self.grammar is not None and len(tokens):
            toks = [int(t) for t in tokens]
            n = len(self._work_ids)
            if self._work is not None and toks[:n] == self._work_ids:
                self.grammar.close()          # the rows' state is already that far
                self.grammar, self._work = self._work, None
                toks = toks[n:]
            for t in toks:
                self.grammar.accept(t)
        self._drop_work()

    def _drop_work(self) -> None:
        if self._work is not None:
            self._work.close()
        self._work, self._work_ids = None, []

    def close(self) -> None:
        self._drop_work()
        if self.grammar is not None:
            self.grammar.close()
