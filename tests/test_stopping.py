"""Stopping criteria that DFlash serves (dflash_gguf.requests.stopping): our StopOnTokens, llama_cpp's chat
formatter criterion recognised by its stop ids, and everything else left to the plain path."""
from __future__ import annotations

import types

import numpy as np
import pytest

from dflash_gguf.decoding.acceptance import sampled_accept
from dflash_gguf.requests.stopping import StopOnTokens, stop_token_ids

pytestmark = pytest.mark.pure


def test_stop_on_tokens_looks_at_the_last_id_only():
    s = StopOnTokens(np.array([5, 9], dtype=np.int64))
    assert s.ids == frozenset({5, 9}) and all(type(t) is int for t in s.ids)
    assert s([1, 2, 5], None) and s(np.array([9]), None)
    assert not s([5, 1], None) and not s([], None) and not s([4, 9, 4], None)
    assert repr(StopOnTokens([9, 2, 5])) == "StopOnTokens([2, 5, 9])"


def formatter_criterion(ids):
    chat_format = pytest.importorskip("llama_cpp.llama_chat_format")    # the real criterion (absent under --pure)
    fmt = chat_format.Jinja2ChatFormatter(template="{{ messages[0]['content'] }}", eos_token="</s>",
                                          bos_token="<s>", stop_token_ids=ids)
    (fn,) = fmt(messages=[{"role": "user", "content": "hi"}]).stopping_criteria
    return fn


def test_llama_cpps_chat_criterion_gives_its_stop_ids():
    fn = formatter_criterion([7, 9])
    assert fn.__name__ == "stop_on_last_token"
    assert stop_token_ids([fn]) == {7, 9}
    assert stop_token_ids([fn, StopOnTokens([3])]) == {3, 7, 9}
    assert stop_token_ids([StopOnTokens([1]), StopOnTokens([2])]) == {1, 2}
    assert stop_token_ids([]) == set() and stop_token_ids(None) == set()


def test_a_look_alike_is_not_trusted():
    """A function of the same name elsewhere, or llama_cpp's module with another name, may read the
    logits: the plain path serves it."""
    holder = types.SimpleNamespace(stop_token_ids=[4])

    def stop_on_last_token(tokens, logits):
        return tokens[-1] in holder.stop_token_ids

    assert stop_token_ids([stop_on_last_token]) is None
    real = formatter_criterion([4])
    renamed = types.FunctionType(real.__code__, real.__globals__, "other_name", None, real.__closure__)
    renamed.__module__ = real.__module__
    assert stop_token_ids([renamed]) is None
    assert stop_token_ids([lambda ids, logits: False]) is None
    assert stop_token_ids([StopOnTokens([1]), lambda ids, logits: False]) is None

    class Bare:                                  # a callable object without __name__ (or __module__)
        def __init__(self, **attrs):
            self.attrs = attrs

        def __getattribute__(self, name):
            attrs = object.__getattribute__(self, "attrs")
            if name in attrs:
                return attrs[name]
            if name.startswith("__") and name not in ("__class__", "__call__", "__init__"):
                raise AttributeError(name)
            return object.__getattribute__(self, name)

        def __call__(self, ids, logits):
            return False
    assert stop_token_ids([Bare()]) is None
    assert stop_token_ids([Bare(__name__="stop_on_last_token")]) is None


def test_the_formatters_cell_is_found_past_an_empty_or_foreign_one():
    real = formatter_criterion([6, 8])

    def two_free_vars():
        a = b = None

        def stop_on_last_token(tokens, logits):
            return a, b
        return stop_on_last_token
    code = two_free_vars().__code__
    fmt_cell = real.__closure__[0]
    for first in (types.CellType(), types.CellType(object()), types.CellType(types.SimpleNamespace(stop_token_ids="not ids"))):
        fn = types.FunctionType(code, real.__globals__, "stop_on_last_token", None, (first, fmt_cell))
        fn.__module__ = "llama_cpp.llama_chat_format"
        assert stop_token_ids([fn]) == {6, 8}
    none = types.FunctionType(code, real.__globals__, "stop_on_last_token", None, (types.CellType(), types.CellType()))
    none.__module__ = "llama_cpp.llama_chat_format"
    assert stop_token_ids([none]) is None


# ----------------------------------------------------------------------------- sampled_accept's protocol
class Script:
    """A chooser that accepts the first ``keep`` drafted tokens and records what it was given."""

    def __init__(self, keep):
        self.keep, self.calls = keep, []

    def verify(self, logits, token, history, q):
        self.calls.append(("verify", logits, token, list(history), q))
        i = len(history)
        return (True, token) if i < self.keep else (False, 100 + i)

    def pick(self, logits, history):
        self.calls.append(("pick", logits, None, list(history), None))
        return 200


def test_sampled_accept_calls_the_chooser_row_by_row():
    draft = [11, 12, 13]
    rows = lambda i: f"row{i}"  # noqa: E731
    c = Script(keep=1)
    assert sampled_accept(draft, rows, c) == [11, 101]
    assert c.calls == [("verify", "row0", 11, [], None), ("verify", "row1", 12, [11], None)]
    c = Script(keep=3)
    q = [("ids0", "p0"), ("ids1", "p1"), ("ids2", "p2")]
    assert sampled_accept(draft, rows, c, q) == [11, 12, 13, 200]
    assert c.calls == [("verify", "row0", 11, [], q[0]), ("verify", "row1", 12, [11], q[1]),
                       ("verify", "row2", 13, [11, 12], q[2]), ("pick", "row3", None, [11, 12, 13], None)]
    c = Script(keep=0)
    assert sampled_accept([], rows, c) == [200] and c.calls == [("pick", "row0", None, [], None)]
