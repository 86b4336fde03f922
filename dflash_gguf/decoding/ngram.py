"""Prompt lookup (n-gram) drafting: copy what followed the last tokens' earlier occurrence.

Where the output restates its input (an edit of a given function, a summary that quotes its source,
code that repeats a name), the tokens after the current suffix have often been seen already:
:class:`NgramIndex` finds the most recent earlier occurrence of the last ``max_ngram`` tokens (then of
fewer, down to ``min_ngram``) in the prompt and the text so far and proposes the tokens that followed
it, as llama-cpp-python's ``LlamaPromptLookupDecoding`` (longest n-gram first) and upstream llama.cpp's
``ngram-simple`` (most recent occurrence) do. The proposal is a point mass: the target keeps a copied
token greedily when it is its argmax, sampled with probability p(token) (:mod:`.acceptance`), so the
output is the target's whatever is copied.

Whether copying pays is a matter of rates and costs: :class:`Rates` keeps decayed per-position
acceptance of a proposer, :class:`StepCosts` the measured seconds of a step by its verify rows, and
:func:`best_length` picks how many of a match's tokens to verify for the most tokens per second.
Pure: no native library.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class NgramOptions:
    """Prompt lookup's settings (defaults: llama-cpp-python's ``LlamaPromptLookupDecoding``)."""
    max_ngram: int = 2      # longest suffix looked up (max_ngram_size; llama-server --spec-ngram-simple-size-n)
    n_pred: int = 10        # tokens copied per step at most (num_pred_tokens; --spec-ngram-simple-size-m)
    min_ngram: int = 1      # shortest suffix looked up

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.n_pred < 1:
            raise ValueError(f"prompt lookup copies at least one token per step (n_pred >= 1), got {self.n_pred}")


class NgramIndex:
    """The tokens of one sequence (prompt and text so far) with, for every n-gram of ``min_ngram`` to
    ``max_ngram`` tokens, where the tokens after its most recent occurrence start.

    An n-gram enters the index once a token follows it, so a lookup of the current suffix never finds
    the suffix itself; the index grows with :meth:`extend` (O(max_ngram) per token) and is rebuilt by
    :meth:`reset`.
    """

    def __init__(self, max_ngram: int = 2, min_ngram: int = 1, tokens: Sequence[int] = ()):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def reset(self, tokens: Sequence[int] = ()) -> None:
        self.tokens, self._after = [], {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        toks, after = self.tokens, self._after
        lo, hi = self.min_ngram, self.max_ngram
        for t in tokens:
            end = len(toks)          # the n-grams ending before the new token: it follows them
            for m in range(lo, min(hi, end) + 1):
                after[tuple(toks[end - m:end])] = end
            toks.append(int(t))

    def propose(self, n: int) -> list[int]:
        """Up to ``n`` tokens that followed the most recent earlier occurrence of the longest suffix found
        (``[]``: no suffix of ``min_ngram`` tokens or more occurred before)."""
        toks = self.tokens
        if n <= 0:
            return []
        for m in range(min(self.max_ngram, len(toks)), self.min_ngram - 1, -1):
            start = self._after.get(tuple(toks[len(toks) - m:]))
            if start is not None:
                return toks[start:start + n]
        return []


def find_candidate(tokens: Sequence[int], max_ngram: int, n: int, min_ngram: int = 1) -> list[int]:
    """What :class:`NgramIndex` proposes after ``tokens``, by a plain scan (the specification it keeps)."""
    toks = list(tokens)
    for m in range(min(max_ngram, len(toks)), min_ngram - 1, -1):
        suffix = toks[len(toks) - m:]
        for end in range(len(toks) - 1, m - 1, -1):        # the occurrence ending latest, with a token after it
            if toks[end - m:end] == suffix:
                return toks[end:end + n]
    return []


class Rates:
    """A proposer's acceptance: decayed counts of how often position i of its proposals was reached (every
    token before it kept) and kept. A position seldom reached leans on the one before it (``PRIOR``
    pseudo-draws), the first on ``first`` (a copy that matched is often right: 0.5)."""

    DECAY = 0.97
    PRIOR = 2.0

    def __init__(self, n_max: int, first: float = 0.5):
        self.hits = [0.0] * n_max
        self.tries = [0.0] * n_max
        self.first = first

    def record(self, n: int, accepted: int) -> None:
        if n <= 0:
            return
        d = self.DECAY
        self.hits = [h * d for h in self.hits]
        self.tries = [t * d for t in self.tries]
        for i in range(min(accepted + 1, n, len(self.tries))):
            self.tries[i] += 1
        for i in range(min(accepted, len(self.hits))):
            self.hits[i] += 1

    def expected(self, n: int) -> list[float]:
        """Expected tokens per step (the target's own one included) for 0..n proposed tokens."""
        out, p, total, prior = [1.0], 1.0, 1.0, self.first
        for i in range(min(n, len(self.hits))):
            prior = (self.hits[i] + self.PRIOR * prior) / (self.tries[i] + self.PRIOR)
            p *= prior
            total += p
            out.append(total)
        return out


class StepCosts:
    """Seconds of a target step by its verify rows (an exponential average per row count), read between
    and past the measured counts off a line through them (no step measured yet: nan; one row count
    measured: each further row at ``ROW`` x its cost, a guess the first step of that many rows replaces)."""

    EMA = 0.2
    OUTLIER = 2.0
    ROW = 0.1

    def __init__(self):
        self.cost: dict[int, float] = {}
        self._line: tuple[float, float, float] | None = None    # (xm, ym, slope) of the counts measured

    def record(self, rows: int, seconds: float) -> None:
        c = self.cost.get(rows)
        self.cost[rows] = seconds if c is None else (1 - self.EMA) * c + self.EMA * min(seconds, self.OUTLIER * c)
        self._line = None

    def __call__(self, rows: int) -> float:
        c = self.cost.get(rows)
        if c is not None:
            return c
        if not self.cost:
            return math.nan
        if len(self.cost) == 1:
            (x, c), = self.cost.items()
            return c * (1 + self.ROW * max(rows - x, 0))
        if self._line is None:
            xs = list(self.cost)
            xm = sum(xs) / len(xs)
            ym = sum(self.cost.values()) / len(xs)
            slope = max(sum((x - xm) * (self.cost[x] - ym) for x in xs) / sum((x - xm) ** 2 for x in xs), 0.0)
            self._line = (xm, ym, slope)
        xm, ym, slope = self._line
        return max(ym + slope * (rows - xm), min(self.cost.values()))


def best_length(expected: Sequence[float], cost: Sequence[float]) -> int:
    """The length ``k`` (0 .. len(expected) - 1) with the most expected tokens per second,
    ``expected[k] / cost[k]``; an unknown cost (nan) counts as paying, so that it gets measured."""
    best, rate = 0, -1.0
    for k, (e, c) in enumerate(zip(expected, cost)):
        r = math.inf if c != c else e / c
        if r > rate or (r == rate and k > best and r == math.inf):
            best, rate = k, r
    return best
