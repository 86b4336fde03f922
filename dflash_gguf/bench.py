"""Side-by-side benchmark: plain decoding vs our DFlash vs upstream llama.cpp's C++ DFlash.

    python -m dflash_gguf.bench                                   # shipped demo pair, code prompts
    python -m dflash_gguf.bench --prompts all --trials 5 --max-tokens 128
    python -m dflash_gguf.bench -m target.gguf -md drafter.gguf --prompts prompts.txt
    python -m dflash_gguf.bench --sweep-block                     # n_draft = 1 .. block_size - 1
    python -m dflash_gguf.bench --profile                         # CPU cost profile (verify rows, draft)

Columns, all greedy (temperature 0) on the same GGUF pair in one process:

* ``plain``    - :class:`dflash_gguf.spec.DFlashDecoder` with no drafter: one target pass per token;
* ``dflash``   - our DFlash loop (drafter proposes a block, the target verifies it in one pass);
* ``upstream`` - ``llama-speculative-simple --spec-type draft-dflash`` from ``dflash_gguf.paths.tools_dir()``
  (one subprocess per prompt; its own ``decoded N tokens in X s`` timer, which like ours excludes
  the prompt).

Tokens/s excludes prompt processing; each trial runs every prompt once, modes interleaved per
trial so a machine whose load changes affects all columns alike. Results go to ``--out``
(``results.json``, ``results.png`` when matplotlib is installed).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("dflash_gguf.bench")

PROMPT_SETS = ("code", "math", "prose")
_PKG = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- prompts
def prompts_dir() -> Path | None:
    for cand in (_PKG.parent / "bench" / "prompts", _PKG / "data" / "bench_prompts"):
        if cand.is_dir():
            return cand
    return None


def parse_prompt_file(path: Path) -> list[tuple[str, str]]:
    """``### name`` starts a prompt; its text runs to the next ``### `` line. Trailing blank lines are
    dropped and the text keeps one final newline. Lines before the first header are comments."""
    out, name, buf = [], None, []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("### "):
            if name is not None:
                out.append((name, "".join(buf).rstrip() + "\n"))
            name, buf = line[4:].strip(), []
        elif name is not None:
            buf.append(line)
    if name is not None:
        out.append((name, "".join(buf).rstrip() + "\n"))
    return [(n, t) for n, t in out if t.strip()]


def load_prompts(specs: list[str]) -> list[dict]:
    """Prompt sets by name (code, math, prose, all) or prompt files."""
    out = []
    for spec in specs:
        names = PROMPT_SETS if spec == "all" else (spec,)
        for name in names:
            if name in PROMPT_SETS:
                d = prompts_dir()
                if d is None:
                    raise SystemExit("error: the bench/prompts folder is not in this installation; pass prompt files")
                path = d / f"{name}.txt"
            else:
                path = Path(name)
                if not path.is_file():
                    raise SystemExit(f"error: prompt set {name!r} is neither one of {', '.join(PROMPT_SETS)}, all, "
                                     "nor a file")
            for pname, text in parse_prompt_file(path):
                out.append({"set": path.stem, "name": pname, "text": text})
    if not out:
        raise SystemExit("error: no prompts found")
    return out


# --------------------------------------------------------------------------- machine facts
def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    r = resource.getrusage(who).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = []
    try:
        txt = Path("/proc/cpuinfo").read_text()
        flags = sorted({f for f in ("avx2", "avx512f", "amx_int8", "amx_bf16", "fma", "f16c")
                        if re.search(rf"\b{f}\b", txt)})
    except OSError:
        pass
    mem = None
    try:
        mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu, "cpu_flags": flags,
            "cores": os.cpu_count(), "mem_gb": round(mem, 1) if mem else None, "gpu": None,
            "python": platform.python_version()}


def versions() -> dict:
    v = {"dflash_gguf": None, "llama_cpp_python": None, "patch_series": None}
    try:
        import dflash_gguf
        v["dflash_gguf"] = dflash_gguf.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        import llama_cpp
        v["llama_cpp_python"] = getattr(llama_cpp, "__version__", None)
    except Exception:  # noqa: BLE001
        pass
    try:
        from dflash_gguf import paths
        v["patch_series"] = paths.patch_series_hash()[:16]
    except Exception:  # noqa: BLE001
        pass
    return v


# --------------------------------------------------------------------------- our columns
@dataclass
class ModeResult:
    """One mode over all trials. A trial runs every prompt once."""
    name: str
    trial_tps: list[float] = field(default_factory=list)     # tokens / decode seconds, per trial
    tokens: dict[str, list[int]] = field(default_factory=dict)  # per prompt, from the first trial
    texts: dict[str, str] = field(default_factory=dict)
    n_generated: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_pos: list[int] = field(default_factory=list)
    accepted_pos: list[int] = field(default_factory=list)
    phase: dict[str, float] = field(default_factory=dict)    # seconds, summed over all trials
    per_prompt: dict[str, dict] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        tps = self.trial_tps
        d = {"tokens_per_second": {"median": _r(statistics.median(tps)) if tps else None,
                                   "min": _r(min(tps)) if tps else None, "max": _r(max(tps)) if tps else None,
                                   "trials": [_r(x) for x in tps]},
             "n_generated": self.n_generated}
        if self.steps:
            d["acceptance_length"] = _r((self.accepted + self.steps) / self.steps, 4)
            d["accept_rate"] = _r(self.accepted / self.drafted, 4) if self.drafted else None
            d["steps"], d["drafted"], d["accepted"] = self.steps, self.drafted, self.accepted
            d["per_position_acceptance"] = [_r(a / n, 4) if n else None
                                            for a, n in zip(self.accepted_pos, self.drafted_pos)]
        if self.phase:
            tot = sum(self.phase.values()) or 1.0
            d["time_s"] = {k: _r(v, 4) for k, v in self.phase.items()}
            d["time_share"] = {k: _r(v / tot, 4) for k, v in self.phase.items()}
        d["per_prompt"] = self.per_prompt
        d.update(self.extra)
        return d


def _r(x, nd: int = 2):
    return None if x is None else round(float(x), nd)


def _add_stats(res: ModeResult, st) -> None:
    res.n_generated += st.n_generated
    res.steps += st.steps
    res.drafted += st.drafted
    res.accepted += st.accepted
    while len(res.drafted_pos) < len(st.drafted_per_pos):
        res.drafted_pos.append(0)
        res.accepted_pos.append(0)
    for i, (d, a) in enumerate(zip(st.drafted_per_pos, st.accepted_per_pos)):
        res.drafted_pos[i] += d
        res.accepted_pos[i] += a
    for k in ("prefill", "draft", "verify", "inject", "rollback", "python"):
        res.phase[k] = res.phase.get(k, 0.0) + getattr(st, f"t_{k}")


def run_ours(dec, prompts: list[dict], ids: list[list[int]], max_tokens: int, res: ModeResult, model,
             record: bool) -> float:
    """One trial of one mode: every prompt once from an empty cache. Returns tokens/s."""
    from dflash_gguf.spec import GenerationStats

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
        pp = res.per_prompt.setdefault(key, {"tps": [], "n_prompt": len(tok_ids)})
        pp["tps"].append(_r(st.tokens_per_second))
        if st.steps:
            pp["acceptance_length"] = _r(st.tau, 3)
    tps = n_tok / t_dec if t_dec > 0 else 0.0
    res.trial_tps.append(tps)
    return tps


# --------------------------------------------------------------------------- upstream column
_RE_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s")
_RE_KV = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(\d+)")
_RE_STATS = re.compile(r"#gen drafts\s+=\s+(\d+), #acc drafts\s+=\s+(\d+), #gen tokens\s+=\s+(\d+), "
                       r"#acc tokens\s+=\s+(\d+), #mean acc len\s+=\s+([\d.]+), #acc rate/pos = \(([^)]*)\)"
                       r"(?:, dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms)?")


def upstream_binary() -> tuple[Path | None, str]:
    try:
        from dflash_gguf import paths
        d = paths.tools_dir()
    except Exception as e:  # noqa: BLE001
        return None, f"tools folder unknown ({e})"
    if d is None:
        return None, ("upstream tools were not built (python -m dflash_gguf.build --with-tools makes "
                      "llama-speculative-simple)")
    exe = Path(d) / "llama-speculative-simple"
    if not exe.is_file():
        return None, f"{exe} is missing (python -m dflash_gguf.build --with-tools)"
    return exe, ""


def parse_upstream(stderr: str) -> dict:
    """Pull timings and acceptance out of llama-speculative-simple's stderr (-lv 4)."""
    out: dict = {}
    m = _RE_DECODED.search(stderr)
    if m:
        out.update(n_decoded=int(m.group(1)), t_decode=float(m.group(2)), tps=float(m.group(3)))
    for k, v in _RE_KV.findall(stderr):
        out[k] = int(v)
    m = _RE_STATS.search(stderr)
    if m:
        out.update(gen_drafts=int(m.group(1)), acc_drafts=int(m.group(2)), gen_tokens=int(m.group(3)),
                   acc_tokens=int(m.group(4)), mean_acc_len=float(m.group(5)),
                   rate_pos=[float(x) for x in m.group(6).split(",") if x.strip()])
        if m.group(7):
            out["t_draft_ms"] = float(m.group(8))
    return out


