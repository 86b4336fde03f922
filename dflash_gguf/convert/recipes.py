"""The catalogue of known public target/drafter pairs (``convert/*.json`` at the top of the project).

One small JSON file per pair: target and drafter repos (and revisions), kind, the drafter config's
schema, block size, taps, mask token, recommended quantization, licences, the acceptance the model
card reports. A field that could not be confirmed from public sources is ``null`` (unknown): the
converter then takes the value from the checkpoint's own config and validates it as for any pair, and
:func:`check_against` only compares the fields the recipe knows.

Two kinds of entry:

* a Hugging Face drafter (``drafter.format`` ``"hf"``, the default): ``--recipe`` converts the pair;
* a ready GGUF drafter (``drafter.format`` ``"gguf"`` with ``filename``, and ``target.gguf`` naming a
  target GGUF): download only, nothing is converted; :meth:`Recipe.usage` says how to load the two
  files as they are.

:func:`load` checks every field's type and value, so a typo in a file fails here, naming the file and
the field, not later in a conversion.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.quantize import QTYPES

KINDS = ("dflash", "dflash2", "dspark")
# drafter config schemas: legacy (top-level block_size, dflash_config {mask_token_id, target_layer_ids});
# nested-2026-06 (block_size inside dflash_config, rope_parameters, layer_types with sliding_attention,
# sliding_window); dflash2 (DFlash2DraftModel: conv/selector keys, output_multiplier, final_logit_softcapping);
# the DSpark forms (dflash_gguf/convert/dspark.py): deepspec-flat (the target's config copied flat plus
# block_size, target_layer_ids, mask_token_id, markov_rank, ...), speculators (transformer_layer_config,
# aux_hidden_state_layer_ids), dspark-nested (DSparkDraftModel, DSpark fields in dflash_config)
SCHEMAS = ("legacy", "nested-2026-06", "dflash2", "deepspec-flat", "speculators", "dspark-nested")
DSPARK_SCHEMAS = ("deepspec-flat", "speculators", "dspark-nested")
FORMATS = ("hf", "gguf")
DRAFTER_ARCHS = {"dflash": ("DFlashDraftModel",), "dflash2": ("DFlash2DraftModel",),
                 "dspark": ("Qwen3DSparkModel", "Gemma4DSparkModel", "DSparkDraftModel", "DSparkSpeculator")}
BLOCK_MIN, BLOCK_MAX = 2, 64            # as validate.py

_TOP = {"name", "description", "kind", "schema", "target", "drafter", "block_size", "target_layer_ids",
        "mask_token_id", "recommended_quantization", "reported_acceptance", "chat", "notes", "sources"}
_SIDE = {"repo", "revision", "architecture", "num_hidden_layers", "hidden_size", "vocab_size", "license"}
_TARGET = _SIDE | {"gguf"}
_DRAFTER = _SIDE | {"format", "filename", "sliding_window"}


def catalogue_dir() -> Path:
    """``convert/`` of a source checkout, else the copy shipped in the wheel."""
    here = Path(__file__).resolve()
    checkout = here.parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "convert" / "README.md").is_file():
        return checkout / "convert"
    return here.parents[1] / "data" / "recipes"


@dataclass
class GgufFile:
    """A GGUF on the Hub: its repo and file name (a name or a glob matching one file; None: not known)."""
    repo: str
    filename: str | None


@dataclass
class Side:
    repo: str
    revision: str | None
    architecture: str | None
    num_hidden_layers: int | None
    license: str | None
    hidden_size: int | None = None
    vocab_size: int | None = None
    format: str = "hf"                  # drafter only: "hf" (convert) or "gguf" (ready, download only)
    filename: str | None = None         # drafter only, format "gguf": the GGUF file (name or glob)
    sliding_window: int | None = None   # drafter only: the config's sliding_window, when known
    gguf: GgufFile | None = None        # target only: the target GGUF to pair with a ready GGUF drafter


@dataclass
class Recipe:
    name: str
    description: str
    kind: str
    schema: str | None
    target: Side
    drafter: Side
    block_size: int | None
    target_layer_ids: list[int] | None
    mask_token_id: int | None
    recommended_quantization: str | None
    reported_acceptance: float | str | None
    chat: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    path: Path | None = None

    @property
    def download_only(self) -> bool:
        """A ready GGUF drafter: nothing to convert."""
        return self.drafter.format == "gguf"

    def unknown(self) -> list[str]:
        """The fields this recipe could not confirm."""
        out = [k for k in ("schema", "block_size", "target_layer_ids", "mask_token_id", "reported_acceptance")
               if getattr(self, k) is None]
        if self.download_only:          # the GGUFs carry their own shapes: only what loading them needs
            if self.target.gguf is not None and self.target.gguf.filename is None:
                out.append("target.gguf.filename")
            return [k for k in out if k not in ("block_size", "target_layer_ids", "mask_token_id")]
        out += [f"target.{k}" for k in ("architecture", "num_hidden_layers", "hidden_size", "vocab_size")
                if getattr(self.target, k) is None]
        out += [f"drafter.{k}" for k in ("num_hidden_layers", "license") if getattr(self.drafter, k) is None]
        return out

    def line(self) -> str:
        block = self.block_size if self.block_size is not None else "-" if self.download_only else "?"
        schema = self.schema or "?"
        if self.download_only:
            how = "ready GGUF, download only"
            pair = f"{self.target.gguf.repo if self.target.gguf else self.target.repo} + {self.drafter.repo}"
        else:
            how = self.recommended_quantization or "-"
            pair = f"{self.target.repo} + {self.drafter.repo}"
        return f"{self.name:40s} {self.kind:7s} {schema:14s} block {block!s:3s} {how:5s} {pair}"

    def usage(self) -> str:
        """How to run a download-only entry: the files as they are, loaded directly (no conversion)."""
        if not self.download_only:
            raise ValueError(f"recipe {self.name} is converted, not loaded directly")
        t = self.target.gguf
        tfile = t.filename if t.filename is not None else "<a GGUF file of " + t.repo + ">"
        d = self.drafter
        lines = [
            f"{self.name}: the drafter {d.repo} is a ready GGUF; it is not converted, it is loaded directly",
            "next to a GGUF of its target (no pair.json is needed; the drafter is checked against the target when",
            "they load). In Python:",
            "",
            "    from dflash_gguf import Llama",
            f"    llm = Llama.from_pretrained(repo_id={t.repo!r}, filename={tfile!r},",
            f"                                draft_repo_id={d.repo!r}, draft_filename={d.filename!r})",
            "",
            "or download both files and use the command line:",
            "",
            f"    hf download {t.repo} {tfile if t.filename else ''}".rstrip(),
            f"    hf download {d.repo} {d.filename}",
            f"    python -m dflash_gguf generate -m {Path(tfile).name if t.filename else 'TARGET.gguf'} "
            f"-md {Path(d.filename).name} \"def quicksort(xs):\"",
        ]
        if t.filename is None:
            lines += ["", f"The target's file is not recorded here: choose one quantization of {t.repo}."]
        if self.notes:
            lines += ["", "notes:"] + [f"  - {n}" for n in self.notes]
        return "\n".join(lines)


def _check_int(v, what: str, problems: list[str], lo: int = 1, hi: int | None = None) -> None:
    if v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        problems.append(f"{what} must be null or an integer {rng}, got {v!r}")


def _check_str(v, what: str, problems: list[str], nullable: bool = True) -> None:
    if v is None and nullable:
        return
    if not isinstance(v, str) or not v.strip():
        problems.append(f"{what} must be {'null or ' if nullable else ''}a non-empty string, got {v!r}")


def _check_repo(v, what: str, problems: list[str]) -> None:
    if not isinstance(v, str) or v.count("/") != 1 or not all(v.split("/")) or " " in v:
        problems.append(f"{what} must be a Hub id 'owner/name', got {v!r}")


def _side(d, where: str, allowed: set[str], problems: list[str]) -> Side:
    if not isinstance(d, dict):
        problems.append(f"{where} must be an object, got {type(d).__name__}")
        return Side(repo="?/?", revision=None, architecture=None, num_hidden_layers=None, license=None)
    extra = sorted(set(d) - allowed)
    if extra:
        problems.append(f"{where} has unknown field(s) {', '.join(extra)} (known: {', '.join(sorted(allowed))})")
    if "repo" not in d:
        problems.append(f"{where} has no repo")
    _check_repo(d.get("repo"), f"{where}.repo", problems)
    for k in ("revision", "architecture", "license", "filename"):
        _check_str(d.get(k), f"{where}.{k}", problems)
    for k in ("num_hidden_layers", "hidden_size", "vocab_size", "sliding_window"):
        _check_int(d.get(k), f"{where}.{k}", problems)
    fmt = d.get("format", "hf")
    if fmt not in FORMATS:
        problems.append(f"{where}.format {fmt!r} is not one of {FORMATS}")
    gguf = None
    if d.get("gguf") is not None:
        g = d["gguf"]
        if not isinstance(g, dict) or set(g) - {"repo", "filename"}:
            problems.append(f"{where}.gguf must be an object with repo and filename, got {g!r}")
        else:
            _check_repo(g.get("repo"), f"{where}.gguf.repo", problems)
            _check_str(g.get("filename"), f"{where}.gguf.filename", problems)
            gguf = GgufFile(repo=str(g.get("repo")), filename=g.get("filename"))
    return Side(repo=str(d.get("repo")), revision=d.get("revision"), architecture=d.get("architecture"),
                num_hidden_layers=d.get("num_hidden_layers"), license=d.get("license"),
                hidden_size=d.get("hidden_size"), vocab_size=d.get("vocab_size"), format=fmt,
                filename=d.get("filename"), sliding_window=d.get("sliding_window"), gguf=gguf)


def load(path: str | Path) -> Recipe:
    """Read and validate one catalogue file; ``ValueError`` lists every problem found in it."""
    p = Path(path)
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise ValueError(f"{p}: a recipe is a JSON object, got {type(d).__name__}")
    problems: list[str] = []
    extra = sorted(set(d) - _TOP)
    if extra:
        problems.append(f"unknown field(s) {', '.join(extra)} (known: {', '.join(sorted(_TOP))})")
    for k in ("name", "kind", "target", "drafter", "sources"):
        if k not in d:
            problems.append(f"no {k!r}")
    target = _side(d.get("target"), "target", _TARGET, problems)
    drafter = _side(d.get("drafter"), "drafter", _DRAFTER, problems)
    r = Recipe(name=d.get("name"), description=d.get("description", ""), kind=d.get("kind"),
               schema=d.get("schema"), target=target, drafter=drafter, block_size=d.get("block_size"),
               target_layer_ids=d.get("target_layer_ids"), mask_token_id=d.get("mask_token_id"),
               recommended_quantization=d.get("recommended_quantization"),
               reported_acceptance=d.get("reported_acceptance"), chat=d.get("chat") or {},
               notes=d.get("notes") or [], sources=d.get("sources") or [], path=p)
    if r.name != p.stem:
        problems.append(f"name {r.name!r} differs from the file name")
    if not isinstance(r.description, str):
        problems.append(f"description must be a string, got {r.description!r}")
    if r.kind not in KINDS:
        problems.append(f"kind {r.kind!r} is not one of {KINDS}")
    if r.schema is not None and r.schema not in SCHEMAS:
        problems.append(f"schema {r.schema!r} is not null or one of {SCHEMAS}")
    if (r.schema == "dflash2") != (r.kind == "dflash2") and r.schema is not None:
        problems.append(f"schema {r.schema!r} does not fit kind {r.kind!r} (dflash2 drafters use the dflash2 schema)")
    if r.schema in DSPARK_SCHEMAS and r.kind == "dflash2":
        problems.append(f"schema {r.schema!r} is a DSpark form, kind {r.kind!r} is not")
    if r.kind == "dspark" and r.schema is not None and r.schema not in DSPARK_SCHEMAS:
        problems.append(f"schema {r.schema!r} does not fit kind 'dspark' (one of {DSPARK_SCHEMAS})")
    want_arch = DRAFTER_ARCHS.get(r.kind)
    if r.schema in DSPARK_SCHEMAS:      # a DSpark checkpoint without a Markov head is a dflash drafter
        want_arch = DRAFTER_ARCHS["dspark"]
    if drafter.architecture is not None and want_arch and drafter.architecture not in want_arch:
        problems.append(f"drafter.architecture {drafter.architecture!r} does not fit kind {r.kind!r} "
                        f"({' or '.join(want_arch)})")
    _check_int(r.block_size, "block_size", problems, BLOCK_MIN, BLOCK_MAX)
    _check_int(r.mask_token_id, "mask_token_id", problems, lo=0)
    ids = r.target_layer_ids
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in ids):
            problems.append(f"target_layer_ids must be null or a non-empty list of integers >= 0, got {ids!r}")
        elif target.num_hidden_layers is not None and max(ids) > target.num_hidden_layers - 2:
            problems.append(f"target_layer_ids {ids} reach past layer {target.num_hidden_layers - 2} of a "
                            f"{target.num_hidden_layers}-layer target (HF id t is the output of layer t)")
    if (r.mask_token_id is not None and target.vocab_size is not None and isinstance(r.mask_token_id, int)
            and r.mask_token_id >= target.vocab_size):
        problems.append(f"mask_token_id {r.mask_token_id} is outside the target vocabulary ({target.vocab_size})")
    if r.recommended_quantization is not None and r.recommended_quantization not in QTYPES:
        problems.append(f"recommended_quantization {r.recommended_quantization!r} is not one of {sorted(QTYPES)}")
    if r.reported_acceptance is not None and (isinstance(r.reported_acceptance, bool)
                                              or not isinstance(r.reported_acceptance, (int, float, str))):
        problems.append(f"reported_acceptance must be null, a number or a string, got {r.reported_acceptance!r}")
    if not isinstance(r.chat, dict):
        problems.append(f"chat must be an object, got {r.chat!r}")
    for k in ("notes", "sources"):
        v = getattr(r, k)
        if not isinstance(v, list) or not all(isinstance(s, str) and s.strip() for s in v):
            problems.append(f"{k} must be a list of non-empty strings")
    if not r.sources:
        problems.append("no sources")
    if r.download_only:
        if not drafter.filename:
            problems.append("drafter.format 'gguf' needs drafter.filename (the GGUF's name or a glob)")
        if target.gguf is None:
            problems.append("drafter.format 'gguf' needs target.gguf {repo, filename}: the target GGUF to pair")
        if r.recommended_quantization is not None:
            problems.append("a ready GGUF drafter is not converted: recommended_quantization must be null")
    else:
        if drafter.filename is not None:
            problems.append("drafter.filename is only for drafter.format 'gguf'")
        if target.gguf is not None:
            problems.append("target.gguf is only for a ready GGUF drafter (drafter.format 'gguf')")
    if problems:
        raise ValueError(f"{p}: " + "; ".join(problems))
    r.target_layer_ids = list(ids) if ids is not None else None
    return r


def catalogue(root: str | Path | None = None) -> dict[str, Recipe]:
    root = Path(root) if root is not None else catalogue_dir()
    return {r.name: r for r in (load(p) for p in sorted(root.glob("*.json")))}


def get(name: str, root: str | Path | None = None) -> Recipe:
    cat = catalogue(root)
    if name not in cat:
        raise KeyError(f"no recipe {name!r}; known: {', '.join(sorted(cat)) or 'none'} (`--list` shows them)")
    return cat[name]


def _config_window(drafter) -> int | None:
    """The window a drafter config declares, where either schema puts it (as attention.py reads it)."""
    dcfg = drafter.get("dflash_config") or {}
    return dcfg.get("swa_window_size") or drafter.get("sliding_window")


def check_against(recipe: Recipe, spec) -> None:
    """Raise :class:`PairError` when a validated pair (:class:`PairSpec`) contradicts a known field."""
    if recipe.download_only:
        raise PairError(f"recipe {recipe.name} is a ready GGUF drafter: there is nothing to convert or check "
                        f"against (`--recipe {recipe.name}` says how to load it)")
    want = {"kind": recipe.kind, "block_size": recipe.block_size, "target_layer_ids": recipe.target_layer_ids,
            "mask_token_id": recipe.mask_token_id, "n_layer": recipe.target.num_hidden_layers,
            "hidden_size": recipe.target.hidden_size, "vocab_size": recipe.target.vocab_size,
            "drafter sliding_window": recipe.drafter.sliding_window}
    got = {"kind": spec.kind, "block_size": spec.block_size, "target_layer_ids": spec.target_layer_ids,
           "mask_token_id": spec.mask_token_id, "n_layer": spec.n_layer, "hidden_size": spec.hidden_size,
           "vocab_size": spec.vocab_size, "drafter sliding_window": _config_window(spec.drafter)}
    diff = [f"{k}: recipe {want[k]}, checkpoint {got[k]}" for k in want if want[k] is not None and want[k] != got[k]]
    if recipe.target.architecture is not None and spec.target.architecture != recipe.target.architecture:
        diff.append(f"target architecture: recipe {recipe.target.architecture}, checkpoint {spec.target.architecture}")
    if recipe.drafter.architecture is not None and spec.drafter.architecture != recipe.drafter.architecture:
        diff.append(f"drafter architecture: recipe {recipe.drafter.architecture}, checkpoint "
                    f"{spec.drafter.architecture}")
    n_draft = recipe.drafter.num_hidden_layers
    if n_draft is not None and spec.drafter.get("num_hidden_layers") != n_draft:
        diff.append(f"drafter layers: recipe {n_draft}, checkpoint {spec.drafter.get('num_hidden_layers')}")
    if diff:
        raise PairError(f"the checkpoints do not match recipe {recipe.name} ({'; '.join(diff)}): they are "
                        f"another pair or another revision of {recipe.target.repo} / {recipe.drafter.repo}")
