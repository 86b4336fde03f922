"""Acceptance: which drafted tokens the target keeps, as pure functions of arrays.

A step drafted ``d1..dn`` after the pending token; the target decoded ``[pending, d1..dn]`` and row
``i`` of its output predicts the token after row ``i``'s input. The step commits the longest prefix
``d1..da`` the target agrees with, plus the target's own token at row ``a``: ``a + 1`` tokens.
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

import numpy as np


def greedy_accept(draft: np.ndarray, target_ids: np.ndarray) -> list[int]:
    """Tokens committed by a greedy step: ``draft`` (n ids) against the target's argmax rows (n + 1 ids)."""
    n = len(draft)
    if len(target_ids) != n + 1:
        raise ValueError(f"{n} drafted tokens need {n + 1} target rows, got {len(target_ids)}")
    if n:
        ok = draft == target_ids[:n]
        a = n if ok.all() else int(np.argmin(ok))
    else:
        a = 0
    return [*draft[:a].tolist(), int(target_ids[a])]


def sampled_accept(draft: Sequence[int], logits_row: Callable[[int], np.ndarray], chooser,
                   q: Sequence[tuple[np.ndarray, np.ndarray]] | None = None) -> list[int]:
    """Tokens committed by a sampled step (speculative rejection sampling).

    ``chooser`` is a :class:`dflash_gguf.decoding.sampling.TokenChooser`: ``verify(logits, token, history, q)``
    keeps a drafted token with probability min(1, p/q) (p(token) for a deterministic proposal,
    ``q=None``) and otherwise resamples from the residual, ``pick(logits, history)`` samples the
    bonus token after a fully accepted block. ``q[i]``: (token ids, probabilities) the i-th token
    was drawn from.
    """
    commit: list[int] = []
    n = len(draft)
    for i in range(n):
        ok, tok = chooser.verify(logits_row(i), int(draft[i]), commit, None if q is None else q[i])
        commit.append(tok)
        if not ok:
            return commit
    commit.append(chooser.pick(logits_row(n), commit))
    return commit


def cut_at_stop(commit: list[int], stop: Collection[int]) -> list[int]:
    """The committed tokens up to and including the first stop token."""
    for j, tok in enumerate(commit):
        if tok in stop:
            return commit[:j + 1]
    return commit
