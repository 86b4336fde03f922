"""Where peak memory goes: plain llama_cpp.Llama vs dflash_gguf.Llama, default and low-memory settings.

``python -m dflash_gguf.bench.memory [--pair DIR] [--n-ctx 4096] [--prompt-tokens 2000] [--tokens 32]``

Every configuration runs in its own child process (peak RSS is per process): it loads the model(s),
completes a prompt of ``--prompt-tokens`` tokens (longer than one ubatch, so compute buffers are
used, not only reserved; by default also longer than the drafter's window plus one ubatch, so
DFlash decodes the head of the prompt in full ubatches as plain decoding does, and its last rows
in the short chunks whose taps the drafter reads) and generates ``--tokens`` tokens greedily. The child reports its peak RSS
(``VmHWM``), resident anonymous and file-backed memory, and the buffers llama.cpp allocated (from
its own log: model buffers by type, KV caches, compute and output buffers), plus decode speed.
The table puts DFlash's extra memory next to its budget (drafter weights + 25%) and the low-memory
preset's total next to weights + target KV + 25%.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("dflash_gguf.bench.memory")

# name -> (class, kwargs); "plain" runs llama_cpp.Llama, the others dflash_gguf.Llama
CONFIGS: dict[str, tuple[str, dict | str]] = {
    "plain": ("plain", {}),
    "dflash": ("dflash", {}),
    "dflash draft_window=0": ("dflash", {"draft_window": 0}),
    # the low-memory preset's settings one at a time (on plain decoding: their own cost), then together
    "plain use_mmap=False": ("plain", {"use_mmap": False}),
    "plain n_batch=256 n_ubatch=64": ("plain", {"n_batch": 256, "n_ubatch": 64}),
    "plain flash_attn=True": ("plain", {"flash_attn": True}),
    "plain flash_attn + KV q8_0": ("plain", {"flash_attn": True, "type_k": 8, "type_v": 8}),
    "plain + LOW_MEMORY settings": ("plain", "LOW_MEMORY"),
    "dflash low_memory=True": ("dflash", {"low_memory": True}),
    # the batched engine (BatchLlama, the server's --parallel slots): N sequences of n_ctx positions each
    "batch n_parallel=1": ("batch", {"n_parallel": 1}),
    "batch n_parallel=2": ("batch", {"n_parallel": 2}),
    "batch n_parallel=4": ("batch", {"n_parallel": 4}),
    "batch n_parallel=8": ("batch", {"n_parallel": 8}),
}
DEFAULT_CONFIGS = ("plain", "dflash", "dflash draft_window=0", "plain + LOW_MEMORY settings", "dflash low_memory=True")

_BUF = re.compile(r"^(load_tensors|llama_context|llama_kv_cache|~llama_context):\s+(\S+)\s+(model|output|KV|compute) "
                  r"buffer size (?:=|is)\s+([\d.]+) MiB")


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(line.split()[1]) / 1024
    return out


# --------------------------------------------------------------------------- child
def child(spec: dict) -> dict:
    from dflash_gguf.native.llama import llama_cpp

    from dflash_gguf.native import logs

    lines: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    lg = logging.getLogger("dflash_gguf.bench.memory.llama")
    lg.propagate = False
    lg.setLevel(logging.DEBUG)
    lg.addHandler(_Keep())
    logs.set_log_handler(lg)
    base = _status()
    if spec["kwargs"] == "LOW_MEMORY":
        from dflash_gguf.native.memory import LOW_MEMORY
        kwargs = dict(LOW_MEMORY)
    else:
        kwargs = dict(spec["kwargs"])
    common = dict(n_ctx=spec["n_ctx"], n_threads=spec.get("threads"), verbose=True)
    t0 = time.perf_counter()
    if spec["kind"] == "batch":
        return _batch_child(spec, kwargs["n_parallel"], lines, base)
    if spec["kind"] == "plain":
        llm = llama_cpp.Llama(spec["target"], **common, **kwargs)
    else:
        import dflash_gguf
        llm = dflash_gguf.Llama(spec["target"], draft_model_path=spec["drafter"], **common, **kwargs)
    t_load = time.perf_counter() - t0
    loaded = _status()
    filler = llm.tokenize(b"The quick brown fox jumps over the lazy dog. ", add_bos=False)
    prompt = llm.tokenize(b"", add_bos=True)[:1]
    while len(prompt) < spec["prompt_tokens"]:
        prompt += filler
    prompt = prompt[:spec["prompt_tokens"]]
    t0 = time.perf_counter()
    first = None
    n = 0
    for _ in llm.create_completion(prompt, max_tokens=spec["tokens"], temperature=0.0, stream=True):
        n += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    after = _status()
    llm.close()
    bufs = [m.groups() for m in map(_BUF.match, lines) if m]
    return {"base": base, "loaded": loaded, "after": after, "buffers": bufs, "t_load": t_load,
            "t_prompt": (first or end) - t0, "tps": (n - 1) / (end - first) if first and n > 1 else 0.0,
            "n": n}


def _batch_child(spec: dict, n: int, lines: list[str], base: dict) -> dict:
    """N prompts of ``prompt_tokens`` tokens (each its own: no prefix is shared) in one BatchLlama."""
    from dflash_gguf.batch import BatchLlama

    t0 = time.perf_counter()
    llm = BatchLlama(spec["target"], spec["drafter"], n_parallel=n, n_ctx=spec["n_ctx"], n_threads=spec.get("threads"))
    t_load = time.perf_counter() - t0
    loaded = _status()
    filler = llm.model.tokenize(b"The quick brown fox jumps over the lazy dog. ", add_bos=False)
    prompts = []
    for i in range(n):
        p = llm.model.tokenize(f"{i} ".encode(), add_bos=True)
        while len(p) < spec["prompt_tokens"]:
            p += filler
        prompts.append(p[:spec["prompt_tokens"]])
    t0 = time.perf_counter()
    out = llm.generate(prompts, max_tokens=spec["tokens"])
    end = time.perf_counter()
    after = _status()
    # the drafter's features kept on the host per slot (decoding/features.py: rows of plain steps and of the
    # prompt, up to MAX_BYTES a slot), which llama.cpp's buffer figures do not count
    kept = [s.features.buf.nbytes for s in llm.decoder.seqs if s.features is not None and s.features.buf is not None]
    llm.close()
    bufs = [m.groups() for m in map(_BUF.match, lines) if m]
    n_tok = sum(len(c.tokens) for c in out)
    return {"base": base, "loaded": loaded, "after": after, "buffers": bufs, "t_load": t_load,
            "t_prompt": 0.0, "tps": n_tok / (end - t0), "n": n_tok, "n_parallel": n,
            "host_features_bytes": int(sum(kept))}


# --------------------------------------------------------------------------- parent
def measure(name: str, target: str, drafter: str, n_ctx: int, prompt_tokens: int, tokens: int,
            threads: int | None) -> dict:
    kind, kwargs = CONFIGS[name]
    spec = {"kind": kind, "kwargs": kwargs, "target": target, "drafter": drafter, "n_ctx": n_ctx,
            "prompt_tokens": prompt_tokens, "tokens": tokens, "threads": threads}
    proc = subprocess.run([sys.executable, "-m", "dflash_gguf.bench.memory", "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(r: dict) -> dict:
    """MiB per component from llama.cpp's buffers (in the order it allocated them)."""
    model_bufs = [(who, float(mib)) for src, who, what, mib in r["buffers"] if what == "model"]
    kv = [float(mib) for src, who, what, mib in r["buffers"] if what == "KV"]
    # '~llama_context' lines (at free) give each context's final compute buffer; drafter freed first
    compute = [float(mib) for src, who, what, mib in r["buffers"] if what == "compute" and src == "~llama_context"]
    out_buf = [float(mib) for src, who, what, mib in r["buffers"] if what == "output"]
    return {"model_bufs": model_bufs, "kv": kv, "compute": compute, "output": out_buf}


