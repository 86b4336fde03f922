"""Replayed acceptance: a proposer that is right exactly as often as a given acceptance profile says.

A random-weight drafter is never right, so speed at a realistic acceptance cannot be measured with
it. The decoder's ``OverrideProposer`` replaces the drafter's proposal *after* the drafter
has run (its cost is paid every step, its cache gets every feature injection); the replacement is
the target's own plain continuation (known from a plain run) cut at a point drawn from the profile:
with ``cum[i] = P(at least i + 1 drafted tokens accepted)`` one uniform draw ``u`` per step gives
``a = #{i : cum[i] > u}`` accepted tokens, so every position's acceptance matches the profile exactly
in expectation. The token at ``a`` is made wrong on purpose (the true token + 1).
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger("dflash_gguf.bench.scale")

# The demo pair's measured per-position acceptance (BENCHMARKS.md section 2: ours, all 19 prompts,
# block 8, k = 1..7); positions 8..15 continue with the last measured conditional rate (0.42 / 0.46).
_DEMO_MEASURED = [0.78, 0.68, 0.61, 0.56, 0.51, 0.46, 0.42]


def _geometric_tail(head: list[float], n: int) -> list[float]:
    out = list(head)
    r = head[-1] / head[-2]
    while len(out) < n:
        out.append(out[-1] * r)
    return out


PROFILES = {
    "demo": _geometric_tail(_DEMO_MEASURED, 15),
    # a strong block-16 drafter: P(a >= i) = 0.885^i, acceptance length 7.46 at 15 drafted tokens
    "strong": [0.885 ** i for i in range(1, 16)],
    "none": [0.0] * 15,
}
DESCRIPTIONS = {
    "demo": "demo pair's measured profile (k=1..7: 0.78 0.68 0.61 0.56 0.51 0.46 0.42; geometric tail for 8..15; "
            "acceptance length 7.30 at 15 drafted)",
    "strong": "strong block-16 profile P(a>=i) = 0.885^i",
    "none": "never-right drafter (every proposal wrong)",
    "demo-dspark": "the DSpark demo drafter's recorded whole blocks (block 8, anchor-first)",
}


def dspark_demo_profile() -> list[float]:
    """P(a >= i), i = 1..8, of the shipped DSpark demo drafter's recorded steps that drafted a whole block
    (``data/demo-dspark/traces.json``: [drafted, accepted, confidences] per step)."""
    doc = json.loads((Path(__file__).resolve().parents[2] / "data" / "demo-dspark" / "traces.json").read_text())
    acc = np.array([a for p in doc["prompts"] for n, a, _ in p["steps"] if n == 8])
    return [round(float((acc >= i).mean()), 4) for i in range(1, 9)]


def parse_profile(spec: str) -> tuple[str, list[float]]:
    """A named profile, ``p1,p2,...`` (P(a >= i) for i = 1..) or a JSON file holding that list."""
    if spec in PROFILES:
        return spec, PROFILES[spec]
    if spec == "demo-dspark":
        return spec, dspark_demo_profile()
    p = Path(spec)
    try:
        vals = json.loads(p.read_text()) if p.is_file() else [float(x) for x in spec.split(",") if x.strip()]
    except (ValueError, OSError) as e:
        raise ValueError(f"acceptance profile {spec!r}: not a profile name ({', '.join(PROFILES)}), a comma list "
                         f"or a JSON list file ({e})") from e
    if isinstance(vals, dict):
        vals = vals.get("per_position_acceptance") or vals.get("profile") or []
    vals = [float(x) for x in vals]
    if not vals or any(not 0.0 <= x <= 1.0 for x in vals) or any(b > a + 1e-9 for a, b in zip(vals, vals[1:])):
        raise ValueError(f"acceptance profile {spec!r} must be a non-increasing list of P(accepted >= i) in [0, 1]")
    return (p.stem if p.is_file() else "custom"), vals


def expected_tau(cum: Sequence[float], n: int) -> float:
    """Expected tokens per step (accepted + the target's own) when drafting ``n`` tokens."""
    return 1.0 + float(sum(list(cum)[:n]))


def block_right_for(ref: Sequence[int], L: int, n: int, a: int, n_vocab: int) -> list[int]:
    """``n`` proposed tokens after ``ref[:L]``: ``ref``'s next ones, the one at ``a`` (if ``a < n``) made
    wrong (past ``ref``'s end: filler, one more than its last token, or 0s), so exactly ``a`` are kept."""
    truth = list(ref[L:L + n])
    truth += [(truth[-1] + 1) % n_vocab if truth else 0] * (n - len(truth))
    if a < n:
        truth[a] = (truth[a] + 1) % n_vocab
    return truth


def reference_for(refs: Sequence[Sequence[int]], ctx: Sequence[int]) -> Sequence[int] | None:
    """The first of ``refs`` that ``ctx`` is a prefix of (None: ``ctx`` left them all)."""
    L = len(ctx)
    # (the last token first: a context that left a reference mostly differs there, and the slice is a copy)
    return next((r for r in refs if L <= len(r) and (not L or r[L - 1] == ctx[-1]) and r[:L] == ctx), None)


def replayed_block(ref: Sequence[int], L: int, n: int, cum: np.ndarray, u: float, n_vocab: int) -> list[int]:
    """``n`` proposed tokens after ``ref[:L]`` of which the first ``a = #{i : cum[i] > u}`` are right."""
    return block_right_for(ref, L, n, int((cum[:n] > u).sum()) if n else 0, n_vocab)


class ReplayBook:
    """A proposal function replaying several references at one profile (a server's requests, each a
    prompt of ``references``' followed by its plain continuation), for any number of sequences at once:
    each call finds the reference the context is a prefix of (one ``u`` drawn per call). A context no reference starts with
    (another prompt, or a continuation that left the reference) gets a wrong block, counted in ``diverged``."""

    def __init__(self, references: Sequence[Sequence[int]], cum: Sequence[float], n_vocab: int, seed: int = 0):
        self.refs = [[int(t) for t in r] for r in references]
        self.cum = np.asarray(cum, dtype=np.float64)
        self.n_vocab = n_vocab
        self.rng = np.random.default_rng(seed)
        self.diverged = 0
        self.steps = 0

    def __call__(self, ctx: list[int], n: int) -> list[int]:
        self.steps += 1
        u = self.rng.random()
        ref = reference_for(self.refs, ctx)
        if ref is not None:
            return replayed_block(ref, len(ctx), n, self.cum, u, self.n_vocab)
        self.diverged += 1
        return [(int(ctx[-1]) + 1) % self.n_vocab] * n


class ReplayProposer(ReplayBook):
    """A proposal function (for ``OverrideProposer``) that replays one ``reference`` (prompt + plain
    continuation) at a profile: a book of one."""

    def __init__(self, reference: Sequence[int], cum: Sequence[float], n_vocab: int, seed: int = 0):
        super().__init__([reference], cum, n_vocab, seed)
