"""Step costs of a batch of sequences, from one sequence's: the prior of each batch size's speed gate.

A server's batch changes size as requests join and leave; each size has its own gate
(:class:`dflash_gguf.decoding.gate.DraftLength`), whose costs are that size's to measure. The calibration
(:mod:`dflash_gguf.decoding.calibration`) measures one sequence's steps; :func:`batch_prior` scales
them by the rows a step of b sequences decodes, so a new batch size's gate starts from a model of its
costs instead of a warm-up of full blocks.
"""
from __future__ import annotations

import numpy as np


def batch_prior(costs: np.ndarray, b: int) -> np.ndarray:
    """A cost prior per sequence for steps of ``b`` sequences, from one sequence's step costs
    (``costs[n]``: a step drafting n tokens, n + 1 verify rows and one drafter call): a step of b
    sequences drafting n each verifies R = b (n + 1) rows and calls the drafter on b blocks. Its verify
    is costed as one sequence's step of R rows where the calibration measured one (R <= n_max + 1), less
    that step's drafter call, else as its full block's verify, growing with the rows (a CPU verify is
    compute-bound there); its drafter call b times one sequence's (each block is a block of rows, and
    beyond one block the drafter's rows are compute-bound too); a plain step runs no drafter. Each
    sequence is charged a b-th. Drafting then looks costlier as the batch grows, as it is on a CPU;
    the batch's gate refines each cost it uses from its own steps."""
    costs = np.asarray(costs, dtype=float)
    n_max = len(costs) - 1
    # the drafter's call: what one drafted token adds to a plain step (a second verify row costs next to
    # nothing where one row is bound by the weights)
    call = max(costs[1] - costs[0], 0.0) if n_max >= 1 else 0.0
    rows = b * (np.arange(n_max + 1) + 1)
    verify = np.where(rows <= n_max + 1, costs[np.minimum(rows, n_max + 1) - 1] - call,
                      (costs[n_max] - call) * rows / (n_max + 1))
    whole = verify + b * call * (np.arange(n_max + 1) > 0)
    # never below one sequence's plain step, the batch's whole step (at b = 1 the one-row entry came out
    # less a drafter call that step never made: this gives it back)
    whole[0] = max(whole[0], costs[0])
    return whole / b
