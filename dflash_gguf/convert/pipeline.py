"""``convert_pair``: validate, convert both models, quantize, write the manifest, publish atomically.

Everything is written into a staging directory next to ``out_dir`` and renamed into place only
when every step succeeded, so a failure (or Ctrl-C) never leaves a partial pair behind. An
existing pair is replaced only with ``force=True``, and it stays intact if the new one fails.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_gguf.convert import draft_vocab as dvocab
from dflash_gguf.convert import manifest as mf
from dflash_gguf.convert import upstream
from dflash_gguf.convert.errors import OutputError, PairError
from dflash_gguf.convert.quantize import QTYPES, quantize_file
from dflash_gguf.convert.validate import PairSpec, validate_pair

log = logging.getLogger("dflash_gguf.convert")

FLOAT_TYPES = ("f32", "f16", "bf16")
DRAFTER_TYPES = tuple(dict.fromkeys(upstream.OUTTYPES + tuple(QTYPES)))
_BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k_m": 0.63}


@dataclass
class Recipe:
    """How one GGUF is made: upstream converter at ``convert_type``, then optionally llama.cpp quantize."""
    convert_type: str
    quantize_type: str | None

    @property
    def final_type(self) -> str:
        return self.quantize_type or self.convert_type


def plan(outtype: str, quantize: str | None, drafter_outtype: str | None) -> tuple[Recipe, Recipe]:
    """Recipes for (target, drafter); raise ValueError for a contradictory combination."""
    if outtype not in upstream.OUTTYPES:
        raise ValueError(f"--outtype must be one of {', '.join(upstream.OUTTYPES)}, got {outtype!r}")
    if quantize is not None and quantize not in QTYPES:
        raise ValueError(f"--quantize must be one of {', '.join(QTYPES)}, got {quantize!r}")
    if drafter_outtype is not None and drafter_outtype not in DRAFTER_TYPES:
        raise ValueError(f"--drafter-outtype must be one of {', '.join(DRAFTER_TYPES)}, got {drafter_outtype!r}")
    target = Recipe(outtype, quantize if quantize not in (None, outtype) else None)
    if drafter_outtype is None or drafter_outtype == target.final_type:
        drafter = target
    elif drafter_outtype in upstream.OUTTYPES:
        drafter = Recipe(drafter_outtype, None)
    else:
        drafter = Recipe(outtype, drafter_outtype)
    for r in (target, drafter):
        if r.quantize_type and r.convert_type not in FLOAT_TYPES:
            raise ValueError(f"cannot quantize to {r.quantize_type} from --outtype {r.convert_type}: use "
                             "--outtype f16 (or f32/bf16) with --quantize, so llama.cpp quantizes from floats")
    return target, drafter


def convert_pair(target_dir: str | os.PathLike, drafter_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                 outtype: str = "f16", quantize: str | None = None, drafter_outtype: str | None = None,
                 threads: int | None = None, force: bool = False, draft_vocab: str | int | None = "auto",
                 vocab_corpus: list[str] | None = None, sliding_window: str = "auto") -> mf.PairManifest:
    """Convert a Hugging Face target + DFlash drafter into a validated GGUF pair directory.

    Raises :class:`PairError` (bad inputs, checked before any heavy work), :class:`OutputError`
    (output not writable, already a pair without ``force``, disk full) or :class:`ConvertError`.
    """
    t0 = time.perf_counter()
    t_recipe, d_recipe = plan(outtype, quantize, drafter_outtype)
    log.info("checking the pair: target %s, drafter %s", target_dir, drafter_dir)
    spec = validate_pair(target_dir, drafter_dir, sliding_window=sliding_window)
    log.info("pair OK: %s target %s (%d layers, hidden %d, vocab %d) + %s drafter (block %d, HF taps %s -> "
             "GGUF target_layers %s, mask token %d)", spec.target_arch, spec.target.architecture, spec.n_layer,
             spec.hidden_size, spec.vocab_size, spec.kind, spec.block_size, spec.target_layer_ids,
             spec.gguf_target_layers, spec.mask_token_id)
    top_k = (spec.drafter.get("dflash_config") or {}).get("selector_top_k") or spec.drafter.get("selector_top_k")
    draft_vocab = _dspark_draft_vocab(spec, draft_vocab)
    dvocab.precheck(draft_vocab, vocab_corpus, spec.vocab_size, min_size=int(top_k or 1))
    upstream.check_dependencies()
    upstream.converter_script()
    out = Path(out_dir).expanduser().absolute()
    _check_output(out, force)
    _check_space(spec, out.parent, t_recipe, d_recipe)
    staging = _make_staging(out)
    published = False
    try:
        t_name, d_name = _file_names(spec, t_recipe.final_type, d_recipe.final_type)
        t_file = _produce(spec.target.path, staging / t_name, t_recipe, None, threads, "target")
        with _config_overlay(spec.drafter.path, spec.overlay) as d_src:
            d_file = _produce(d_src, staging / d_name, d_recipe, spec.target.path, threads, "drafter")
        if spec.dspark is not None and spec.dspark.draft_vocab_size:
            dv = {"size": spec.dspark.draft_vocab_size, "of": spec.vocab_size, "method": "checkpoint",
                  "why": "the drafter's own reduced head (its d2t), kept as trained"}
        else:
            dv = dvocab.apply(d_file, t_file, dvocab.parse_size(draft_vocab), vocab_corpus)
        log.info("writing %s (sha256 of both files)", mf.MANIFEST)
        doc = mf.build_manifest(spec, t_file, t_recipe.final_type, d_file, d_recipe.final_type)
        doc["draft_vocab"] = dv
        mf.write_manifest(staging, doc)
        _publish(staging, out)
        published = True
    except OutputError:
        raise
    except OSError as e:
        raise OutputError(_os_message(e, out)) from e
    finally:
        if not published:
            shutil.rmtree(staging, ignore_errors=True)
    result = mf.load_manifest(out)
    log.info("%s", summary(result, time.perf_counter() - t0))
    return result


def _dspark_draft_vocab(spec: PairSpec, draft_vocab: str | int | None) -> str | int | None:
    """A DSpark Markov head's ``markov_w2`` rows are the draft vocabulary it was trained with, so this
    converter keeps that vocabulary (full, or the checkpoint's own d2t head) and does not reduce it."""
    info = spec.dspark
    if info is None or (info.markov_rank == 0 and not info.draft_vocab_size):
        return draft_vocab
    size = dvocab.parse_size(draft_vocab)
    if isinstance(size, int):
        what = (f"its own reduced head of {info.draft_vocab_size} tokens" if info.draft_vocab_size
                else "the full vocabulary")
        raise PairError(f"--draft-vocab {size}: a DSpark drafter keeps the draft vocabulary it was trained with "
                        f"({what}; its Markov head's markov_w2 rows are that vocabulary): leave --draft-vocab out")
    return "off"


def summary(m: mf.PairManifest, seconds: float) -> str:
    def one(f: mf.PairFile) -> str:
        return f"{f.path.name} ({f.type}, {_human(f.size)})"
    return (f"pair written to {m.dir} in {seconds:.1f} s: target {one(m.target)}, {m.kind} drafter {one(m.drafter)}, "
            f"block {m.block_size}, target_layers {m.target_layers}")


# ------------------------------------------------------------------ steps
class _config_overlay:
    """``src`` itself, or (with ``overlay``) a temporary folder of links to its files whose config.json has
    those keys set: what the upstream converter reads when a config must be read differently (a window)."""

    def __init__(self, src: Path, overlay: dict):
        self.src, self.overlay, self.tmp = Path(src), overlay, None

    def __enter__(self) -> Path:
        if not self.overlay:
            return self.src
        self.tmp = tempfile.TemporaryDirectory(prefix="dflash-drafter-config-")
        d = Path(self.tmp.name)
        for f in self.src.iterdir():
            if f.name != "config.json":
                (d / f.name).symlink_to(f.resolve())
        cfg = json.loads((self.src / "config.json").read_text(encoding="utf-8"))
        cfg.update(self.overlay)
        (d / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        log.info("drafter config read with %s", ", ".join(f"{k}={v!r}" for k, v in self.overlay.items()
                                                          if k != "dflash_config"))
        return d

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def _produce(hf_dir: Path, final: Path, recipe: Recipe, target_dir: Path | None, threads: int | None,
             what: str) -> Path:
    t0 = time.perf_counter()
    if recipe.quantize_type is None:
        log.info("converting the %s to %s: %s", what, recipe.convert_type, final.name)
        upstream.run_converter(hf_dir, final, recipe.convert_type, target_dir=target_dir, threads=threads, what=what)
    else:
        tmp = final.with_name(f".{final.stem}.{recipe.convert_type}.gguf")
        log.info("converting the %s to %s (intermediate)", what, recipe.convert_type)
        upstream.run_converter(hf_dir, tmp, recipe.convert_type, target_dir=target_dir, threads=threads, what=what)
        log.info("quantizing the %s to %s with llama.cpp: %s", what, recipe.quantize_type, final.name)
        quantize_file(tmp, final, recipe.quantize_type, threads)
        tmp.unlink()
    log.info("%s done: %s, %s in %.1f s", what, final.name, _human(final.stat().st_size), time.perf_counter() - t0)
    return final


def _file_names(spec: PairSpec, t_type: str, d_type: str) -> tuple[str, str]:
    def clean(p: Path) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "-", p.name).strip(".-") or "model"
    t, d = clean(spec.target.path), clean(spec.drafter.path)
    if d == t:
        d += "-drafter"
    return f"{t}-{t_type.upper()}.gguf", f"{d}-{d_type.upper()}.gguf"


# ------------------------------------------------------------------ output directory
def _check_output(out: Path, force: bool) -> None:
    if out.is_dir():
        try:
            entries = [e.name for e in out.iterdir()]
        except OSError as e:
            raise OutputError(f"output directory {out} cannot be read ({e.strerror or e})") from e
        if entries and mf.MANIFEST not in entries:
            raise OutputError(f"output directory {out} is not empty and holds no converted pair: choose a new "
                              "or empty directory (--force only replaces a previous pair)")
        if entries and not force:
            raise OutputError(f"output directory {out} already holds a pair: pass --force (force=True) to "
                              "replace it, or choose another directory")
    elif out.exists() or out.is_symlink():
        raise OutputError(f"output path {out} exists and is not a directory: choose another -o")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the output directory's parent {out.parent} ({e.strerror or e}): "
                          "choose a writable location for -o") from e


