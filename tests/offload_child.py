"""Runs of one pair with layers offloaded to a GPU backend, in a child process (tests/test_offload.py).

The GPU build is another libllama (a build variant, ``LLAMA_CPP_LIB_PATH``), and a fault in a
backend must fail a test, not kill the test run: every run is a child process.

    python tests/offload_child.py SPEC.json OUT.npz

SPEC: {"target", "drafter", "n", "prompt", "runs": [{"ngl", "dngl", "n_rs_seq"?, "rollback"?,
       "seeds"?: [...], "top_k"?, "n"?}], "capi": [{"ngl", "dngl"}]}. Prints one JSON line: per run the plain and
DFlash tokens (greedy, or sampled with the given seeds), the acceptance and where llama.cpp put
the layers (from its log); the C API probes' arrays go to OUT.npz.
"""
from __future__ import annotations

import json
import logging
import re
import sys

import numpy as np

OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
BUFFER = re.compile(r"(\S+) model buffer size")


class _Grab(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record):
        self.seen.append(record.getMessage())

    def take(self) -> dict:
        """Where the models loaded since the last call were placed: offloaded layers and buffer names."""
        off = [f"{m.group(1)}/{m.group(2)}" for s in self.seen for m in [OFFLOADED.search(s)] if m]
        bufs = sorted({m.group(1) for s in self.seen for m in [BUFFER.search(s)] if m})
        self.seen.clear()
        return {"offloaded": off, "buffers": bufs}


def _opts(run: dict):
    from dflash_gguf.native.engine import ContextOptions
    return ContextOptions(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, n_rs_seq=run.get("n_rs_seq", 0))


def _generate(spec: dict, run: dict, grab: _Grab) -> dict:
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, SpecOptions
    from dflash_gguf.native.engine import Context, Model
    from dflash_gguf.decoding.sampling import SamplingParams

    with Model(spec["target"], n_gpu_layers=run["ngl"]) as tm:
        where = {"target": grab.take()}
        dm = Model(spec["drafter"], n_gpu_layers=run["dngl"])
        where["drafter"] = grab.take()
        prompt = tm.tokenize(spec["prompt"].encode())
        o = _opts(run)
        so = SpecOptions(rollback=run.get("rollback", "auto"))
        with dm, Context(tm, o) as pctx, Context(tm, o) as tctx, Context(dm, o, other=tctx) as dctx:
            plain_dec, spec_dec = DFlashDecoder(pctx, None, so), DFlashDecoder(tctx, dctx, so)
            st = GenerationStats()
            out = {"ngl": run["ngl"], "dngl": run["dngl"], "where": where, "plain": [], "dflash": []}
            seeds = run.get("seeds") or [None]
            for seed in seeds:
                sp = None if seed is None else SamplingParams(temperature=1.0, top_k=run.get("top_k", 4),
                                                              top_p=1.0, min_p=0.0, seed=seed)
                n = run.get("n", spec["n"])
                if sp is None:   # sampled runs are checked against the exact distribution instead
                    out["plain"].append(list(plain_dec.generate(prompt, n, stop_tokens=[])))
                out["dflash"].append(list(spec_dec.generate(prompt, n, sampling=sp, stats=st, stop_tokens=[])))
            out.update(drafted=st.drafted, accepted=st.accepted, tau=st.tau)
            if run.get("seeds"):
                out["exact"] = _exact(pctx, prompt, run["n"], run.get("top_k", 4))
    return out


def _exact(ctx, prompt: list[int], k_tokens: int, top_k: int) -> list:
    """P(t1..tK) of sampling at temperature 1 within the top_k, from this context's logits."""
    import itertools

    from dflash_gguf.decoding.sampling import SamplingParams, distribution

    sp = SamplingParams(temperature=1.0, top_k=top_k, top_p=1.0, min_p=0.0)
    out: dict = {}
    for path in itertools.product(range(top_k), repeat=k_tokens):
        prob, prefix = 1.0, list(prompt)
        for j in path:
            ctx.clear()
            ctx.decode(np.array(prefix, np.int32), 0, out_row0=len(prefix) - 1)
            ids, p = distribution(ctx.logits_row(len(prefix) - 1).copy(), sp)
            order = np.argsort(-p, kind="stable")
            prob *= float(p[order[j]])
            prefix.append(int(ids[order[j]]))
        key = tuple(prefix[len(prompt):])
        out[key] = out.get(key, 0.0) + prob
    return [[list(k), v] for k, v in out.items()]


