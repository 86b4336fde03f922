"""A target and its drafter as one thing: the ``pair.json`` manifest, :func:`open_pair` and
:func:`compare_with_plain`.

The converter writes ``pair.json`` (see :mod:`dflash_gguf.convert.manifest`); everything that opens a
pair - the Llama API, the CLI, the server, the demo, bench and ``convert --check`` - reads it here.
Importing this module loads no native library; :func:`open_pair` does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from dflash_gguf.errors import ManifestError
from dflash_gguf.native.gguf_check import check_manifest
from dflash_gguf.paths import sha256_file

if TYPE_CHECKING:
    from dflash_gguf.native.engine import ContextOptions, Model
    from dflash_gguf.decoding.decoder import DFlashDecoder, SpecOptions
    from dflash_gguf.decoding.proposer import Proposer
    from dflash_gguf.decoding.stats import GenerationStats

MANIFEST = "pair.json"
FORMAT = "dflash-gguf-pair"
FORMAT_VERSION = 1


# --------------------------------------------------------------------------- manifest
@dataclass
class PairFile:
    path: Path
    size: int
    sha256: str
    type: str


@dataclass
class PairManifest:
    """A loaded ``pair.json``; ``data`` holds the whole document."""
    dir: Path
    target: PairFile
    drafter: PairFile
    kind: str                   # "dflash" | "dflash2"
    block_size: int
    target_layers: list[int]    # GGUF convention: input of layer i (= HF target_layer_ids + 1)
    mask_token_id: int
    data: dict


def load_manifest(pair_dir: str | os.PathLike, *, verify: bool = False) -> PairManifest:
    """Open a pair directory: read ``pair.json``, check both files (sizes; sha256 if ``verify``)."""
    d = Path(pair_dir).expanduser()
    path = d / MANIFEST
    if not path.is_file():
        raise ManifestError(f"{d} is not a converted pair ({MANIFEST} missing): make one with "
                            "`python -m dflash_gguf.convert TARGET_DIR DRAFTER_DIR -o OUT_DIR`")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, not {FORMAT!r}")
        if doc.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(f"format_version {doc['format_version']} is newer than this dflash-gguf "
                             f"({FORMAT_VERSION}); upgrade dflash-gguf")
        files = {role: _pair_file(d, doc[role], role, verify) for role in ("target", "drafter")}
        return PairManifest(dir=d.resolve(), target=files["target"], drafter=files["drafter"], kind=doc["kind"],
                            block_size=int(doc["block_size"]), target_layers=[int(x) for x in doc["target_layers"]],
                            mask_token_id=int(doc["mask_token_id"]), data=doc)
    except ManifestError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(f"{path} is damaged ({e}): convert the pair again") from e


def _pair_file(d: Path, entry: dict, role: str, verify: bool) -> PairFile:
    f = PairFile(path=(d / entry["file"]).resolve(), size=int(entry["size"]), sha256=str(entry["sha256"]),
                 type=str(entry["type"]))
    if Path(entry["file"]).name != entry["file"]:
        raise ManifestError(f"{role} file name {entry['file']!r} in {d / MANIFEST} must be a plain file name")
    if not f.path.is_file():
        raise ManifestError(f"the {role} GGUF {f.path} listed in {MANIFEST} is missing: copy the whole pair "
                            "directory, or convert the pair again")
    size = f.path.stat().st_size
    if size != f.size:
        raise ManifestError(f"the {role} GGUF {f.path} has {size} bytes, {MANIFEST} records {f.size}: the file is "
                            "truncated or was replaced; copy it again or convert the pair again")
    if verify and sha256_file(f.path) != f.sha256:
        raise ManifestError(f"the {role} GGUF {f.path} does not match the sha256 in {MANIFEST}: the file is "
                            "corrupted or was replaced; copy it again or convert the pair again")
    return f


def pair_files(path: str | os.PathLike, *, verify: bool = False) -> tuple[Path, Path]:
    """(target.gguf, drafter.gguf) of a converted pair directory (or its ``pair.json``).

    With ``pair.json`` the files are checked (:func:`load_manifest`; ``verify``: their sha256 too) and
    the manifest must describe the drafter it names; a directory without one may hold exactly one
    ``target*.gguf`` and one ``drafter*.gguf``.
    """
    p = Path(path).expanduser()
    root = p.parent if p.is_file() else p
    if not root.is_dir():
        raise FileNotFoundError(f"pair directory not found: {root}")
    if (root / MANIFEST).is_file():
        m = load_manifest(root, verify=verify)
        check_manifest(m.data, m.drafter.path)
        return m.target.path, m.drafter.path
    targets, drafters = sorted(root.glob("target*.gguf")), sorted(root.glob("drafter*.gguf"))
    if len(targets) == 1 and len(drafters) == 1:
        return targets[0], drafters[0]
    raise FileNotFoundError(f"{root} has no {MANIFEST} and not exactly one target*.gguf and drafter*.gguf "
                            "(make a pair with `python -m dflash_gguf convert`)")


# --------------------------------------------------------------------------- open pair
class OpenPair:
    """Both models and both contexts of a pair (the drafter's borrowing the target's: a
    :class:`dflash_gguf.runtime.Runtime` with the contexts as ``opts`` says); ``close()`` (or leaving the
    ``with`` block) frees them, drafter first. ``n_gpu_layers`` / ``draft_n_gpu_layers``: layers offloaded
    to a GPU (the drafter's default: as the target's)."""

    def __init__(self, target: str | os.PathLike, drafter: str | os.PathLike | None,
                 opts: "ContextOptions | None" = None, *, n_gpu_layers: int = 0,
                 draft_n_gpu_layers: int | None = None):
        from dflash_gguf.native.engine import ContextOptions, Model
        from dflash_gguf.runtime import Runtime

        self.opts = opts or ContextOptions()
        self._owned: list = []
        try:
            ngld = n_gpu_layers if draft_n_gpu_layers is None else draft_n_gpu_layers
            self.target: Model = self._own(Model(target, n_gpu_layers=n_gpu_layers))
            self.drafter: Model | None = (self._own(Model(drafter, n_gpu_layers=ngld))
                                          if drafter is not None else None)
            # the contexts as opts says (the caller's tests and tools choose the rollback), no gate yet
            self.runtime = self._own(Runtime.open(self.target, self.drafter, self.opts, choose_rollback=False,
                                                  make_decoder=False))
        except BaseException:
            self.close()
            raise
        self.tctx = self.runtime.target
        self.dctx = self.runtime.drafter

    def _own(self, handle):
        self._owned.append(handle)
        return handle

    def decoder(self, spec: "SpecOptions | None" = None, proposer: "Proposer | None" = None) -> "DFlashDecoder":
        """A DFlash decoder on the pair (it clears both caches)."""
        return self.runtime.decoder_with(spec, proposer)

    def plain(self) -> "DFlashDecoder":
        """The one-token-per-step reference decoder on the same target context."""
        return self.runtime.plain()

    def close(self) -> None:
        while self._owned:
            self._owned.pop().close()   # contexts before models, drafter before target

    def __enter__(self) -> "OpenPair":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_pair(target: str | os.PathLike, drafter: str | os.PathLike | None = None,
              opts: "ContextOptions | None" = None, **gpu) -> OpenPair:
    """Open a pair: ``open_pair(DIR)`` for a converted pair directory, or ``open_pair(TARGET, DRAFTER)``;
    ``gpu``: OpenPair's ``n_gpu_layers`` / ``draft_n_gpu_layers``."""
    if drafter is None and Path(target).is_dir():
        target, drafter = pair_files(target)
    return OpenPair(target, drafter, opts, **gpu)


