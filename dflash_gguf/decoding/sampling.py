"""Token selection that reproduces llama.cpp's sampler chain, and lossless speculative acceptance.

The chain is the one llama-cpp-python builds for ``Llama.sample``: logits processors (``logit_bias``
is one), penalties over the tokens generated so far (last ``penalty_last_n``), a grammar, then greedy
at ``temperature == 0``; otherwise top-k -> typical -> top-p -> min-p -> temperature -> sample, or
mirostat (v1 or v2, in place of all those filters and of the temperature, as llama_cpp builds it).
``temperature < 0`` samples from the raw distribution. Processors and grammar come from
:class:`dflash_gguf.decoding.constraints.Constraints`; here a grammar is a test ``allowed(ids) -> bool per id``.

Acceptance of a drafted token ``d`` drawn from a proposal ``q`` against the target distribution
``p`` is the standard rejection rule: accept with probability ``min(1, p[d] / q[d])``; on rejection
sample from ``max(0, p - q)``, renormalised. A deterministic proposal is q one-hot at ``d``: accept
with ``p[d]``, else sample ``p`` without ``d``. The output distribution is then exactly ``p`` at
every position.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from dflash_gguf.requests.defaults import COMPLETION as _D, GREEDY

Allowed = Callable[[np.ndarray], np.ndarray]   # a grammar's test: which of these ids may come next

# candidates a grammar is asked about at once, best first, before it judges the whole vocabulary
GRAMMAR_WALK = 256


class NoTokenAllowed(ValueError):
    """The grammar allows no token of the vocabulary at this point."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling; each field left out is llama_cpp's default (:mod:`dflash_gguf.requests.defaults`),
    greedy."""
    temperature: float = GREEDY
    top_k: int = _D["top_k"]
    top_p: float = _D["top_p"]
    min_p: float = _D["min_p"]
    typical_p: float = _D["typical_p"]
    repeat_penalty: float = _D["repeat_penalty"]
    frequency_penalty: float = _D["frequency_penalty"]
    presence_penalty: float = _D["presence_penalty"]
    penalty_last_n: int = 64        # llama_cpp.Llama's last_n_tokens_size
    mirostat_mode: int = _D["mirostat_mode"]    # 1, 2: llama.cpp's mirostat samplers (at temperature > 0)
    mirostat_tau: float = _D["mirostat_tau"]
    mirostat_eta: float = _D["mirostat_eta"]
    seed: int | None = _D["seed"]
    # the caller asked for a repeatable request (a seed of its own): its drafts are then point masses (the
    # drafter's tokens, not draws from its own distribution), so that its text is the same whatever is
    # drafted (TokenChooser); None: repeatable exactly when a seed is given
    repeatable: bool | None = None

    @property
    def is_repeatable(self) -> bool:
        return self.seed is not None if self.repeatable is None else self.repeatable

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def mirostat(self) -> int:
        """The mirostat version in use (0: none; llama_cpp uses it only at a positive temperature)."""
        return self.mirostat_mode if self.temperature > 0 else 0

    @property
    def has_penalties(self) -> bool:
        return self.penalty_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)


def apply_penalties(logits: np.ndarray, history: list[int], sp: SamplingParams) -> np.ndarray:
    """llama.cpp's penalties sampler on a copy of ``logits`` (history: generated tokens)."""
    if not sp.has_penalties or not history:
        return logits
    window = history[-sp.penalty_last_n:] if sp.penalty_last_n > 0 else history
    ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
    out = logits.copy()
    vals = out[ids]
    vals = np.where(vals <= 0, vals * sp.repeat_penalty, vals / sp.repeat_penalty)
    vals = vals - counts * sp.frequency_penalty - sp.presence_penalty
    out[ids] = vals.astype(np.float32)
    return out


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _best_first(logits: np.ndarray, m: int) -> np.ndarray:
    """The ids of the ``m`` highest logits, best first, ties by lower id (as llama.cpp's samplers)."""
    n = logits.shape[0]
    ids = np.sort(np.argpartition(-logits, m - 1)[:m]) if m < n else np.arange(n)
    return ids[np.argsort(-logits[ids], kind="stable")]


