"""This machine's cost of a DFlash step, measured once per pair and kept: the speed gate's prior.

The speed gate (:class:`dflash_gguf.decoding.gate.DraftLength`) picks the draft length with the most expected
tokens per second, which needs what a step of each length costs here. Without a prior it learns the
costs in its first steps (two full blocks, two plain steps, half a block, a full one): every new
decoder - every demo run, every benchmark prompt, the first call of a ``Llama`` - pays that warm-up,
and a drafter that is never right costs two full blocks before the gate gives up. With a prior the
gate only has to see the drafter's acceptance: short blocks (1-4 tokens, as many as cost about what
one does) until one is right, at most two, then the plan (a never-right drafter: plain decoding from
the third step, probes spaced by their measured cost; a good one: full blocks).

:func:`step_costs` measures the prior through the decoder's own loop, so it is charged exactly what
the gate is charged (draft, verify, acceptance, keeping the rows, rollback): a fixed schedule of
lengths (plain, 1, 2, 4, 8, half and the whole block), each drafted in a run of steps in each of
``ROUNDS`` rounds, the median of every run's last ``COUNTED`` steps; lengths in between are
interpolated. A run's first steps pay for the switch from the length before it: on the demo pair (2
Zen 4 cores) the first plain step after a drafting block or a prefill costs twice what plain steps
cost once settled, the next few 10-50% more, while a drafting block settles after one step - so plain
runs are longer (``WARM``). A prior that took the first plain step for plain decoding's cost had the
gate keep drafting where plain was faster. The gate, too, counts only steps that follow a step of the
same length (:mod:`dflash_gguf.decoding.gate`). At the 1.7B Qwen3 shape (Q4_0, 2 threads) that is 64 steps
(28 of them plain), about 5 s (0.6B: 2.4 s). The result is cached under
``$DFLASH_GGUF_CACHE/calibration`` by everything it depends on: both model files (path, size,
mtime), block length, threads, batch sizes, the CPU (model name and flags), the kernel switches ggml
reads (``GGML_CPU_X86MM``, ``GGML_CPU_AMX``), the patch series and this package's version. The gate
keeps refining each cost from real steps (the context grows, the machine gets busy), so the prior only
has to be right enough to start. A prior measured while the machine was busy (a build on the other
core) would start every later decoder wrong, though: :func:`check_prior` marks the cached file stale once
a gate's own plain steps cost under ``STALE`` x the prior's plain step (real steps run at longer
contexts, so they cost more than the calibration's, not less), and the pair's next decoder measures
again - once: a prior measured a second time that still reads too dear is rescaled to the gate's plain
steps rather than measured by every decoder.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from dflash_gguf.native import _bindings as B
from dflash_gguf import paths
from dflash_gguf.kernels.cpu import cpu_flags, cpu_model
from dflash_gguf.decoding.proposer import DrafterProposer, Proposer
from dflash_gguf.native.engine import Context
from dflash_gguf.decoding.gate import DraftLength
from dflash_gguf.decoding.batch_costs import batch_prior
from dflash_gguf.native.threads import run_in_own_thread

log = logging.getLogger("dflash_gguf.decoding")

ROUNDS = 2                         # rounds of the schedule
COUNTED = 2                        # steps counted per run of a length ...
WARM = DraftLength.SETTLE          # ... after this many (default 1): the steps the gate leaves out too
SPREAD = 1.5                       # a length whose rounds differ by more than this (max / min) is unsteady
UNSTEADY = 1 / 3                   # ... and a measurement with more such lengths than this share is not kept
STALE = DraftLength.PLAIN_DOUBT    # a gate's plain steps under this x the prior's: the prior was measured busy
FORMAT = 2                         # how the costs are measured and kept (2: runs, first steps left out)
# a neutral prompt: the costs do not depend on what is drafted, only on how many rows
PROMPT = b"The quick brown fox jumps over the lazy dog. " * 4
# ggml's run-time switches for the kernels that decide these costs
KERNEL_ENV = ("GGML_CPU_X86MM", "GGML_CPU_AMX", "GGML_CPU_TILED_MM", "GGML_KLEIDIAI_SME")


class Measured(Protocol):
    """What the calibration uses of a decoder (the decoder passes itself): its pair and block length,
    which key the cache, and its own loop, run with a fixed schedule standing in for its gate and the
    drafter's own proposals for its proposer. Stated here so that the decoder depends on the calibration
    and never the other way round."""

    n_draft: int
    target: Context
    drafter: Context
    gate: Any               # a DraftLength, or the calibration's _Schedule while it measures
    proposer: Proposer

    def generate(self, prompt: Sequence[int], max_tokens: int, *, stop_tokens: Sequence[int] | None = None
                 ) -> Iterator[int]: ...

    def reset(self) -> None: ...


def schedule_lengths(n_max: int) -> list[int]:
    """The draft lengths the calibration measures (the others are interpolated)."""
    return sorted({0, n_max, max(1, n_max // 2), *(n for n in (1, 2, 4, 8) if n <= n_max)})


class _Schedule:
    """Stands in for the gate during calibration: a fixed sequence of runs of lengths, the last
    ``COUNTED`` steps of every run recorded."""

    probing = False   # every step drafts its length for every sequence (no acceptance probes)

    def __init__(self, lengths: list[int], rounds: int):
        self.plan: list[int] = []
        self.counted: list[bool] = []
        for _ in range(rounds):
            for n in lengths:
                warm = WARM.get(n, 1)
                self.plan += [n] * (warm + COUNTED)
                self.counted += [False] * warm + [True] * COUNTED
        self.i = 0
        self.seen: dict[int, list[float]] = {}

    @property
    def done(self) -> bool:
        return self.i >= len(self.plan)

    def new_run(self, after=None) -> None:
        pass

    def choose(self) -> int:
        return self.plan[self.i] if self.i < len(self.plan) else 0

    def record(self, n: int, accepted: int, seconds: float | None, same_step: bool = False, batch: int = 1,
               verified: int | None = None) -> None:
        if self.i < len(self.plan) and not same_step:
            # n is cut short only at the context's end (no confidence cuts the schedule's blocks: verify_rows)
            if self.counted[self.i] and n == self.plan[self.i] and seconds is not None:
                self.seen.setdefault(n, []).append(seconds)
            self.i += 1


def measure(decoder: Measured, rounds: int) -> tuple[np.ndarray, bool] | None:
    """Seconds of one step drafting n = 0..n_draft tokens on this decoder's contexts (clears their
    caches), and whether the rounds agreed (a busy machine - another process, a build - shows as
    rounds of one length far apart); None when the target's context is too small for the schedule."""
    n_max = decoder.n_draft
    lengths = schedule_lengths(n_max)
    sched = _Schedule(lengths, rounds)
    prompt = decoder.target.model.tokenize(PROMPT)
    saved = decoder.gate, decoder.proposer
    # the drafter's own proposals: a caller's proposer (an oracle, a replay) may not know this prompt
    decoder.gate, decoder.proposer = sched, DrafterProposer()
    try:
        budget = sum(n + 1 for n in sched.plan) + 1
        for _ in decoder.generate(prompt, budget, stop_tokens=[]):
            if sched.done:
                break
    finally:
        decoder.gate, decoder.proposer = saved
        decoder.reset()
    known = {n: float(np.median(v)) for n, v in sched.seen.items() if v}
    if not sched.done or 0 not in known or n_max not in known:
        return None
    xs = sorted(n for n in known if n >= 1)
    costs = np.empty(n_max + 1)
    costs[0] = known[0]
    costs[1:] = np.interp(np.arange(1, n_max + 1), xs, [known[n] for n in xs])
    return tidy(costs), steady(sched.seen)