def _check_space(spec: PairSpec, where: Path, t: Recipe, d: Recipe) -> None:
    def need(ck, r: Recipe) -> float:
        n = ck.n_params if ck.headers_checked else ck.weight_bytes / 2
        return n * (_BYTES_PER_WEIGHT[r.convert_type] + (_BYTES_PER_WEIGHT[r.quantize_type] if r.quantize_type else 0))
    want = need(spec.target, t) + need(spec.drafter, d) + (16 << 20)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if free < want:
        raise OutputError(f"not enough disk space in {where}: the pair needs about {_human(want)} while it is "
                          f"being written, {_human(free)} is free. Free some space or choose another -o")


def _make_staging(out: Path) -> Path:
    staging = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        staging.mkdir()
    except OSError as e:
        raise OutputError(f"cannot write in {out.parent} ({e.strerror or e}): choose a writable location for -o") from e
    return staging


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished staging directory to ``out``; an old pair there is swapped out, then removed."""
    if not out.exists():
        os.rename(staging, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out, old)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _os_message(e: OSError, out: Path) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"disk full while writing the pair for {out} ({e.strerror or e}); nothing was left behind. "
                "Free some space or choose another -o")
    return f"writing the pair for {out} failed ({e}); nothing was left behind. Check the output location"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