def _capi(spec: dict, run: dict, grab: _Grab, arrays: dict, tag: str) -> dict:
    """The C API directly: prompt argmax ids (llama_dflash_decode), taps (copied, and read straight from
    the graph with a row cap), injection of those rows and of host-kept features, draft ids."""
    from dflash_gguf.native import _bindings as B
    from dflash_gguf.native.engine import Context, Model

    ffi, lib = B.ffi, B.lib
    with Model(spec["target"], n_gpu_layers=run["ngl"]) as tm:
        where = {"target": grab.take()}
        with Model(spec["drafter"], n_gpu_layers=run["dngl"]) as dm:
            where["drafter"] = grab.take()
            toks = np.array(tm.tokenize(spec["prompt"].encode()), dtype=np.int32)
            if run.get("rows"):   # the prompt's tokens repeated to this many rows (at most n_batch, 64)
                toks = np.resize(toks, run["rows"]).astype(np.int32)
            n = len(toks)
            o = _opts(run)
            res: dict = {}
            # each mode on fresh contexts, set before their first decode (as the decoder does);
            # run["same_context"]: every mode on one pair of contexts, switched between decodes
            tctx = dctx = None
            for mode in run.get("modes", ("copy", "direct")):
                if tctx is None or not run.get("same_context"):
                    if tctx is not None:
                        dctx.close(), tctx.close()
                    tctx = Context(tm, o)
                    dctx = Context(dm, o, other=tctx)
                    info = ffi.new("struct llama_dflash_drafter_info *")
                    B.check(lib.llama_dflash_prepare(tctx.cptr, dctx.cptr, info), "prepare")
                    layers = np.array([info.target_layers[i] for i in range(info.n_target_layers)], dtype=np.int32)
                    width = len(layers) * tm.n_embd
                    nd = info.block_size - 1
                cap = run.get("cap", 16) if mode == "direct" else 0
                if mode != "copy":
                    B.check(lib.llama_dflash_set_taps_direct(tctx.cptr, True), "direct taps")
                    B.check(lib.llama_dflash_set_tap_rows_max(tctx.cptr, cap), "tap cap")
                tctx.clear()
                dctx.clear()
                am = np.zeros(n, dtype=np.int32)
                B.check(lib.llama_dflash_decode(tctx.cptr, 0, 0, ffi.from_buffer("llama_token[]", toks), n, 0,
                                                ffi.from_buffer("llama_token[]", am)), "decode")
                rows = lib.llama_dflash_tap_rows(tctx.cptr)
                r0 = n - cap if cap else 0
                taps = np.zeros((n - r0, width), dtype=np.float32)
                B.check(lib.llama_dflash_get_taps(tctx.cptr, ffi.from_buffer("int32_t[]", layers), len(layers), r0,
                                                  n - r0, ffi.from_buffer("float[]", taps), taps.size), "get_taps")
                logits = np.stack([np.frombuffer(ffi.buffer(lib.llama_get_logits_ith(tctx.cptr, i), 4 * tm.n_vocab),
                                                 dtype=np.float32) for i in range(n)])
                # injection of the target's rows, then a draft after the prompt's last token
                B.check(lib.llama_dflash_inject(dctx.cptr, tctx.cptr, 0, r0, r0, n - r0), "inject")
                d1 = np.zeros(nd, dtype=np.int32)
                B.check(lib.llama_dflash_draft(dctx.cptr, 0, n, int(am[-1]), nd, ffi.from_buffer("llama_token[]", d1)),
                        "draft")
                # the same features kept on the host and injected by llama_dflash_inject_features
                dctx.clear()
                B.check(lib.llama_dflash_inject_features(dctx.cptr, 0, r0, ffi.from_buffer("float[]", taps), n - r0,
                                                         taps.size), "inject_features")
                d2 = np.zeros(nd, dtype=np.int32)
                B.check(lib.llama_dflash_draft(dctx.cptr, 0, n, int(am[-1]), nd, ffi.from_buffer("llama_token[]", d2)),
                        "draft after inject_features")
                got = {"argmax": am, "taps": taps, "logits": logits, "draft": d1, "draft_features": d2}
                if info.kind == 2 and info.selector_top_k:   # DFlash2: the selector's lattice, read on the host
                    k = info.selector_top_k
                    lat = np.zeros(nd * (k + k * k), dtype=np.float32)
                    B.check(lib.llama_dflash_draft_lattice(dctx.cptr, 0, n, int(am[-1]), nd,
                                                           ffi.from_buffer("float[]", lat), lat.size), "lattice")
                    got["lattice"] = lat
                for k, v in got.items():
                    arrays[f"{tag}-{mode}-{k}"] = v
                res[mode] = {"tap_rows": rows, "row0": r0}
            dctx.close(), tctx.close()
    return {"ngl": run["ngl"], "dngl": run["dngl"], "where": where, "modes": res}


def _main(spec_file: str, out_file: str) -> None:
    from dflash_gguf.native.logs import set_log_handler

    spec = json.load(open(spec_file))
    grab = _Grab()
    logger = logging.getLogger("offload-child")
    logger.addHandler(grab)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    set_log_handler(logger)
    arrays: dict = {}
    out = {"runs": [_generate(spec, r, grab) for r in spec.get("runs", [])],
           "capi": [_capi(spec, r, grab, arrays, str(i)) for i, r in enumerate(spec.get("capi", []))]}
    np.savez(out_file, **arrays)
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