def tidy(costs: np.ndarray) -> np.ndarray:
    """Step costs n = 0..n_max with drafting steps non-decreasing in n and none below a plain step
    (:func:`monotone`); what is measured and what is read from the cache alike."""
    out = np.array(costs, dtype=float)
    if len(out) > 1:
        out[1:] = np.maximum(monotone(out[1:].tolist()), out[0])
    return out


def monotone(values: list[float]) -> np.ndarray:
    """The closest non-decreasing sequence to ``values`` (least squares; pool adjacent violators).

    A step drafting more tokens does the same work and more, so its cost cannot be lower; a median that
    says otherwise is noise (a 0.6B-shaped pair measured one drafted token at 37.7 ms and three at 28.6
    on a busy VM), and a prior with a one-token step cheaper than a longer one, or than a plain step,
    would have a gate draft on its word alone."""
    blocks: list[list[float]] = []      # [mean, weight]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1), (m2, w2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2]
    return np.array([m for m, w in blocks for _ in range(int(w))])


def steady(seen: dict[int, list[float]]) -> bool:
    """Rounds that agree: at most UNSTEADY of the lengths with rounds more than SPREAD apart."""
    spread = [max(v) / min(v) for v in seen.values() if len(v) > 1 and min(v) > 0]
    return sum(s > SPREAD for s in spread) <= UNSTEADY * len(spread)


def _cpu_id() -> str:
    return (cpu_model() or "") + ";" + hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]