def _run_watch_rss(cmd: list[str], tmp: Path, timeout: float) -> tuple[int, str, str, float | None]:
    """Run ``cmd``, polling its VmHWM (peak RSS) from /proc; returns (rc, stdout, stderr, peak MB).

    getrusage(RUSAGE_CHILDREN) would report this Python process's own peak: the child inherits it
    across fork/exec on Linux."""
    fo, fe = tmp / "stdout", tmp / "stderr"
    hwm = None
    with open(fo, "wb") as o, open(fe, "wb") as e:
        p = subprocess.Popen(cmd, stdout=o, stderr=e)
        t_end = time.monotonic() + timeout
        status = Path(f"/proc/{p.pid}/status")
        while p.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        hwm = max(hwm or 0.0, int(line.split()[1]) / 1024)
                        break
            except (OSError, ValueError):
                pass
            if time.monotonic() > t_end:
                p.kill()
                p.wait()
                raise RuntimeError(f"llama-speculative-simple ran past {timeout:.0f} s")
            time.sleep(0.005)
    return (p.returncode, fo.read_text(encoding="utf-8", errors="replace"),
            fe.read_text(encoding="utf-8", errors="replace"), hwm)


def run_upstream_one(exe: Path, target: Path, draft: Path, prompt: str, n: int, n_draft: int,
                     threads: int, timeout: float = 600) -> tuple[dict, str]:
    """Run llama-speculative-simple once; returns (parsed numbers, generated text).

    The prompt goes in with ``-p`` and ``--no-escape`` (``-f`` would drop a final newline). Its log
    goes through an asynchronous writer thread that now and then loses the last lines at exit (the
    timings and the end of the generated text); that happens far less with ``--log-file``, and a run
    whose stderr lacks the final ``decoded`` line is repeated."""
    import tempfile

    cmd = [str(exe), "-m", str(target), "-md", str(draft), "--spec-type", "draft-dflash",
           "--spec-draft-n-max", str(n_draft), "-p", prompt, "--no-escape", "-n", str(n), "--temp", "0",
           "--top-k", "1", "--seed", "42", "-lv", "4", "-t", str(threads), "-c", "2048"]
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        for attempt in range(5):
            rc, out, err, hwm = _run_watch_rss(cmd + ["--log-file", str(Path(tmp) / "log.txt")], Path(tmp), timeout)
            if rc != 0:
                raise RuntimeError(f"llama-speculative-simple exited with {rc}: {err[-1500:]}")
            got = parse_upstream(err)
            got["peak_rss_mb"] = hwm
            if "tps" in got and "n_accept" in got:
                break
            log.debug("upstream log incomplete (attempt %d), retrying", attempt + 1)
        else:
            raise RuntimeError("llama-speculative-simple's log never showed its 'decoded N tokens' line "
                               f"(5 attempts); last stderr: {err[-800:]}")
    got["attempts"] = attempt + 1
    got["cmd"] = cmd
    return got, out