# --------------------------------------------------------------------------- lossless check
@dataclass
class Comparison:
    """DFlash vs plain decoding of the same target on one prompt."""
    plain: list[int]
    spec: list[int]
    stats: "GenerationStats"
    plain_stats: "GenerationStats"
    first_mismatch: int | None = field(init=False)

    def __post_init__(self) -> None:
        from dflash_gguf.decoding.decoder import common_prefix_len

        n = common_prefix_len(self.plain, self.spec)
        self.first_mismatch = None if (n == len(self.plain) == len(self.spec)) else n

    @property
    def equal(self) -> bool:
        return self.first_mismatch is None


def compare_with_plain(pair: OpenPair, prompt: Sequence[int], n_tokens: int, *, spec: "SpecOptions | None" = None,
                       decoder: "DFlashDecoder | None" = None, stop_tokens: Sequence[int] | None = None) -> Comparison:
    """Decode ``prompt`` plainly, then with DFlash (``decoder`` or a new one from ``spec``), from cold caches."""
    from dflash_gguf.decoding.stats import GenerationStats

    plain_stats, stats = GenerationStats(), GenerationStats()
    plain = list(pair.plain().generate(prompt, n_tokens, stats=plain_stats, stop_tokens=stop_tokens))
    dec = decoder if decoder is not None else pair.decoder(spec)
    dec.reset()
    got = list(dec.generate(prompt, n_tokens, stats=stats, stop_tokens=stop_tokens))
    return Comparison(plain=plain, spec=got, stats=stats, plain_stats=plain_stats)
