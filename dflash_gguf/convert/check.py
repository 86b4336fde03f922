"""``--check``: load a converted pair with the engine and prove speculative decoding is lossless on it.

Loads both GGUFs, checks the drafter metadata against ``pair.json``, then decodes a few tokens
plainly and with the drafter and compares them token for token.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from dflash_gguf.errors import ManifestError
from dflash_gguf.pair import load_manifest

log = logging.getLogger("dflash_gguf.convert")

DEFAULT_PROMPT = b"def parse_args(argv):\n    parser = argparse.ArgumentParser("


@dataclass
class CheckResult:
    ok: bool
    message: str                        # the one-line verdict
    n_tokens: int = 0
    first_mismatch: int | None = None
    acceptance_length: float = 0.0
    draft_vocab: int | None = None      # rows of the drafter's own reduced head (None: the full shared head)


def check_pair(pair_dir: str | os.PathLike, *, n_tokens: int = 32, prompt: bytes = DEFAULT_PROMPT,
               threads: int | None = None, verify: bool = True) -> CheckResult:
    """Check a pair directory; never raises for a bad pair, the verdict says what is wrong."""
    name = Path(pair_dir).name or str(pair_dir)
    try:
        m = load_manifest(pair_dir, verify=verify)
    except ManifestError as e:
        return CheckResult(False, f"FAIL {name}: {e}")
    from dflash_gguf.errors import DFlashError

    try:
        return _run(m, name, n_tokens, prompt, threads)
    except (DFlashError, OSError, ValueError) as e:
        return CheckResult(False, f"FAIL {name}: {e}")


def _run(m, name: str, n_tokens: int, prompt: bytes, threads: int | None) -> CheckResult:
    from dflash_gguf.convert import draft_vocab
    from dflash_gguf.native.engine import ContextOptions, Model
    from dflash_gguf.pair import compare_with_plain, open_pair

    with Model(m.target.path) as probe:
        tm_vocab = probe.n_vocab
        tokens = probe.tokenize(prompt, add_bos=True)
    n_ctx = max(256, len(tokens) + n_tokens + 2 * m.block_size + 16)
    opts = ContextOptions(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads)
    with open_pair(m.target.path, m.drafter.path, opts) as pair:
        dec = pair.decoder()
        problem = _metadata_problem(m, dec.info) or draft_vocab.check_manifest(m, m.drafter.path)
        if problem:
            return CheckResult(False, f"FAIL {name}: {problem}")
        c = compare_with_plain(pair, tokens, n_tokens, decoder=dec, stop_tokens=[])
    spec, plain, tau = c.spec, c.plain, c.stats.tau
    if not c.equal:
        i = c.first_mismatch
        got = spec[i] if i < len(spec) else "end"
        want = plain[i] if i < len(plain) else "end"
        return CheckResult(False, f"FAIL {name}: speculative output differs from plain decoding at token {i} "
                                  f"({got} vs {want}): the engine is not lossless on this pair",
                           n_tokens=len(spec), first_mismatch=i, acceptance_length=tau)
    dv = (m.data.get("draft_vocab") or {}).get("size")
    head = f"draft head {dv} of {tm_vocab} tokens" if dv else "full draft head"
    return CheckResult(True, f"PASS {name}: {len(spec)} tokens with the {m.kind} drafter equal plain decoding "
                             f"(target {m.target.type}, drafter {m.drafter.type}, block {m.block_size}, {head}, "
                             f"acceptance length {tau:.2f})", n_tokens=len(spec), acceptance_length=tau,
                       draft_vocab=dv)


def _metadata_problem(m, info) -> str | None:
    if info is None:
        return "the drafter could not be paired with the target"
    checks = (("kind", m.kind, info.kind), ("block_size", m.block_size, info.block_size),
              ("target_layers", m.target_layers, info.target_layers), ("mask token", m.mask_token_id, info.mask_token))
    for what, want, got in checks:
        if want != got:
            return f"drafter GGUF {what} is {got}, pair.json says {want}: the files do not belong together"
    return None
