"""Upstream llama.cpp's C++ DFlash as a benchmark column: ``llama-speculative-simple``.

Runs the reference binary built by ``python -m dflash_gguf.build --with-tools`` (patched tree,
``patches/0003`` flushes its log at exit), one subprocess per prompt, and reads its own timer,
acceptance counters and peak memory.
"""
from __future__ import annotations

import logging
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_gguf.decoding.stats import GenerationStats

if TYPE_CHECKING:
    from dflash_gguf.bench.results import ModeResult

log = logging.getLogger("dflash_gguf.bench")

# --------------------------------------------------------------------------- upstream column
_RE_DECODED = re.compile(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s")
_RE_KV = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s+=\s+(\d+)")
_RE_STATS = re.compile(r"#gen drafts\s+=\s+(\d+), #acc drafts\s+=\s+(\d+), #gen tokens\s+=\s+(\d+), "
                       r"#acc tokens\s+=\s+(\d+), #mean acc len\s+=\s+([\d.]+), #acc rate/pos = \(([^)]*)\)"
                       r"(?:, dur\(b,g,a\) = ([\d.]+), ([\d.]+), ([\d.]+) ms)?")


def _r(x, nd: int = 2):
    return None if x is None else round(x, nd)


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


def _run_watch_rss(cmd: list[str], tmp: Path, timeout: float) -> tuple[int, bytes, str, float | None]:
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
    return p.returncode, fo.read_bytes(), fe.read_text(encoding="utf-8", errors="replace"), hwm


def spec_type(draft: Path) -> str:
    """Upstream's ``--spec-type`` for a drafter GGUF: ``draft-dspark`` for one with a Markov head (its
    driver reads a DSpark block differently), else ``draft-dflash`` (DFlash2 is told apart inside)."""
    from dflash_gguf.native.gguf_check import drafter_kind, parse_gguf

    return "draft-dspark" if drafter_kind(parse_gguf(draft)) == "dspark" else "draft-dflash"


def run_upstream_one(exe: Path, target: Path, draft: Path | None, prompt: str, n: int, n_draft: int,
                     threads: int, timeout: float = 600, extra: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Run llama-speculative-simple once; returns (parsed numbers, generated text).

    The prompt goes in with ``-p`` and ``--no-escape`` (``-f`` would drop a final newline). Its log
    goes through an asynchronous writer thread that now and then loses the last lines at exit (the
    timings and the end of the generated text); that happens far less with ``--log-file``, and a run
    whose stderr lacks the final ``decoded`` line is repeated."""
    import tempfile

    # no drafter: a drafter-free --spec-type in extra (upstream's n-gram modes)
    drafter = [] if draft is None else ["-md", str(draft), "--spec-type", spec_type(draft)]
    cmd = [str(exe), "-m", str(target), *drafter, "--spec-draft-n-max", str(n_draft),
           "-p", prompt, "--no-escape", "-n", str(n), "--temp", "0",
           "--top-k", "1", "--seed", "42", "-lv", "4", "-t", str(threads), "-c", "2048", *extra]
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


def upstream_generated(stdout: bytes, echo: bytes) -> bytes:
    """The generated bytes from its stdout ("\\n\\n" + prompt pieces + generation + "\\n\\n")."""
    s = stdout[2:] if stdout.startswith(b"\n\n") else stdout
    if s.startswith(echo):
        s = s[len(echo):]
    return s[:-2] if s.endswith(b"\n\n") else s


def run_upstream(exe, target, draft, prompts, echoes, max_tokens, n_draft, threads, res: ModeResult,
                 ours_raw: dict[str, bytes], plain_raw: dict[str, bytes], record: bool, extra: tuple[str, ...] = ()) -> float:
    n_tok, t_dec = 0, 0.0
    for p, echo in zip(prompts, echoes):
        got, out = run_upstream_one(exe, target, draft, p["text"], max_tokens, n_draft, threads, extra=extra)
        key = f"{p['set']}/{p['name']}"
        n_tok += got["n_decoded"]
        t_dec += got["t_decode"]
        res.stats.n_generated += got["n_decoded"]
        if got.get("peak_rss_mb"):
            res.extra["peak_rss_mb"] = _r(max(res.extra.get("peak_rss_mb") or 0.0, got["peak_rss_mb"]), 1)
        if "gen_drafts" in got:
            g, rp = got["gen_drafts"], got.get("rate_pos", [])
            # upstream prints per-position rates per draft: weight them by the number of drafts
            res.stats.merge(GenerationStats(steps=g, drafted=got["gen_tokens"], accepted=got["acc_tokens"],
                                            drafted_per_pos=[g] * len(rp), accepted_per_pos=[r * g for r in rp]))
            if "t_draft_ms" in got:   # upstream reports its draft time; the rest of its decode is "other"
                td = got["t_draft_ms"] / 1000
                res.phase["draft"] = res.phase.get("draft", 0.0) + td
                res.phase["other"] = res.phase.get("other", 0.0) + max(0.0, got["t_decode"] - td)
        pp = res.per_prompt.setdefault(key, {"tps": []})
        pp["tps"].append(got["tps"])
        if "mean_acc_len" in got:
            pp["acceptance_length"] = got["mean_acc_len"]
        if record:
            raw = upstream_generated(out, echo)
            res.raw[key] = raw
            res.texts[key] = raw.decode("utf-8", "replace")
            # byte-exact on the common part: upstream runs whole blocks past -n and stops before an EOS
            for name, refs in (("ours", ours_raw), ("plain", plain_raw)):
                ref = refs.get(key)
                pp[f"tokens_equal_{name}"] = None if ref is None else (raw.startswith(ref) or ref.startswith(raw))
            res.extra.setdefault("command_example", " ".join(repr(c) if "\n" in c or " " in c else c
                                                             for c in got["cmd"]))
    tps = n_tok / t_dec if t_dec > 0 else 0.0
    res.trial_tps.append(tps)
    return tps