def _all_allowed(logits: np.ndarray, allowed: Allowed) -> np.ndarray:
    ok = allowed(np.arange(logits.shape[0]))
    if not ok.any():
        raise NoTokenAllowed("the grammar allows no token here")
    return np.nonzero(ok)[0]


def constrained_argmax(logits: np.ndarray, allowed: Allowed | None) -> int:
    """The greedy choice among the tokens ``allowed`` lets through (lowest id on a tie): the row's argmax
    when the grammar allows it (the usual case: one token asked), else the best allowed token among the
    ``GRAMMAR_WALK`` best, else over the whole vocabulary."""
    best = int(np.argmax(logits))
    if allowed is None or allowed(np.array([best], dtype=np.int32))[0]:
        return best
    n = logits.shape[0]
    if GRAMMAR_WALK < n:
        ids = _best_first(logits, GRAMMAR_WALK)
        ok = allowed(ids)
        # exact unless the answer ties with the walk's last logit (a lower id outside it may tie too)
        if ok.any() and logits[ids[np.argmax(ok)]] > logits[ids[-1]]:
            return int(ids[np.argmax(ok)])
    ids = _all_allowed(logits, allowed)
    return int(ids[np.argmax(logits[ids])])


def _typical(ids: np.ndarray, lg: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's locally typical filter (``llama_sampler_init_typical(p, min_keep=1)``) on candidates
    ``ids`` with logits ``lg``, best first: keep the tokens whose surprise ``-log p`` is closest to the
    distribution's entropy until their mass exceeds ``mass``. Returned best first (llama.cpp leaves them
    unsorted; the top-p filter after it sorts them by logit again, min-p looks at the largest)."""
    p = _softmax(lg)
    with np.errstate(divide="ignore"):
        logp = np.log(p)
    entropy = -float(np.sum(p[p > 0] * logp[p > 0]))
    shifted = np.abs(-logp - entropy)                     # inf where p underflowed: such a token comes last
    order = np.argsort(shifted, kind="stable")
    cum = np.cumsum(p[order])
    over = np.nonzero(cum > mass)[0]
    last = int(over[0]) + 1 if len(over) else len(order)
    keep = np.sort(order[:last])                          # positions in ``ids``: best first again
    return ids[keep], lg[keep]


MIROSTAT_M = 100      # llama_cpp's mirostat v1: the tokens its Zipf exponent is estimated from


def _mirostat(logits: np.ndarray, sp: SamplingParams, mu: float, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's mirostat samplers' candidates (before the draw): v2 keeps the best tokens whose surprise
    ``-log2 p`` is at most ``mu`` (at least one); v1 keeps the top k, k from the Zipf exponent estimated
    on the ``MIROSTAT_M`` best tokens and ``mu`` (over a vocabulary of ``n_vocab``). Computed in float32,
    as llama.cpp does."""
    ids = np.argsort(-logits, kind="stable")
    p = _softmax(logits[ids].astype(np.float64)).astype(np.float32)
    if sp.mirostat_mode == 2:
        with np.errstate(divide="ignore"):
            over = np.nonzero(-np.log2(p) > np.float32(mu))[0]
        keep = max(1, int(over[0]) if len(over) else len(p))
    else:
        m = min(MIROSTAT_M - 1, len(p) - 1)
        i = np.arange(m, dtype=np.float32)
        t = np.log((i + 2) / (i + 1)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.log(p[:m] / p[1:m + 1]).astype(np.float32)
        s_hat = np.float32(np.sum(t * b, dtype=np.float32) / np.sum(t * t, dtype=np.float32))
        eps = s_hat - np.float32(1)
        with np.errstate(all="ignore"):
            k = np.power((eps * np.float32(2.0) ** np.float32(mu)) / (1 - np.float32(n_vocab) ** -eps),
                         1 / s_hat, dtype=np.float32)
        keep = max(int(k) if np.isfinite(k) else 1, 1)
    ids = ids[:keep]
    return ids, _softmax(logits[ids].astype(np.float64))


def surprise(p: float) -> float:
    """A drawn token's surprise in bits, as mirostat measures it."""
    return float(-np.log2(np.float32(p)))


def distribution(logits: np.ndarray, sp: SamplingParams, allowed: Allowed | None = None,
                 mu: float | None = None, n_vocab: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Candidate ids and their probabilities after the filter chain (sampling mode); ``allowed``: a
    grammar's test, applied before the filters (as llama.cpp's chain: the top-k are the k best tokens
    the grammar allows). Mirostat needs its state ``mu`` (``2 * tau`` at a request's start) and, for v1,
    the vocabulary's size ``n_vocab`` (default: ``len(logits)``)."""
    if allowed is not None:
        n = logits.shape[0]
        if sp.mirostat:
            ids = _all_allowed(logits, allowed)
            sub_ids, p = distribution(logits[ids], sp, mu=mu, n_vocab=n if n_vocab is None else n_vocab)
            return ids[sub_ids], p
        k = sp.top_k if 0 < sp.top_k < n and sp.temperature >= 0 else n
        ids = None
        if k < n:
            walk = _best_first(logits, min(max(GRAMMAR_WALK, 4 * k), n))
            ok = allowed(walk)
            if ok.sum() >= k:
                ids = walk[ok][:k]
                if logits[ids[-1]] == logits[walk[-1]]:
                    ids = None   # a tie at the walk's edge: judge the whole vocabulary
        if ids is None:
            ids = _all_allowed(logits, allowed)
        sub_ids, p = distribution(logits[ids], sp)
        return ids[sub_ids], p
    if sp.temperature < 0:
        ids = np.argsort(-logits, kind="stable")
        return ids, _softmax(logits[ids].astype(np.float64))
    n = logits.shape[0]
    if sp.mirostat:
        return _mirostat(logits, sp, 2.0 * sp.mirostat_tau if mu is None else mu, n if n_vocab is None else n_vocab)
    k = sp.top_k if 0 < sp.top_k < n else n
    if k < n:
        ids = np.argpartition(-logits, k - 1)[:k]
        ids = ids[np.argsort(-logits[ids], kind="stable")]
    else:
        ids = np.argsort(-logits, kind="stable")
    lg = logits[ids].astype(np.float64)
    if sp.typical_p < 1.0:
        ids, lg = _typical(ids, lg, sp.typical_p)
    if sp.top_p < 1.0:
        cum = np.cumsum(_softmax(lg))
        last = int(np.searchsorted(cum, sp.top_p, side="left")) + 1
        last = max(1, min(last, len(lg)))
        ids, lg = ids[:last], lg[:last]
    if sp.min_p > 0.0:
        keep = lg >= lg[0] + np.log(sp.min_p)
        if keep.sum() >= 1:
            ids, lg = ids[keep], lg[keep]
    return ids, _softmax(lg / sp.temperature)


class TokenChooser:
    """Picks target tokens for one generation call: greedy or sampled, with penalties, and with a
    request's logits processors and grammar (``constraints``, a :class:`dflash_gguf.decoding.constraints.Constraints`).

    A sampled token is drawn with the random numbers of its own position in the generation (a stream of
    the request's seed and the position): the token at a position is the target's draw from its
    distribution there, whatever was drafted. A drafted token (a point-mass proposal) is kept when it is
    that draw - with probability p(token), as rejection sampling keeps it - and the draw replaces it
    otherwise, which is a sample of the residual. So a seeded request gives the same text with drafting
    or without, at any draft length and in any batch. Proposals drawn from a drafter's own distribution
    (``q``: a DFlash2 lattice, a DSpark Markov chain) are judged by min(1, p/q) with the request's one
    stream (``rng``), which its proposer draws from too."""

    def __init__(self, sp: SamplingParams, constraints=None):
        self.sp = sp
        self.rng = np.random.default_rng(sp.seed)
        # the key of each position's stream: the seed, or one drawn for this request
        self._key = (int(sp.seed) if sp.seed is not None else int(self.rng.integers(2**63))) & (2**64 - 1)
        self.history: list[int] = []   # generated tokens (what llama.cpp's sampler has accepted)
        self.constraints = constraints if constraints else None
        # mirostat's state before each token of the step being decided: [0] after the accepted tokens,
        # [j] after the step's first j tokens (each decided from the row before)
        self._mu = [2.0 * sp.mirostat_tau]

    def _logits(self, logits: np.ndarray, extra: list[int]) -> np.ndarray:
        c = self.constraints
        if c is not None and c.processors:
            logits = c.process(logits, self.history + extra)
        if not self.sp.has_penalties:
            return logits
        return apply_penalties(logits, self.history + extra, self.sp)

    def _allowed(self, extra: list[int]) -> Allowed | None:
        return None if self.constraints is None else self.constraints.allowed(extra)

    def _distribution(self, lg: np.ndarray, extra: list[int]) -> tuple[np.ndarray, np.ndarray]:
        if not self.sp.mirostat:
            return distribution(lg, self.sp, self._allowed(extra))
        return distribution(lg, self.sp, self._allowed(extra), mu=self._mu[len(extra)])

    def _decided(self, extra: list[int], ids: np.ndarray, p: np.ndarray, tok: int) -> int:
        """``tok`` is the step's token after ``extra``: mirostat's state moves by its surprise."""
        if self.sp.mirostat:
            del self._mu[len(extra) + 1:]
            p_tok = float(p[np.nonzero(ids == tok)[0][0]])
            mu = np.float32(self._mu[len(extra)])
            self._mu.append(float(mu - np.float32(self.sp.mirostat_eta) *
                                  (np.float32(surprise(p_tok)) - np.float32(self.sp.mirostat_tau))))
        return tok

    def pick(self, logits: np.ndarray, extra: list[int]) -> int:
        """The target's own choice at a position (extra: tokens committed earlier in the block)."""
        lg = self._logits(logits, extra)
        if self.sp.greedy:
            return constrained_argmax(lg, self._allowed(extra))
        ids, p = self._distribution(lg, extra)
        return self._decided(extra, ids, p, self._draw(ids, p, extra))

    def _draw(self, ids: np.ndarray, p: np.ndarray, extra: list[int]) -> int:
        """The target's draw at the position after ``extra``, from that position's own stream."""
        return int(ids[self.stream(len(self.history) + len(extra)).choice(len(ids), p=p)])

    def stream(self, position: int) -> np.random.Generator:
        """The random numbers of the generation's ``position``-th token (from 0)."""
        return np.random.default_rng([self._key, position])

    def verify(self, logits: np.ndarray, draft: int, extra: list[int],
               q: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[bool, int]:
        """Accept ``draft`` or return the replacement token (lossless rejection sampling).

        ``q``: (token ids, probabilities) ``draft`` was drawn from; None for a deterministic proposal.
        """
        lg = self._logits(logits, extra)
        if self.sp.greedy:
            best = constrained_argmax(lg, self._allowed(extra))
            return best == draft, best
        ids, p = self._distribution(lg, extra)
        if q is None:
            tok = self._draw(ids, p, extra)
            return tok == draft, self._decided(extra, ids, p, tok)
        ok, tok = self._verify(ids, p, draft, q)
        return ok, self._decided(extra, ids, p, tok)

    def _verify(self, ids: np.ndarray, p: np.ndarray, draft: int, q) -> tuple[bool, int]:
        """``draft`` drawn from ``q``: kept with probability min(1, p/q), else a draw of the residual."""
        hit = np.nonzero(ids == draft)[0]
        p_d = float(p[hit[0]]) if len(hit) else 0.0
        order = np.argsort(q[0])
        q_ids, q_p = q[0][order], q[1][order]
        q_d = float(q_p[np.searchsorted(q_ids, draft)])           # draft was drawn from q: it is there
        if self.rng.random() * q_d < p_d:                         # probability min(1, p_d / q_d)
            return True, draft
        at = np.searchsorted(q_ids, ids).clip(max=len(q_ids) - 1)
        q_on_p = np.where(q_ids[at] == ids, q_p[at], 0.0)
        r = np.maximum(p - q_on_p, 0.0)
        if r.sum() <= 0.0:
            r = p
        return False, int(ids[self.rng.choice(len(ids), p=r / r.sum())])

    def accept(self, tokens) -> None:
        """The request kept ``tokens`` (the grammar advances by them)."""
        if self.constraints is not None:
            self.constraints.accept(tokens)
        self.history.extend(int(t) for t in tokens)
        if self.sp.mirostat:
            self._mu = [self._mu[len(tokens)]]
