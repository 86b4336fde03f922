"""Run inside the emulated aarch64 CPython by tests/test_arm64.py: our DFlash loop on a GGUF pair.

Prints one JSON object: the DFlash tokens, the plain tokens from the same loop (``--plain``), two
sampled runs with one seed (``--sample-seed``), the acceptance statistics, the machine as the guest
sees it, and ggml's own log lines about KleidiAI kernel selection and weight buffers (captured
through :func:`dflash_gguf.native.logs.set_log_handler`).
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import sys
import time

KEEP = re.compile(r"kleidiai|KLEIDIAI|REPACK|model buffer size|CPU :", re.I)


class Grab(logging.Handler):
    """Keeps the log lines that match ``keep`` (ggml's own, through llama_cpp's logger)."""

    def __init__(self, keep: re.Pattern = KEEP):
        super().__init__(logging.DEBUG)
        self.keep = keep
        self.lines: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if self.keep.search(msg):
            self.lines.append(msg.strip())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--prompt", required=True)
    ap.add_argument("-n", type=int, default=24)
    ap.add_argument("--n-draft", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help="also decode plainly with the same loop")
    ap.add_argument("--sample-seed", type=int, default=None,
                    help="also sample twice with this seed (temperature 0.8, top-k 20), each from a fresh state")
    a = ap.parse_args(argv)

    grab = Grab()
    logger = logging.getLogger("guest.llama_cpp")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    logger.addHandler(grab)
    t0 = time.perf_counter()
    from dflash_gguf.native.logs import set_log_handler
    set_log_handler(logger)
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, SpecOptions
    from dflash_gguf.decoding.sampling import SamplingParams
    t_import = time.perf_counter() - t0

    tm, dm = Model(a.target), Model(a.drafter)
    tc = Context(tm, ContextOptions(n_ctx=a.n_ctx, n_threads=a.threads))
    dc = Context(dm, ContextOptions(n_ctx=a.n_ctx, n_threads=a.threads), other=tc)
    dec = DFlashDecoder(tc, dc, SpecOptions(n_draft=a.n_draft))
    prompt = tm.tokenize(a.prompt.encode())
    st = GenerationStats()
    t1 = time.perf_counter()
    dflash = list(dec.generate(prompt, a.n, stats=st))
    t_dflash = time.perf_counter() - t1
    plain = None
    if a.plain:
        dec.reset()
        plain = list(dec.generate(prompt, a.n, use_draft=False))
    sampled = []
    if a.sample_seed is not None:
        sp = SamplingParams(temperature=0.8, top_k=20, seed=a.sample_seed)
        for _ in range(2):
            dec.reset()
            sampled.append(list(dec.generate(prompt, a.n, sampling=sp)))
    out = {"machine": platform.machine(), "python": sys.version.split()[0], "dflash": dflash, "plain": plain,
           "sampled": sampled,
           "text": tm.detokenize(dflash).decode("utf-8", "replace"), "tau": st.tau, "steps": st.steps,
           "seconds": {"import": round(t_import, 2), "dflash": round(t_dflash, 2)}, "log": grab.lines}
    dc.close(), tc.close(), dm.close(), tm.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
