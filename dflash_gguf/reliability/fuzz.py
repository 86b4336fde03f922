"""Hostile model files: mutate GGUF pairs and their manifests, open each through every loader.

    python -m dflash_gguf.reliability.fuzz                 # CI size (60 cases, demo pair)
    python -m dflash_gguf.reliability.fuzz --full          # every generated case (>= 300 files)
    python -m dflash_gguf.reliability.fuzz --no-precheck   # the same without the Python pre-validation

Each case is a pair directory (``target.gguf``, ``drafter.gguf``, ``pair.json``) with one thing
wrong: a file truncated at a section boundary or a random offset, flipped bytes in the header, the
key/value or tensor-info section or the data, wrong tensor types and shapes, absurd counts and
hyperparameters, wrong or missing DFlash fields, a drafter from another pair, a ``pair.json`` that
points at the wrong file, swaps them or records another sha256. A worker process opens every case
through four entry points - ``Model``/``Context``/``DFlashDecoder`` (plus a 6-token generation),
``Llama(...)``, ``Llama.from_pair(..., verify=True)`` and the server's start-up (``load_llama`` +
``create_app``) - and reports per entry point ``ok`` or the exception. Allowed: ``ok`` or a typed
error (:class:`~dflash_gguf.errors.DFlashError` and subclasses, ``FileNotFoundError``). Failures:
another exception (``untyped``), the worker dying on a signal (``crash``: abort, segfault, ...) or
running past the time limit (``timeout``). A worker that dies is replaced; the case in flight is
charged with the crash.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import queue
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dflash_gguf import paths
from dflash_gguf.native.gguf_check import drafter_kind, parse_gguf
from dflash_gguf.reliability import mutate as M

log = logging.getLogger("dflash_gguf.reliability.fuzz")

STAGES = ("model", "llama", "from_pair", "server")
CI_CASES = 60
DEMO_DIR = paths.DEMO_DIR
PROMPT = b"def f(x):"


# --------------------------------------------------------------------------- bases and cases
@dataclass
class Base:
    """An unmutated pair: two GGUF files and the pair.json that describes them."""
    name: str
    target: Path
    drafter: Path
    manifest: dict = field(default_factory=dict)

    def __post_init__(self):
        self.th = parse_gguf(self.target)
        self.dh = parse_gguf(self.drafter)
        if not self.manifest:
            self.manifest = make_manifest(self.target, self.drafter, self.dh)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_manifest(target: Path, drafter: Path, dh) -> dict:
    """A pair.json for two files (what ``python -m dflash_gguf.convert`` writes, minimally)."""
    kind = drafter_kind(dh)

    def entry(p: Path, name: str) -> dict:
        b = p.read_bytes()
        return {"file": name, "size": len(b), "sha256": sha256(b), "type": "f32"}
    mask = dh.get("tokenizer.ggml.mask_token_id", 0)
    return {"format": "dflash-gguf-pair", "format_version": 1, "kind": kind,
            "block_size": dh.get("dflash.block_size", 16), "mask_token_id": mask,
            "target_layers": list(dh.get("dflash.target_layers", [])),
            "target": entry(target, "target.gguf"), "drafter": entry(drafter, "drafter.gguf")}


@dataclass
class Case:
    id: int
    base: str
    cls: str
    desc: str
    # writes the case directory from the base: (base, out_dir) -> None
    make: Callable[["Base", Path], None]


def _write_pair(base: Base, out: Path, *, target: bytes | None = None, drafter: bytes | None = None,
                manifest: dict | None = None, keep_manifest: bool = False) -> None:
    """The base pair with ``target``/``drafter`` bytes replaced; pair.json follows the new files
    (size, sha256) unless ``keep_manifest`` (then it records the base files' values)."""
    out.mkdir(parents=True, exist_ok=True)
    doc = json.loads(json.dumps(manifest if manifest is not None else base.manifest))
    for role, data, src in (("target", target, base.target), ("drafter", drafter, base.drafter)):
        dst = out / f"{role}.gguf"
        if data is None:
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)
        else:
            dst.write_bytes(data)
            if not keep_manifest and isinstance(doc.get(role), dict):
                doc[role]["size"], doc[role]["sha256"] = len(data), sha256(data)
    (out / "pair.json").write_text(json.dumps(doc, indent=1))


