"""The catalogue of known public target/drafter pairs (``convert/*.json`` at the top of the project).

One small JSON file per pair: target and drafter repos (and revisions), kind, block size, taps,
mask token, recommended quantization, licences, the acceptance the model card reports. A field that
could not be confirmed from public sources is ``null`` (unknown): the converter then takes the value
from the checkpoint's own config and validates it as for any pair, and :func:`check_against` only
compares the fields the recipe knows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dflash_gguf.convert.errors import PairError
from dflash_gguf.convert.quantize import QTYPES

KINDS = ("dflash", "dflash2")


def catalogue_dir() -> Path:
    """``convert/`` of a source checkout, else the copy shipped in the wheel."""
    here = Path(__file__).resolve()
    checkout = here.parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / "convert" / "README.md").is_file():
        return checkout / "convert"
    return here.parents[1] / "data" / "recipes"


@dataclass
class Side:
    repo: str
    revision: str | None
    architecture: str
    num_hidden_layers: int | None
    license: str | None
    hidden_size: int | None = None
    vocab_size: int | None = None


@dataclass
class Recipe:
    name: str
    description: str
    kind: str
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

    def unknown(self) -> list[str]:
        """The fields this recipe could not confirm."""
        out = [k for k in ("block_size", "target_layer_ids", "mask_token_id", "reported_acceptance")
               if getattr(self, k) is None]
        out += [f"drafter.{k}" for k in ("num_hidden_layers", "license") if getattr(self.drafter, k) is None]
        return out

    def line(self) -> str:
        q = self.recommended_quantization or "-"
        block = self.block_size if self.block_size is not None else "?"
        return f"{self.name:40s} {self.kind:7s} block {block!s:3s} {q:5s} {self.target.repo} + {self.drafter.repo}"


def _side(d: dict, where: str) -> Side:
    try:
        return Side(repo=str(d["repo"]), revision=d.get("revision"), architecture=str(d["architecture"]),
                    num_hidden_layers=d.get("num_hidden_layers"), license=d.get("license"),
                    hidden_size=d.get("hidden_size"), vocab_size=d.get("vocab_size"))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{where}: missing {e}") from e


def load(path: str | Path) -> Recipe:
    p = Path(path)
    d = json.loads(p.read_text(encoding="utf-8"))
    r = Recipe(name=d["name"], description=d.get("description", ""), kind=d["kind"],
               target=_side(d["target"], f"{p}: target"), drafter=_side(d["drafter"], f"{p}: drafter"),
               block_size=d.get("block_size"), target_layer_ids=d.get("target_layer_ids"),
               mask_token_id=d.get("mask_token_id"), recommended_quantization=d.get("recommended_quantization"),
               reported_acceptance=d.get("reported_acceptance"), chat=d.get("chat") or {},
               notes=list(d.get("notes") or []), sources=list(d.get("sources") or []), path=p)
    problems = []
    if r.name != p.stem:
        problems.append(f"name {r.name!r} differs from the file name")
    if r.kind not in KINDS:
        problems.append(f"kind {r.kind!r} is not one of {KINDS}")
    if r.recommended_quantization is not None and r.recommended_quantization not in QTYPES:
        problems.append(f"recommended_quantization {r.recommended_quantization!r} is not one of {sorted(QTYPES)}")
    if not r.sources:
        problems.append("no sources")
    if problems:
        raise ValueError(f"{p}: " + "; ".join(problems))
    return r


def catalogue(root: str | Path | None = None) -> dict[str, Recipe]:
    root = Path(root) if root is not None else catalogue_dir()
    return {r.name: r for r in (load(p) for p in sorted(root.glob("*.json")))}


def get(name: str, root: str | Path | None = None) -> Recipe:
    cat = catalogue(root)
    if name not in cat:
        raise KeyError(f"no recipe {name!r}; known: {', '.join(sorted(cat)) or 'none'} (`--list` shows them)")
    return cat[name]


def check_against(recipe: Recipe, spec) -> None:
    """Raise :class:`PairError` when a validated pair (:class:`PairSpec`) contradicts a known field."""
    want = {"kind": recipe.kind, "block_size": recipe.block_size, "target_layer_ids": recipe.target_layer_ids,
            "mask_token_id": recipe.mask_token_id, "n_layer": recipe.target.num_hidden_layers,
            "hidden_size": recipe.target.hidden_size, "vocab_size": recipe.target.vocab_size}
    got = {"kind": spec.kind, "block_size": spec.block_size, "target_layer_ids": spec.target_layer_ids,
           "mask_token_id": spec.mask_token_id, "n_layer": spec.n_layer, "hidden_size": spec.hidden_size,
           "vocab_size": spec.vocab_size}
    diff = [f"{k}: recipe {want[k]}, checkpoint {got[k]}" for k in want if want[k] is not None and want[k] != got[k]]
    if spec.target.architecture != recipe.target.architecture:
        diff.append(f"target architecture: recipe {recipe.target.architecture}, checkpoint {spec.target.architecture}")
    if spec.drafter.architecture != recipe.drafter.architecture:
        diff.append(f"drafter architecture: recipe {recipe.drafter.architecture}, checkpoint "
                    f"{spec.drafter.architecture}")
    n_draft = recipe.drafter.num_hidden_layers
    if n_draft is not None and spec.drafter.get("num_hidden_layers") != n_draft:
        diff.append(f"drafter layers: recipe {n_draft}, checkpoint {spec.drafter.get('num_hidden_layers')}")
    if diff:
        raise PairError(f"the checkpoints do not match recipe {recipe.name} ({'; '.join(diff)}): they are "
                        f"another pair or another revision of {recipe.target.repo} / {recipe.drafter.repo}")
