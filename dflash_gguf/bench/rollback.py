"""Rollback memory and speed on a hybrid (recurrent) target: snapshots vs checkpoint-and-replay.

``python -m dflash_gguf.bench.rollback --target T.gguf --drafter D.gguf [--blocks 4,8,16]``

For each block size (``n_draft = block - 1``) it creates the target context twice: with
``n_rs_seq = n_draft`` (llama.cpp keeps a snapshot of the recurrent state per drafted token and
rolls back in place) and with ``n_rs_seq = 0`` (one host copy of the state per step, restored and
the committed rows re-decoded after a rejection). It reports llama.cpp's recurrent-state buffer for
each (from its log), one state copy, the extra memory of each kind, decode speed with the pair's
drafter (random drafters reject almost everything: every step rolls back, the worst case for a
checkpoint) and which kind ``rollback_memory_mb`` caps would choose. ``examples/make_gdn_pair.py``
writes a pair whose state has a released model's size.
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
import time

log = logging.getLogger("dflash_gguf.bench.rollback")
_RS = re.compile(r"RS buffer size =\s+([0-9.]+) MiB")


class _Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.rs: list[float] = []

    def emit(self, record):
        m = _RS.search(record.getMessage())
        if m:
            self.rs.append(float(m.group(1)))


def measure(target: str, drafter: str, blocks: list[int], n_gen: int, threads: int | None) -> list[dict]:
    from dflash_gguf.native.engine import Context, ContextOptions, Model
    from dflash_gguf.decoding import DFlashDecoder, GenerationStats, SpecOptions
    from dflash_gguf.decoding.rollback import recurrent_state_bytes

    grab = _Grab()
    lg = logging.getLogger("dflash_gguf.llama_cpp")
    lg.addHandler(grab)
    old = lg.level
    lg.setLevel(logging.DEBUG)
    rows = []
    try:
        with Model(target) as tm, Model(drafter) as dm:
            if not (tm.is_hybrid or tm.is_recurrent):
                raise SystemExit(f"{tm.path.name} ({tm.arch}) has no recurrent state: nothing to measure")
            prompt = tm.tokenize(b"def main(argv):\n    parser = argparse.ArgumentParser(")
            with Context(tm, ContextOptions(n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=threads)) as tc:
                dec = DFlashDecoder(tc, None)
                list(dec.generate(prompt, 8))
                st = GenerationStats()
                t0 = time.perf_counter()
                list(dec.generate(prompt, n_gen, stats=st, stop_tokens=[]))
                plain_tps = st.n_generated / (time.perf_counter() - t0 - st.t_prefill)
            for block in blocks:
                n_draft = block - 1
                row = {"block": block, "n_draft": n_draft, "plain_tps": plain_tps}
                for kind, n_rs in (("snapshot", n_draft), ("checkpoint", 0)):
                    grab.rs.clear()
                    opts = ContextOptions(n_ctx=1024, n_batch=64, n_ubatch=64, n_rs_seq=n_rs, n_threads=threads)
                    with Context(tm, opts) as tc, Context(dm, opts, other=tc) as dc:
                        row[f"{kind}_rs_mib"] = grab.rs[-1] if grab.rs else float("nan")
                        state = recurrent_state_bytes(tc)
                        dec = DFlashDecoder(tc, dc, SpecOptions(n_draft=n_draft, rollback=kind))
                        list(dec.generate(prompt, 8))                     # warm-up
                        dec.reset()
                        st = GenerationStats()
                        t0 = time.perf_counter()
                        list(dec.generate(prompt, n_gen, stats=st, stop_tokens=[]))
                        row[f"{kind}_tps"] = st.n_generated / (time.perf_counter() - t0 - st.t_prefill)
                        row[f"{kind}_tau"] = st.tau
                        row["state_mib"] = state / 2**20
                row["snapshot_extra_mib"] = row["snapshot_rs_mib"] - row["checkpoint_rs_mib"]
                row["checkpoint_extra_mib"] = row["state_mib"]   # one host copy (Python bytes)
                rows.append(row)
                log.info("block %d: snapshot +%.1f MiB %.1f tok/s, checkpoint +%.1f MiB %.1f tok/s", block,
                         row["snapshot_extra_mib"], row["snapshot_tps"], row["checkpoint_extra_mib"],
                         row["checkpoint_tps"])
    finally:
        lg.removeHandler(grab)
        lg.setLevel(old)
    return rows


def table(rows: list[dict], caps: list[float]) -> str:
    from dflash_gguf.errors import InvalidArgumentError
    from dflash_gguf.decoding.rollback import choose_for_memory

    head = ("| block | n_draft | state copy MiB | RS buffer MiB (snapshot / none) | snapshot extra MiB | "
            "checkpoint extra MiB | plain tok/s | snapshot tok/s (tau) | checkpoint tok/s (tau) | "
            + " | ".join(f"cap {c:g} MiB" for c in caps) + " |")
    lines = [head, "|" + "---|" * (9 + len(caps))]
    for r in rows:
        choice = []
        for c in caps:
            try:
                choice.append(choose_for_memory(int(r["state_mib"] * 2**20), r["n_draft"], int(c * 2**20)))
            except InvalidArgumentError:
                choice.append("error (below one copy)")
        lines.append(f"| {r['block']} | {r['n_draft']} | {r['state_mib']:.2f} | {r['snapshot_rs_mib']:.2f} / "
                     f"{r['checkpoint_rs_mib']:.2f} | {r['snapshot_extra_mib']:.1f} | {r['checkpoint_extra_mib']:.1f} | "
                     f"{r['plain_tps']:.1f} | {r['snapshot_tps']:.1f} ({r['snapshot_tau']:.2f}) | "
                     f"{r['checkpoint_tps']:.1f} ({r['checkpoint_tau']:.2f}) | " + " | ".join(choice) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from dflash_gguf.native.logs import set_log_handler

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.rollback", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a hybrid target GGUF (e.g. from examples/make_gdn_pair.py)")
    ap.add_argument("--drafter", required=True, help="its DFlash drafter GGUF (block size >= the largest block)")
    ap.add_argument("--blocks", default="4,8,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--caps", default="64,256,1024", help="rollback_memory_mb values to show the choice for")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    set_log_handler()
    blocks = [int(b) for b in a.blocks.split(",")]
    if any(b < 2 for b in blocks):
        ap.error("--blocks: each block must be >= 2")
    rows = measure(a.target, a.drafter, blocks, a.tokens, a.threads)
    print(table(rows, [float(c) for c in a.caps.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
