"""Stopping criteria that only look at token ids, so the DFlash engine can serve them exactly.

llama_cpp hands ``generate`` a ``StoppingCriteriaList`` for chat: the chat template in a GGUF becomes a
``Jinja2ChatFormatter`` whose criterion stops on its ``stop_token_ids`` (the end-of-turn token). A
criterion is an opaque callable of (token ids, logits), so in general it needs the logits of every
token; these two kinds need only the ids, and the engine turns them into stop tokens:

* llama_cpp's own ``stop_on_last_token`` (recognised with its formatter's ``stop_token_ids``);
* :class:`StopOnTokens`, ours, for users who build criteria themselves.

llama_cpp calls a criterion with the tokens evaluated so far, i.e. *before* the newly sampled token is
evaluated: a stop id is yielded, and generation ends at the step after it (or at once when the prompt
already ends with one). The engine reproduces exactly that.
"""
from __future__ import annotations

from typing import Iterable


class StopOnTokens:
    """A ``llama_cpp.StoppingCriteria`` that stops after any of ``ids`` (DFlash serves it)."""

    def __init__(self, ids: Iterable[int]):
        self.ids = frozenset(int(t) for t in ids)

    def __call__(self, input_ids, logits) -> bool:
        return len(input_ids) > 0 and int(input_ids[-1]) in self.ids

    def __repr__(self) -> str:
        return f"StopOnTokens({sorted(self.ids)})"


def _chat_formatter_ids(fn) -> set[int] | None:
    """The stop ids of llama_cpp's chat-formatter criterion (a closure over the formatter), else None."""
    if getattr(fn, "__name__", None) != "stop_on_last_token" or \
            getattr(fn, "__module__", None) != "llama_cpp.llama_chat_format":
        return None
    for cell in fn.__closure__ or ():
        try:
            ids = getattr(cell.cell_contents, "stop_token_ids", None)
        except ValueError:     # an empty cell
            continue
        if isinstance(ids, (set, frozenset, list, tuple)):
            return {int(t) for t in ids}
    return None


def stop_token_ids(criteria) -> set[int] | None:
    """Token ids the criteria stop on, when every criterion stops on token ids only; None otherwise."""
    ids: set[int] = set()
    for c in criteria or ():
        got = set(c.ids) if isinstance(c, StopOnTokens) else _chat_formatter_ids(c)
        if got is None:
            return None
        ids |= got
    return ids
