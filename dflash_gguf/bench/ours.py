"""Our columns: plain and DFlash through :class:`dflash_gguf.decoding.DFlashDecoder`, the n_draft sweep,
the CPU cost profile and the near-tie diagnosis."""
from __future__ import annotations

import logging
import statistics
import time

from dflash_gguf.bench.results import ModeResult, _add_stats, _r

log = logging.getLogger("dflash_gguf.bench")


def run_ours(dec, prompts: list[dict], ids: list[list[int]], max_tokens: int, res: ModeResult, model,
             record: bool) -> float:
    """One trial of one mode: every prompt once from an empty cache. Returns tokens/s."""
    from dflash_gguf.decoding import GenerationStats

    n_tok, t_dec = 0, 0.0
    for p, tok_ids in zip(prompts, ids):
        dec.reset()
        st = GenerationStats()
        got = list(dec.generate(tok_ids, max_tokens, stats=st))
        n_tok += st.n_generated
        t_dec += st.t_total - st.t_prefill
        _add_stats(res, st)
        key = f"{p['set']}/{p['name']}"
        if record:
            res.tokens[key] = got
            res.texts[key] = model.detokenize(got).decode("utf-8", "replace")
            res.raw[key] = model.detokenize(got, special=True)
        pp = res.per_prompt.setdefault(key, {"tps": [], "n_prompt": len(tok_ids)})
        pp["tps"].append(_r(st.tokens_per_second))
        if st.steps:
            pp["acceptance_length"] = _r(st.tau, 3)
    tps = n_tok / t_dec if t_dec > 0 else 0.0
    res.trial_tps.append(tps)
    return tps





def top2_gap(tctx, prefix: list[int]) -> float | None:
    """The target's top-2 logit gap for the token after ``prefix``, decoded one row at a time at the end."""
    import numpy as np

    try:
        tctx.clear()
        body = np.asarray(prefix[:-1], dtype=np.int32)
        for off in range(0, len(body), tctx.n_batch):
            tctx.decode(body[off:off + tctx.n_batch], off)
        tctx.decode(np.asarray(prefix[-1:], dtype=np.int32), len(body), out_row0=0)
        row = np.sort(tctx.logits_row(0))
        return float(row[-1] - row[-2])
    except Exception as e:  # noqa: BLE001 - a diagnosis, never a reason to fail the benchmark
        log.debug("top-2 gap not measured: %s", e)
        return None
    finally:
        tctx.clear()


# --------------------------------------------------------------------------- sweep and profile
def sweep(tctx, dctx, model, prompts, ids, max_tokens, trials, plain_tps: float) -> list[dict]:
    from dflash_gguf.decoding import DFlashDecoder, SpecOptions

    rows = []
    probe = DFlashDecoder(tctx, dctx)
    B = probe.info.block_size
    for n in range(1, B):
        dec = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n))
        res = ModeResult(f"dflash-n{n}")
        for _ in range(trials):
            run_ours(dec, prompts, ids, max_tokens, res, model, record=False)
        s = res.summary()
        med = s["tokens_per_second"]["median"]
        rows.append({"n_draft": n, "block": n + 1, "tokens_per_second": s["tokens_per_second"],
                     "acceptance_length": s.get("acceptance_length"), "accept_rate": s.get("accept_rate"),
                     "speedup_vs_plain": _r(med / plain_tps, 3) if plain_tps else None})
        log.info("sweep n_draft=%d: %.1f tok/s, tau %.2f", n, med, s.get("acceptance_length") or 0)
    return rows


def profile(tctx, dctx, prompt_ids: list[int], repeats: int = 15, max_rows: int = 16) -> dict:
    """Verify cost vs rows and draft cost vs block length, at a position just past a real prompt."""
    import numpy as np

    from dflash_gguf.native import _bindings as B
    from dflash_gguf.decoding import DFlashDecoder

    dec = DFlashDecoder(tctx, dctx)
    toks = list(dec.generate(prompt_ids, 1))   # prompt in both caches ...
    dec.features.flush()                       # ... and its features in the drafter (kept on the host till now)
    pos = len(prompt_ids)
    pending = toks[-1]
    rng = np.random.default_rng(0)
    rows_max = min(max_rows, tctx.n_batch)
    verify_ms, verify_ms_logits, verify_min = {}, {}, {}
    for rows in range(1, rows_max + 1):
        batch = np.concatenate([[pending], rng.integers(3, tctx.model.n_vocab, rows - 1)]).astype(np.int32)
        am = np.zeros(rows, dtype=np.int32)
        for store, kw in ((verify_ms, {"out_row0": 0, "argmax": am}), (verify_ms_logits, {"out_row0": 0})):
            ts = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                tctx.decode(batch, pos, **kw)
                ts.append(time.perf_counter() - t0)
                tctx.truncate(pos)
            store[rows] = _r(statistics.median(ts[1:]) * 1000, 4)
            if store is verify_ms:
                verify_min[rows] = _r(min(ts[1:]) * 1000, 4)
    draft_ms, draft_min = {}, {}
    buf = np.zeros(64, dtype=np.int32)
    bs = dec.info.block_size
    for n in range(1, bs):
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            B.check(B.lib.llama_dflash_draft(dctx.cptr, 0, pos, pending, n, B.ffi.from_buffer("llama_token[]", buf)),
                    "drafting")
            ts.append(time.perf_counter() - t0)
        draft_ms[n] = _r(statistics.median(ts[1:]) * 1000, 4)
        draft_min[n] = _r(min(ts[1:]) * 1000, 4)
    # a DFlash step with n drafts costs draft(n) + verify(n+1); plain costs verify(1) per token, so the
    # step pays off once it commits more than (draft(n) + verify(n+1)) / verify(1) tokens on average.
    # Computed from the fastest call of each kind (the least disturbed by other load on the machine).
    break_even = {n: _r((draft_min[n] + verify_min[n + 1]) / verify_min[1], 3)
                  for n in draft_min if n + 1 in verify_min}
    dec.reset()
    return {"position": pos, "repeats": repeats, "verify_ms_argmax": verify_ms, "verify_ms_argmax_min": verify_min,
            "verify_ms_full_logits": verify_ms_logits, "draft_ms": draft_ms, "draft_ms_min": draft_min,
            "break_even_acceptance_length": break_even,
            "note": "ms per call, median (and min) of the repeats; verify = one target decode of N rows (greedy "
                    "argmax in C vs all logits rows copied out); draft = one drafter call proposing N tokens; "
                    "break-even from the minima"}