def file_cases(base: Base, role: str, rng: random.Random, scale: int) -> list[tuple[str, str, Callable]]:
    h = base.th if role == "target" else base.dh
    muts: list[M.FileMutation] = []
    muts += M.truncations(h, rng, n_random=2 * scale)
    muts += M.header_flips(h, rng, n_random=scale)
    muts += M.section_flips(h, rng, n_kv=3 * scale, n_ti=2 * scale, n_data=max(1, scale // 2))
    muts += M.tensor_edits(h, rng, n_type=2 * scale, n_shape=2 * scale)
    muts += M.absurd_counts(h, rng)
    muts += M.hparam_edits(h, rng, n=8 * scale)
    muts += M.hparam_additions(h)
    muts += M.kv_structure(h, rng, n_remove=2 * scale, n_retype=2 * scale)
    if role == "drafter":
        muts += M.drafter_fields(h, int(base.th.get(f"{base.th.arch}.block_count", 0)),
                                 int(base.th.kv["tokenizer.ggml.tokens"].count if "tokenizer.ggml.tokens" in base.th.kv else 0))
    src = base.target if role == "target" else base.drafter

    def maker(m: M.FileMutation):
        def make(b: Base, out: Path):
            data = m.fn(src.read_bytes())
            _write_pair(b, out, **{role: data})
        return make
    return [(m.cls, f"{role}: {m.desc}", maker(m)) for m in muts]


def pair_cases(base: Base, others: list[Base]) -> list[tuple[str, str, Callable]]:
    out = []
    mf = base.manifest

    def edit(fn):
        def make(b: Base, o: Path):
            doc = json.loads(json.dumps(mf))
            fn(doc)
            _write_pair(b, o, manifest=doc)
        return make

    def raw(text: str):
        def make(b: Base, o: Path):
            _write_pair(b, o)
            (o / "pair.json").write_text(text)
        return make

    out.append(("pair", "pair.json: target and drafter entries swapped",
                edit(lambda d: d.update(target=d["drafter"], drafter=d["target"]))))
    out.append(("pair", "pair.json: target entry names the drafter file (size, sha256 consistent)",
                edit(lambda d: d.update(target=dict(d["drafter"])))))
    out.append(("pair", "pair.json: drafter entry names the target file (size, sha256 consistent)",
                edit(lambda d: d.update(drafter=dict(d["target"])))))
    out.append(("pair", "pair.json: drafter file name does not exist",
                edit(lambda d: d["drafter"].update(file="missing.gguf"))))
    out.append(("pair", "pair.json: file name with a directory part",
                edit(lambda d: d["target"].update(file="../target.gguf"))))
    out.append(("pair", "pair.json: target size off by one", edit(lambda d: d["target"].update(size=d["target"]["size"] + 1))))
    out.append(("pair", "pair.json: block_size disagrees with the drafter",
                edit(lambda d: d.update(block_size=int(d["block_size"]) * 2))))
    out.append(("pair", "pair.json: target_layers disagree with the drafter",
                edit(lambda d: d.update(target_layers=[x + 1 for x in d["target_layers"]]))))
    out.append(("pair", "pair.json: mask_token_id disagrees with the drafter",
                edit(lambda d: d.update(mask_token_id=int(d["mask_token_id"]) + 1))))
    out.append(("pair", "pair.json: kind disagrees with the drafter",
                edit(lambda d: d.update(kind="dflash2" if d["kind"] == "dflash" else "dflash"))))
    if mf.get("kind") == "dspark":     # a DSpark drafter described as the DFlash drafter it extends
        out.append(("pair", "pair.json: kind 'dflash' for a DSpark drafter (markov_w1 present)",
                    edit(lambda d: d.update(kind="dflash"))))
    out.append(("pair", "pair.json: truncated JSON", raw(json.dumps(mf)[:40])))
    out.append(("pair", "pair.json: a list, not an object", raw("[1, 2, 3]")))
    out.append(("pair", "pair.json: empty", raw("")))
    out.append(("pair", "pair.json: format_version 99", edit(lambda d: d.update(format_version=99))))
    out.append(("pair", "pair.json: block_size is a string", edit(lambda d: d.update(block_size="eight"))))

    def sha_mismatch(b: Base, o: Path):
        data = bytearray(b.target.read_bytes())
        off = b.th.data_start + (b.th.size - b.th.data_start) // 3
        data[off] ^= 0x40
        _write_pair(b, o, target=bytes(data), keep_manifest=True)
    out.append(("pair", "sha256 mismatch: one data byte of the target changed, pair.json unchanged", sha_mismatch))

    def missing(role):
        def make(b: Base, o: Path):
            _write_pair(b, o)
            (o / f"{role}.gguf").unlink()
        return make
    out.append(("pair", "drafter file deleted", missing("drafter")))
    out.append(("pair", "target file deleted", missing("target")))
    for other in others:
        def cross(b: Base, o: Path, other=other):
            _write_pair(b, o, drafter=other.drafter.read_bytes())
        out.append(("cross-pair", f"drafter of {other.name} with this target", cross))
    return out


def build_cases(bases: list[Base], seed: int, scale: int) -> list[Case]:
    rng = random.Random(seed)
    raw = []
    for b in bases:
        for role in ("target", "drafter"):
            raw += [(b.name, *c) for c in file_cases(b, role, rng, scale)]
        raw += [(b.name, *c) for c in pair_cases(b, [o for o in bases if o is not b])]
    return [Case(i, name, cls, desc, make) for i, (name, cls, desc, make) in enumerate(raw)]


def sample(cases: list[Case], n: int, seed: int) -> list[Case]:
    """At most ``n`` cases, spread over the mutation classes (round robin, seeded)."""
    if n >= len(cases):
        return cases
    by = defaultdict(list)
    for c in cases:
        by[c.cls].append(c)
    rng = random.Random(seed)
    for v in by.values():
        rng.shuffle(v)
    out, classes = [], sorted(by)
    while len(out) < n:
        for k in classes:
            if by[k] and len(out) < n:
                out.append(by[k].pop())
    return sorted(out, key=lambda c: c.id)


# --------------------------------------------------------------------------- the worker (child process)
def _worker(no_precheck: bool) -> int:
    """Read case directories from stdin; write one JSON line per stage to stdout."""
    # the protocol gets the real stdout; anything else printing there (C or Python) goes to stderr
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    from dflash_gguf.native.logs import set_log_handler
    set_log_handler()
    from dflash_gguf import api
    from dflash_gguf.native import engine
    from dflash_gguf.errors import DFlashError
    if no_precheck:   # measure what llama.cpp alone does with the file
        api.check_gguf = engine.check_gguf = lambda *a, **k: None
        api.check_manifest = lambda *a, **k: None

    kw = dict(n_ctx=128, n_batch=64, n_threads=1, n_threads_batch=1, verbose=False, seed=0)

    def stage_model(d: Path):
        from dflash_gguf.native.engine import Context, ContextOptions, Model
        from dflash_gguf.decoding import DFlashDecoder
        opts = ContextOptions(n_ctx=128, n_batch=64, n_ubatch=64, n_threads=1)
        with Model(d / "target.gguf") as t, Model(d / "drafter.gguf") as dm:
            with Context(t, opts) as tc, Context(dm, opts, other=tc) as dc:
                dec = DFlashDecoder(tc, dc)
                list(dec.generate(t.tokenize(PROMPT), 6))

    def stage_llama(d: Path):
        llm = api.Llama(str(d / "target.gguf"), draft_model_path=str(d / "drafter.gguf"), **kw)
        try:
            llm(PROMPT.decode(), max_tokens=6, temperature=0)
        finally:
            llm.close()

    def stage_pair(d: Path):
        llm = api.Llama.from_pair(d, verify=True, **kw)
        try:
            llm(PROMPT.decode(), max_tokens=6, temperature=0)
        finally:
            llm.close()

    def stage_server(d: Path):
        try:
            from dflash_gguf import server
        except ImportError:
            return "skipped"
        from dflash_gguf.options import load_llama
        args = server.parser().parse_args(["--pair", str(d), "-t", "1"])
        llm = load_llama(args)
        try:
            server.create_app(llm)
        finally:
            llm.close()

    stages = {"model": stage_model, "llama": stage_llama, "from_pair": stage_pair, "server": stage_server}
    for line in sys.stdin:
        job = json.loads(line)
        d = Path(job["dir"])
        for name in job.get("stages", STAGES):
            print(json.dumps({"case": job["case"], "start": name}), file=proto, flush=True)
            try:
                res = stages[name](d)
                outcome, err = (res or "ok"), None
            except (DFlashError, FileNotFoundError) as e:
                outcome, err = "typed", f"{type(e).__name__}: {e}"
            except BaseException as e:   # SystemExit too: a loader must not exit the process
                outcome, err = "untyped", f"{type(e).__name__}: {e}"
            print(json.dumps({"case": job["case"], "stage": name, "outcome": outcome, "error": err}), file=proto,
                  flush=True)
        print(json.dumps({"case": job["case"], "done": True}), file=proto, flush=True)
    return 0


# --------------------------------------------------------------------------- the driver
class Worker:
    """One child process running :func:`_worker`; replaced when it dies."""

    def __init__(self, no_precheck: bool, mem_gb: float, log_dir: Path):
        self.args = [sys.executable, "-m", "dflash_gguf.reliability.fuzz", "--worker"] + \
            (["--no-precheck"] if no_precheck else [])
        self.mem = int(mem_gb * 2 ** 30)
        self.log_dir = log_dir
        self.n = 0
        self.proc = None
        self._start()

    def _limits(self):
        resource.setrlimit(resource.RLIMIT_AS, (self.mem, self.mem))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    def _start(self):
        self.n += 1
        self.err_path = self.log_dir / f"worker-{self.n}.stderr"
        self.err = open(self.err_path, "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1", GGML_NO_BACKTRACE="1")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, bufsize=1, preexec_fn=self._limits, env=env)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.q), daemon=True).start()

    @staticmethod
    def _read(proc, q):
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    def stderr_tail(self, n: int = 6) -> str:
        self.err.flush()
        with open(self.err_path, "rb") as f:
            f.seek(self.err_pos)
            lines = f.read().decode(errors="replace").strip().splitlines()
        key = [ln for ln in lines if any(k in ln for k in ("GGML_ASSERT", "error", "terminate", "what()", "Error"))]
        return " | ".join(ln.strip() for ln in (key or lines)[-n:])

    def run(self, case_id: int, d: Path, timeout: float) -> dict:
        """Stage outcomes of one case, plus ``fatal`` ('crash: SIGABRT', 'timeout', ...) if the worker died."""
        res = {"stages": {}, "errors": {}}
        self.err_pos = self.err_path.stat().st_size
        try:
            self.proc.stdin.write(json.dumps({"case": case_id, "dir": str(d)}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        current = None
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.proc.wait()
                res["fatal"], res["stage"] = "timeout", current
                break
            if line is None:   # the worker died
                rc = self.proc.wait()
                sig = -rc if rc < 0 else None
                name = signal.Signals(sig).name if sig else f"exit {rc}"
                res["fatal"], res["stage"] = (f"crash: {name}" if sig else f"exit: {name}"), current
                res["stderr"] = self.stderr_tail()
                break
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if "start" in msg:
                current = msg["start"]
            elif "stage" in msg:
                res["stages"][msg["stage"]] = msg["outcome"]
                if msg["error"]:
                    res["errors"][msg["stage"]] = msg["error"][:300]
            elif msg.get("done"):
                return res
        self.err.close()
        self._start()
        return res

    def close(self):
        if self.proc and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.err.close()


def verdict(res: dict) -> str:
    if "fatal" in res:
        return "crash" if res["fatal"].startswith(("crash", "exit")) else "timeout"
    outs = set(res["stages"].values())
    return "untyped" if "untyped" in outs else ("typed" if "typed" in outs else "ok")


def default_bases(tiny_dir: Path | None = None) -> list[Base]:
    bases = [Base("demo", DEMO_DIR / "target.gguf", DEMO_DIR / "drafter.gguf",
                  json.loads((DEMO_DIR / "pair.json").read_text()))]
    bases[0].manifest["target"]["file"], bases[0].manifest["drafter"]["file"] = "target.gguf", "drafter.gguf"
    if tiny_dir is not None:
        bases += tiny_bases(tiny_dir)
    return bases


def tiny_bases(root: Path) -> list[Base]:
    """Pairs among the tests' tiny GGUFs in ``root``: ``{arch}.gguf`` + ``{arch}-{kind}-b{n}*.gguf``."""
    out = []
    for t in sorted(root.glob("*.gguf")):
        if "-" in t.stem:
            continue
        drafters = sorted(root.glob(f"{t.stem}-d*-b*.gguf"))
        for kind in ("dflash", "dflash2", "dspark"):
            pick = [d for d in drafters if d.stem.startswith(f"{t.stem}-{kind}-b")]
            if pick:
                out.append(Base(pick[0].stem, t, pick[0]))
    return out


def run(bases: list[Base], n_cases: int | None, *, seed: int = 0, scale: int = 3, no_precheck: bool = False,
        timeout: float = 120.0, mem_gb: float = 8.0, keep: Path | None = None, only: list[int] | None = None) -> dict:
    cases = build_cases(bases, seed, scale)
    chosen = cases if n_cases is None else sample(cases, n_cases, seed)
    if only:
        chosen = [c for c in cases if c.id in only]
    by_name = {b.name: b for b in bases}
    work = Path(tempfile.mkdtemp(prefix="dflash-fuzz-"))
    results, t0 = [], time.monotonic()
    worker = Worker(no_precheck, mem_gb, work)
    try:
        for i, c in enumerate(chosen):
            d = work / f"case-{c.id:05d}"
            c.make(by_name[c.base], d)
            res = worker.run(c.id, d, timeout)
            v = verdict(res)
            results.append({"id": c.id, "base": c.base, "class": c.cls, "desc": c.desc, "verdict": v, **res})
            if v in ("crash", "timeout", "untyped"):
                log.warning("case %d (%s, %s): %s %s %s", c.id, c.base, c.desc, v, res.get("fatal", ""),
                            res.get("stderr", "") or res.get("errors", ""))
            if keep is not None and v in ("crash", "timeout", "untyped"):
                shutil.copytree(d, keep / d.name, dirs_exist_ok=True)
            shutil.rmtree(d, ignore_errors=True)
            if (i + 1) % 25 == 0:
                log.info("%d/%d cases, %.0f s", i + 1, len(chosen), time.monotonic() - t0)
    finally:
        worker.close()
        shutil.rmtree(work, ignore_errors=True)
    per_class = defaultdict(Counter)
    for r in results:
        per_class[r["class"]][r["verdict"]] += 1
    total = Counter(r["verdict"] for r in results)
    return {"cases": len(results), "generated": len(cases), "seed": seed, "precheck": not no_precheck,
            "bases": [b.name for b in bases], "seconds": round(time.monotonic() - t0, 1),
            "verdicts": dict(total), "per_class": {k: dict(v) for k, v in sorted(per_class.items())},
            "failures": [r for r in results if r["verdict"] in ("crash", "timeout", "untyped")],
            "results": results}


def summary(rep: dict) -> str:
    v = rep["verdicts"]
    lines = [f"{rep['cases']} cases ({rep['generated']} generated) on {', '.join(rep['bases'])}, "
             f"pre-validation {'on' if rep['precheck'] else 'off'}, {rep['seconds']} s",
             f"  ok {v.get('ok', 0)}, typed error {v.get('typed', 0)}, untyped error {v.get('untyped', 0)}, "
             f"crash {v.get('crash', 0)}, timeout {v.get('timeout', 0)}"]
    for k, c in rep["per_class"].items():
        lines.append(f"  {k:<18} " + ", ".join(f"{n} {c[n]}" for n in ("ok", "typed", "untyped", "crash", "timeout") if c.get(n)))
    for f in rep["failures"][:40]:
        lines.append(f"  FAIL #{f['id']} {f['base']} {f['desc']}: {f['verdict']} {f.get('fatal', '')} "
                     f"stage={f.get('stage') or ''} {f.get('stderr', '') or f.get('errors', '')}"[:400])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.reliability.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=CI_CASES, help=f"cases to run (default {CI_CASES}; spread over classes)")
    ap.add_argument("--full", action="store_true", help="run every generated case")
    ap.add_argument("--scale", type=int, default=3, help="random mutations per class and file (default 3)")
    ap.add_argument("--tiny-dir", type=Path, default=None,
                    help="also fuzz the tests' tiny pairs found in this folder ({arch}.gguf + {arch}-dflash*-b*.gguf)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-precheck", action="store_true", help="disable the Python pre-validation (for comparison)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--json", type=Path, default=None, help="write the full report here")
    ap.add_argument("--keep", type=Path, default=None, help="copy failing case directories here")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="run only these case ids")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.no_precheck)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    rep = run(default_bases(args.tiny_dir), None if args.full else args.cases, seed=args.seed, scale=args.scale,
              no_precheck=args.no_precheck, timeout=args.timeout, keep=args.keep, only=args.only)
    print(summary(rep))
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))
    bad = sum(rep["verdicts"].get(k, 0) for k in ("crash", "timeout", "untyped"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