def upstream_generated(stdout: str, echo: str) -> str:
    """The generated text from its stdout ("\\n\\n" + prompt pieces + generation + "\\n\\n")."""
    s = stdout[2:] if stdout.startswith("\n\n") else stdout
    if s.startswith(echo):
        s = s[len(echo):]
    return s[:-2] if s.endswith("\n\n") else s


def run_upstream(exe, target, draft, prompts, echoes, max_tokens, n_draft, threads, res: ModeResult,
                 ours_text: dict[str, str], record: bool) -> float:
    n_tok, t_dec = 0, 0.0
    for p, echo in zip(prompts, echoes):
        got, out = run_upstream_one(exe, target, draft, p["text"], max_tokens, n_draft, threads)
        key = f"{p['set']}/{p['name']}"
        n_tok += got["n_decoded"]
        t_dec += got["t_decode"]
        res.n_generated += got["n_decoded"]
        if got.get("peak_rss_mb"):
            res.extra["peak_rss_mb"] = _r(max(res.extra.get("peak_rss_mb") or 0.0, got["peak_rss_mb"]), 1)
        if "gen_drafts" in got:
            res.steps += got["gen_drafts"]
            res.drafted += got["gen_tokens"]
            res.accepted += got["acc_tokens"]
            rp = got.get("rate_pos", [])
            while len(res.drafted_pos) < len(rp):
                res.drafted_pos.append(0)
                res.accepted_pos.append(0)
            for i, r in enumerate(rp):   # rates are per draft: weight by the number of drafts
                res.drafted_pos[i] += got["gen_drafts"]
                res.accepted_pos[i] += r * got["gen_drafts"]
            if "t_draft_ms" in got:
                res.phase["draft"] = res.phase.get("draft", 0.0) + got["t_draft_ms"] / 1000
        pp = res.per_prompt.setdefault(key, {"tps": []})
        pp["tps"].append(got["tps"])
        if "mean_acc_len" in got:
            pp["acceptance_length"] = got["mean_acc_len"]
        if record:
            text = upstream_generated(out, echo)
            res.texts[key] = text
            ours = ours_text.get(key)
            # upstream runs whole blocks past -n and stops before an EOS: compare on the common part
            pp["tokens_equal_ours"] = None if ours is None else (text.startswith(ours) or ours.startswith(text))
            res.extra.setdefault("command_example", " ".join(repr(c) if "\n" in c or " " in c else c
                                                             for c in got["cmd"]))
    tps = n_tok / t_dec if t_dec > 0 else 0.0
    res.trial_tps.append(tps)
    return tps