def cache_key(decoder: Measured) -> str:
    from dflash_gguf import __version__

    t, d = decoder.target, decoder.drafter
    ident = {
        "format": FORMAT, "version": __version__, "build": B.BUILD_STAMP,   # the loaded library's patch series
        "target": paths.file_identity(t.model.path), "drafter": paths.file_identity(d.model.path), "n_draft": decoder.n_draft,
        "threads": t.opts.n_threads or os.cpu_count(), "n_ubatch": [t.n_ubatch, d.n_ubatch],
        "flash_attn": t.opts.flash_attn, "cpu": _cpu_id(), "env": {k: os.environ.get(k) for k in KERNEL_ENV},
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def cache_file(key: str) -> Path:
    return paths.cache_dir() / "calibration" / f"{key}.json"


def step_costs(decoder: Measured) -> np.ndarray | None:
    """The cached cost prior of this decoder's pair on this machine, measured now if there is none
    (None, and nothing cached, where the target's context cannot hold the schedule's steps)."""
    key = cache_key(decoder)
    f = cache_file(key)
    measured_before = 0
    if f.exists():
        try:
            data = json.loads(f.read_text())
            if data.get("stale"):
                measured_before = int(data.get("measured", 1))   # dropped by check_prior: measure again
            else:
                costs = np.asarray(data["costs"], dtype=float)
                if len(costs) == decoder.n_draft + 1 and np.isfinite(costs).all() and (costs > 0).all():
                    return tidy(costs)   # files written before costs were tidied may not be
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if not measured_before:
            log.warning("ignoring an unreadable calibration file %s", f)
    # on a thread of its own, which ends with it: a decoder is often built on a thread that never decodes
    # again (a server's main thread), whose OpenMP pool would slow every other thread's decodes for good
    log.info("measuring DFlash step costs of %s + %s on this machine (once; cached)",
             decoder.target.model.path.name, decoder.drafter.model.path.name)
    t0 = time.perf_counter()
    got = run_in_own_thread(measure, decoder, ROUNDS, name="dflash-calibration")
    if got is not None and not got[1]:
        log.info("step costs unsteady (the machine is busy?): measuring again")
        got = run_in_own_thread(measure, decoder, ROUNDS, name="dflash-calibration")
    seconds = time.perf_counter() - t0
    if got is None:
        log.info("no step-cost prior: the target's context (%d) is too small for the calibration's steps; "
                 "the speed gate measures costs as it decodes", decoder.target.n_ctx)
        return None
    costs, ok = got
    if not ok:
        # good enough to start this decoder (its gate refines every cost it uses), not to keep
        log.warning("step costs still unsteady after a second measurement (%.1f s): used for now, not cached; "
                    "the next decoder measures again", seconds)
        return costs
    paths.write_json(f, {"costs": costs.tolist(), "seconds": round(seconds, 3), "measured": measured_before + 1,
                         "target": decoder.target.model.path.name, "drafter": decoder.drafter.model.path.name})
    log.info("step costs measured in %.1f s: plain %.2f ms, full block (%d) %.2f ms", seconds,
             costs[0] * 1e3, decoder.n_draft, costs[-1] * 1e3)
    return costs


def prior_is_stale(prior: np.ndarray, gate: DraftLength) -> bool:
    """Whether ``gate``'s steady plain steps (no longer the prior's word: :meth:`DraftLength.record`)
    cost under STALE x what the prior says a plain step costs (a batch size's gate: a sequence's share of
    such a step, :func:`.batch_costs.batch_prior`)."""
    return bool(0 not in gate._prior and np.isfinite(gate.cost[0]) and gate.cost[0] < STALE * _plain(prior, gate))


def _plain(prior: np.ndarray, gate: DraftLength) -> float:
    """What ``prior`` (one sequence's step costs) says a plain step of ``gate``'s costs per sequence."""
    return float(prior[0] if gate.batch == 1 else batch_prior(prior, gate.batch)[0])


def check_prior(decoder: Measured, prior: np.ndarray, gate: DraftLength) -> bool:
    """After a generation: mark this pair's cached prior stale if ``gate`` shows it was measured on a
    busier machine (:func:`prior_is_stale`); the next decoder measures again. A prior is measured again so
    once (a pair whose calibration always reads dearer than its real steps would otherwise be measured by
    every decoder): one measured again that still reads too dear is rescaled instead, every length's cost
    by what the gate's own plain steps cost against the prior's plain step (the prior's shape, this
    machine's scale: a second measurement on a busy machine must not plan short blocks for good). Returns
    True once the check is done for this decoder."""
    if not prior_is_stale(prior, gate):
        return False
    f = cache_file(cache_key(decoder))
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        return True                         # not cached (unsteady, or dropped by another decoder)
    cached = np.asarray(data.get("costs", []), dtype=float)
    if data.get("stale") or cached.shape != prior.shape or not np.allclose(cached, prior):
        return True                         # dropped or changed by another decoder: not this decoder's prior
    plain = _plain(prior, gate)
    if int(data.get("measured", 1)) > 1:
        scale = gate.cost[0] / plain
        log.info("plain steps cost %.2f ms here, the prior measured again says %.2f ms: every length's cost "
                 "scaled by %.2f", gate.cost[0] * 1e3, plain * 1e3, scale)
        paths.write_json(f, {**data, "costs": tidy(prior * scale).tolist(),
                             "rescaled": int(data.get("rescaled", 0)) + 1})
        return True
    log.info("plain steps cost %.2f ms here, the cached prior says %.2f ms (measured while the machine was "
             "busy?): the next decoder of this pair measures again", gate.cost[0] * 1e3, plain * 1e3)
    paths.write_json(f, {"stale": True, "measured": int(data.get("measured", 1))})
    return True
