"""The speed gate's acceptance history, kept per pair: a new decoder of the same pair starts from it.

A fresh gate knows this machine's step costs (:mod:`.calibration`) but not how often the drafter is
right, so a ``Llama``'s first call spends its first steps on short probing blocks and then plans on a
few draws (:class:`dflash_gguf.decoding.gate.DraftLength`). How often a drafter is right is the pair's, not the
machine's or the process's: it is kept under ``$DFLASH_GGUF_CACHE/acceptance`` by both model files
(path, size, mtime) and the block length, one history for greedy and one for sampled requests, and
the next decoder of the pair starts planning from it. Kept at most ``KEEP_DRAWS`` draws deep, so that
a history from other prompts gives way to what this one's steps show within a few blocks.
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from dflash_gguf import paths
from dflash_gguf.decoding.gate import DraftLength

log = logging.getLogger("dflash_gguf.decoding")

FORMAT = 1
KEEP_DRAWS = 32     # the deepest a kept history starts (draws of the first position)


class _Model(Protocol):
    path: Path


class _Context(Protocol):
    model: _Model


class Pair(Protocol):
    """What the history uses of a decoder (the decoder passes itself): the model files and block length
    it is kept by. Stated here, in shapes that need no native library, so that the decoder depends on
    the history and never the other way round."""

    n_draft: int
    target: _Context
    drafter: _Context


def history_file(decoder: Pair) -> Path:
    ident = {"format": FORMAT, "target": paths.file_identity(decoder.target.model.path),
             "drafter": paths.file_identity(decoder.drafter.model.path), "n_draft": decoder.n_draft}
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return paths.cache_dir() / "acceptance" / f"{key}.json"


def recall(decoder: Pair, gates: dict[str, DraftLength | None]) -> None:
    """Start each of ``gates`` ("greedy", "sampled") from the pair's kept history, where there is one."""
    try:
        data = json.loads(history_file(decoder).read_text())
    except (OSError, ValueError):
        return
    for name, gate in gates.items():
        h = data.get(name)
        if gate is None or not isinstance(h, dict):
            continue
        try:
            hits, tries = np.asarray(h["hits"], dtype=float), np.asarray(h["tries"], dtype=float)
            gate.start_from(hits, tries)
        except (KeyError, TypeError, ValueError) as e:
            log.debug("ignoring a kept %s acceptance history: %s", name, e)


def kept(gate: DraftLength) -> tuple[np.ndarray, np.ndarray]:
    """What is kept of ``gate``'s acceptance: its history, at most KEEP_DRAWS draws deep."""
    scale = min(1.0, KEEP_DRAWS / float(gate.tries[0])) if gate.tries[0] > 0 else 1.0
    return (gate.hits * scale).round(3), (gate.tries * scale).round(3)


def keep(decoder: Pair, gates: dict[str, DraftLength | None]) -> None:
    """Write the pair's history: each gate's acceptance once it has drawn enough to plan on (a gate that
    has not keeps what was there). Written whole or not at all."""
    f = history_file(decoder)
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError):
        data = {}
    changed = False
    for name, gate in gates.items():
        if gate is None or gate.tries[0] < DraftLength.FEW_DRAWS:
            continue
        hits, tries = kept(gate)
        data[name] = {"hits": hits.tolist(), "tries": tries.tolist()}
        changed = True
    if not changed:
        return
    try:
        paths.write_json(f, data)
    except OSError as e:       # a read-only cache: the next decoder warms up again, nothing else changes
        log.debug("could not keep the acceptance history in %s: %s", f, e)