# --------------------------------------------------------------------------- sweep and profile
def sweep(tctx, dctx, model, prompts, ids, max_tokens, trials, plain_tps: float) -> list[dict]:
    from dflash_gguf.spec import DFlashDecoder, SpecOptions

    rows = []
    probe = DFlashDecoder(tctx, dctx)
    B = probe.info.block_size
    for n in range(1, B):
        dec = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=n))
        res = ModeResult(f"dflash-n{n}")
        for t in range(trials):
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

    from dflash_gguf import _bindings as B
    from dflash_gguf.spec import DFlashDecoder

    dec = DFlashDecoder(tctx, dctx)
    toks = list(dec.generate(prompt_ids, 1))   # prompt in both caches, features injected
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


# --------------------------------------------------------------------------- chart
def write_chart(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001
        log.warning("matplotlib is not installed: no chart written (pip install matplotlib)")
        return False
    cols = [c for c in ("plain", "dflash", "upstream") if result["modes"].get(c, {}).get("tokens_per_second", {}).get("median")]
    panels = 2 + bool(result.get("sweep")) + bool(result.get("profile"))
    fig, axes = plt.subplots(1, panels, figsize=(4.6 * panels, 4))
    ax = axes[0]
    med = [result["modes"][c]["tokens_per_second"]["median"] for c in cols]
    lo = [m - result["modes"][c]["tokens_per_second"]["min"] for m, c in zip(med, cols)]
    hi = [result["modes"][c]["tokens_per_second"]["max"] - m for m, c in zip(med, cols)]
    ax.bar(cols, med, yerr=[lo, hi], capsize=4, color=["#888", "#2a7", "#37c"][:len(cols)])
    for i, m in enumerate(med):
        ax.text(i, m / 2, f"{m:.0f}", ha="center", va="center", color="white", fontweight="bold")
    ax.set_ylabel("tokens / s (median, min-max)")
    ax.set_title("decode speed")
    ax = axes[1]
    for c, style in (("dflash", "o-"), ("upstream", "s--")):
        pa = result["modes"].get(c, {}).get("per_position_acceptance")
        if pa:
            ax.plot(range(1, len(pa) + 1), pa, style, label=f"{c} (tau {result['modes'][c]['acceptance_length']:.2f})")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_title("per-position acceptance")
    ax.legend()
    k = 2
    if result.get("sweep"):
        ax = axes[k]
        k += 1
        sw = result["sweep"]
        ax.plot([r["n_draft"] for r in sw], [r["tokens_per_second"]["median"] for r in sw], "o-", label="dflash")
        ax.axhline(result["modes"]["plain"]["tokens_per_second"]["median"], color="#888", ls="--", label="plain")
        ax.set_xlabel("n_draft")
        ax.set_ylabel("tokens / s")
        ax.set_title("block size sweep")
        ax.legend()
    if result.get("profile"):
        ax = axes[k]
        pr = result["profile"]
        vm = {int(k): v for k, v in pr["verify_ms_argmax_min"].items()}
        dm = {int(k): v for k, v in pr["draft_ms_min"].items()}
        ax.plot(sorted(vm), [vm[x] for x in sorted(vm)], "o-", label="target verify (min)")
        ax.plot(sorted(dm), [dm[x] for x in sorted(dm)], "s-", label="drafter block (min)")
        ax.set_xlabel("rows / drafted tokens")
        ax.set_ylabel("ms")
        ax.set_title("CPU cost profile")
        ax.legend()
    fig.suptitle(result["meta"]["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main
def _parse(argv):
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", "-m", type=Path, help="target GGUF (default: the shipped demo target)")
    ap.add_argument("--draft", "-md", type=Path, help="DFlash drafter GGUF (default: the shipped demo drafter)")
    ap.add_argument("--prompts", nargs="+", default=["code"],
                    help="prompt sets (code, math, prose, all) or files with '### name' headers (default: code)")
    ap.add_argument("--max-tokens", "-n", type=int, default=128, help="tokens generated per prompt (default 128)")
    ap.add_argument("--trials", type=int, default=3, help="timed trials; each runs every prompt (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs of each mode (default 1)")
    ap.add_argument("--n-draft", type=int, default=None, help="tokens drafted per block (default: block size - 1)")
    ap.add_argument("--threads", "-t", type=int, default=None, help="CPU threads for every column (default: cores, max 8)")
    ap.add_argument("--no-upstream", action="store_true", help="skip the upstream llama.cpp column")
    ap.add_argument("--sweep-block", action="store_true", help="also run n_draft = 1 .. block_size - 1")
    ap.add_argument("--profile", action="store_true", help="also profile verify cost vs rows and draft cost")
    ap.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default ./bench-results)")
    ap.add_argument("--tag", default=None, help="name of the result files (default results)")
    ap.add_argument("-v", "--verbose", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _parse(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.INFO, format="%(message)s")
    logging.getLogger("dflash_gguf.llama_cpp").setLevel(logging.DEBUG if a.verbose else logging.ERROR)
    from dflash_gguf.demo import demo_pair
    from dflash_gguf.engine import Context, ContextOptions, Model
    from dflash_gguf.logs import set_log_handler
    from dflash_gguf.spec import DFlashDecoder, SpecOptions

    set_log_handler()
    tpath, dpath = demo_pair()
    tpath = a.model or tpath
    dpath = a.draft or (None if a.model else dpath)
    if dpath is None:
        log.error("--model needs --draft (the DFlash drafter for that target)")
        return 2
    for p in (tpath, dpath):
        if not Path(p).is_file():
            log.error("model not found: %s", p)
            return 2
    prompts = load_prompts(a.prompts)
    threads = a.threads or min(8, os.cpu_count() or 1)
    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None

    rss0 = _rss_mb()
    tm = Model(tpath)
    opts = ContextOptions(n_ctx=2048, n_batch=256, n_ubatch=256, n_threads=threads)
    tctx = Context(tm, opts)
    rss_t = _rss_mb()
    dm = Model(dpath)
    dctx = Context(dm, opts, other=tctx)
    rss_d = _rss_mb()
    plain = DFlashDecoder(tctx, None)
    spec = DFlashDecoder(tctx, dctx, SpecOptions(n_draft=a.n_draft))
    n_draft = spec.n_draft
    ids = [tm.tokenize(p["text"].encode("utf-8")) for p in prompts]
    echoes = [tm.detokenize(i, special=True).decode("utf-8", "replace") for i in ids]

    exe, why = (None, "--no-upstream") if a.no_upstream else upstream_binary()
    if exe is None and not a.no_upstream:
        log.warning("upstream column skipped: %s", why)

    log.info("bench: %d prompts (%s), %d tokens each, %d trials + %d warm-up, %d threads, n_draft %d (block %d)",
             len(prompts), ", ".join(a.prompts), a.max_tokens, a.trials, a.warmup, threads, n_draft,
             spec.info.block_size)
    modes = {"plain": ModeResult("plain"), "dflash": ModeResult("dflash")}
    if exe is not None:
        modes["upstream"] = ModeResult("upstream")
    # warm-up: first prompt, each mode
    for _ in range(a.warmup):
        w = ModeResult("warmup")
        run_ours(plain, prompts[:1], ids[:1], min(a.max_tokens, 32), w, tm, False)
        run_ours(spec, prompts[:1], ids[:1], min(a.max_tokens, 32), w, tm, False)
        if exe is not None:
            run_upstream_one(exe, tpath, dpath, prompts[0]["text"], min(a.max_tokens, 32), n_draft, threads)
    for t in range(a.trials):
        first = t == 0
        line = [f"trial {t + 1}/{a.trials}:"]
        line.append(f"plain {run_ours(plain, prompts, ids, a.max_tokens, modes['plain'], tm, first):.1f}")
        line.append(f"dflash {run_ours(spec, prompts, ids, a.max_tokens, modes['dflash'], tm, first):.1f}")
        if exe is not None:
            line.append("upstream " + f"{run_upstream(exe, tpath, dpath, prompts, echoes, a.max_tokens, n_draft, threads, modes['upstream'], modes['plain'].texts, first):.1f}")
        log.info("%s tokens/s", " ".join(line))

    pt = modes["plain"].tokens
    equal_ours = all(modes["dflash"].tokens.get(k) == v for k, v in pt.items())
    up_equal = None
    if exe is not None:
        flags = [pp.get("tokens_equal_ours") for pp in modes["upstream"].per_prompt.values()]
        up_equal = all(f is True for f in flags)
    summ = {k: m.summary() for k, m in modes.items()}
    summ["plain"]["peak_rss_mb"] = _r(_peak_rss_mb(), 1)   # whole process: both models loaded
    summ["dflash"]["peak_rss_mb"] = summ["plain"]["peak_rss_mb"]
    if exe is not None:
        summ["upstream"]["binary"] = str(exe)
    else:
        summ["upstream"] = {"skipped": True, "reason": why}

    def ratio(x, y):
        try:
            return _r(summ[x]["tokens_per_second"]["median"] / summ[y]["tokens_per_second"]["median"], 3)
        except (KeyError, TypeError, ZeroDivisionError):
            return None

    result = {
        "meta": {
            "title": f"{Path(tpath).name} + {Path(dpath).name}, {', '.join(a.prompts)} prompts, {a.max_tokens} tokens, "
                     f"{threads} threads, n_draft {n_draft}",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(["python -m dflash_gguf.bench"] + (argv if argv is not None else sys.argv[1:])),
            "target": str(tpath), "drafter": str(dpath), "target_mb": _r(Path(tpath).stat().st_size / 1e6),
            "drafter_mb": _r(Path(dpath).stat().st_size / 1e6), "block_size": spec.info.block_size,
            "n_draft": n_draft, "max_tokens": a.max_tokens, "trials": a.trials, "warmup": a.warmup,
            "threads": threads, "prompt_sets": a.prompts, "n_prompts": len(prompts),
            "loadavg_start": load0, "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "machine": machine_info(), "versions": versions(),
            "rss_mb": {"start": _r(rss0, 1), "after_target": _r(rss_t, 1), "after_drafter": _r(rss_d, 1)},
            "definitions": {
                "tokens_per_second": "generated tokens / decode seconds (prompt processing excluded), per trial "
                                     "over all prompts; median/min/max across trials",
                "acceptance_length": "tokens committed per target verify pass = 1 + accepted drafts per step",
                "per_position_acceptance": "share of drafts whose k-th token was accepted (prefix acceptance)",
                "peak_rss_mb": "plain/dflash: peak RSS of this process (Python + both models loaded); "
                               "upstream: largest VmHWM of a llama-speculative-simple run (sampled every 5 ms)",
            },
        },
        "prompts": [{"set": p["set"], "name": p["name"], "n_tokens": len(i)} for p, i in zip(prompts, ids)],
        "modes": summ,
        "speedup": {"dflash_over_plain": ratio("dflash", "plain"), "dflash_over_upstream": ratio("dflash", "upstream"),
                    "upstream_over_plain": ratio("upstream", "plain")},
        "outputs_equal": {"dflash_vs_plain": equal_ours, "upstream_vs_ours": up_equal},
        "sample_output": {k: v for k, v in list(modes["plain"].texts.items())[:1]},
    }
    if a.sweep_block:
        log.info("sweep over n_draft 1..%d", spec.info.block_size - 1)
        result["sweep"] = sweep(tctx, dctx, tm, prompts, ids, a.max_tokens, max(1, min(a.trials, 3)),
                                summ["plain"]["tokens_per_second"]["median"])
    if a.profile:
        log.info("profiling verify / draft cost")
        result["profile"] = profile(tctx, dctx, ids[0])

    a.out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or "results"
    jpath = a.out / f"{tag}.json"
    jpath.write_text(json.dumps(result, indent=2) + "\n")
    png = a.out / f"{tag}.png"
    chart = write_chart(result, png)
    _print_summary(result, jpath, png if chart else None)
    if not equal_ours:
        log.error("DFlash output differed from plain output: this is a bug")
        return 1
    return 0


def _print_summary(r: dict, jpath: Path, png: Path | None) -> None:
    m = r["modes"]
    print()
    print(f"{'mode':10s} {'tok/s med':>10s} {'min':>8s} {'max':>8s} {'accept len':>11s} {'peak RSS MB':>12s}")
    for k in ("plain", "dflash", "upstream"):
        d = m.get(k, {})
        if d.get("skipped"):
            print(f"{k:10s} skipped: {d['reason']}")
            continue
        t = d["tokens_per_second"]
        al = d.get("acceptance_length")
        print(f"{k:10s} {t['median']:10.1f} {t['min']:8.1f} {t['max']:8.1f} "
              f"{(f'{al:.2f}' if al else '-'):>11s} {d.get('peak_rss_mb') or 0:12.0f}")
    s = r["speedup"]
    print(f"speed-up: dflash/plain {s['dflash_over_plain']}, dflash/upstream {s['dflash_over_upstream']}, "
          f"upstream/plain {s['upstream_over_plain']}")
    pa = m["dflash"].get("per_position_acceptance")
    if pa:
        print("dflash per-position acceptance: " + " ".join(f"{x:.2f}" for x in pa if x is not None))
    if m["dflash"].get("time_share"):
        print("dflash time: " + ", ".join(f"{k} {v * 100:.0f}%" for k, v in m["dflash"]["time_share"].items()))
    e = r["outputs_equal"]
    print(f"outputs equal: dflash == plain: {e['dflash_vs_plain']}, upstream == ours: {e['upstream_vs_ours']}")
    if r.get("sweep"):
        print("sweep: " + ", ".join(f"n={x['n_draft']}: {x['tokens_per_second']['median']:.0f} tok/s "
                                    f"(tau {x['acceptance_length']:.2f})" for x in r["sweep"]))
    if r.get("profile"):
        p = r["profile"]
        print("verify ms by rows (min): " + " ".join(f"{k}:{v:.2f}" for k, v in p["verify_ms_argmax_min"].items()))
        print("draft ms by n (min):     " + " ".join(f"{k}:{v:.2f}" for k, v in p["draft_ms_min"].items()))
        print("break-even acceptance length by n_draft: " + " ".join(f"{k}:{v:.2f}" for k, v in
                                                                    p["break_even_acceptance_length"].items()))
    load = r["meta"].get("loadavg_start")
    if load and load[0] > (r["meta"]["machine"]["cores"] or 1) * 0.5:
        print(f"note: the machine was busy (load average {load[0]:.1f} on {r['meta']['machine']['cores']} cores): "
              "timings are noisy")
    print(f"wrote {jpath}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
    sys.exit(main())