def table(results: dict[str, dict], target_mb: float, drafter_mb: float) -> str:
    lines = ["| configuration | peak RSS MiB | anon / file MiB | model buffers MiB (llama.cpp) | KV MiB (target, drafter) | "
             "compute MiB (reserved) | Python + libs MiB | prompt s | decode tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        s = summarize(r)
        mb = ", ".join(f"{who} {v:.0f}" for who, v in s["model_bufs"])
        kv = " + ".join(f"{v:.0f}" for v in s["kv"])
        comp = " + ".join(f"{v:.0f}" for v in reversed(s["compute"]))
        a = r["after"]
        lines.append(f"| {name} | {a['VmHWM']:.0f} | {a['RssAnon']:.0f} / {a['RssFile']:.0f} | {mb} | {kv} | {comp} | "
                     f"{r['base']['VmRSS']:.0f} | {r['t_prompt']:.2f} | {r['tps']:.2f} |")
    lines.append("")
    peak = {k: v["after"]["VmHWM"] for k, v in results.items()}
    if "plain" in peak and "dflash" in peak:
        extra = peak["dflash"] - peak["plain"]
        budget = drafter_mb * 1.25
        lines.append(f"- DFlash's extra peak RSS over plain: {extra:.0f} MiB; budget (drafter file {drafter_mb:.0f} MiB "
                     f"+ 25%): {budget:.0f} MiB -> {'within' if extra <= budget else 'OVER'}")
    if "dflash low_memory=True" in results:
        r = results["dflash low_memory=True"]
        got = r["after"]["VmHWM"]
        kvs = {"its own (preset) target KV": summarize(r)["kv"][0] if summarize(r)["kv"] else 0.0}
        if "plain" in results and summarize(results["plain"])["kv"]:
            kvs["the default target KV"] = summarize(results["plain"])["kv"][0]
        for what, kv_t in kvs.items():
            budget = (target_mb + drafter_mb + kv_t) * 1.25
            lines.append(f"- low_memory=True peak RSS: {got:.0f} MiB; budget with {what} (weights "
                         f"{target_mb + drafter_mb:.0f} + KV {kv_t:.0f}, + 25%): {budget:.0f} MiB -> "
                         f"{'within' if got <= budget else 'OVER'}")
    lines += _batch_lines(results)
    return "\n".join(lines)


def _batch_lines(results: dict[str, dict]) -> list[str]:
    """Memory at N slots: predicted from one slot's run (its KV buffers, llama.cpp's own figures, and the
    drafter features it kept on the host, x N; the rest as one slot's) beside the measured peak."""
    one = results.get("batch n_parallel=1")
    if one is None:
        return []
    kv1 = sum(summarize(one)["kv"])
    host1 = one.get("host_features_bytes", 0) / 2**20
    out = []
    for name, r in results.items():
        n = r.get("n_parallel")
        if not n or n == 1:
            continue
        kv = sum(summarize(r)["kv"])
        pred = one["after"]["VmHWM"] + (n - 1) * (kv1 + host1)
        got = r["after"]["VmHWM"]
        out.append(f"- {name}: KV buffers {kv:.0f} MiB (one slot's x {n}: {kv1 * n:.0f}), host features "
                   f"{r.get('host_features_bytes', 0) / 2**20:.0f} MiB (one slot's x {n}: {host1 * n:.0f}); peak RSS {got:.0f} "
                   f"MiB, predicted {pred:.0f} (one slot's peak + {n - 1} x its KV and host features), {got / pred:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--pair", help="converted pair directory (default: the shipped demo pair)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help="comma list (default: %(default)s) of: " + "; ".join(CONFIGS) + "; or 'all'")
    ap.add_argument("--json", help="also write the raw results here")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from dflash_gguf.pair import pair_files

    if a.pair:
        target, drafter = pair_files(a.pair)
    else:
        from dflash_gguf.demo import demo_pair
        target, drafter = demo_pair()
    names = list(CONFIGS) if a.configs == "all" else [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    results = {}
    for i, name in enumerate(names, 1):
        log.info("[%d/%d] %s ...", i, len(names), name)
        results[name] = measure(name, str(target), str(drafter), a.n_ctx, a.prompt_tokens, a.tokens, a.threads)
        log.info("    peak RSS %.0f MiB", results[name]["after"]["VmHWM"])
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print(f"target {Path(target).name} ({os.path.getsize(target) / 2**20:.0f} MiB), drafter {Path(drafter).name} "
          f"({os.path.getsize(drafter) / 2**20:.0f} MiB), n_ctx {a.n_ctx}, prompt {a.prompt_tokens} tokens, "
          f"{a.tokens} generated")
    print(table(results, os.path.getsize(target) / 2**20, os.path.getsize(drafter) / 2**20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
