"""Files from the Hugging Face Hub, the way llama_cpp users fetch models (optional: ``huggingface_hub``).

Everything goes through ``huggingface_hub.snapshot_download`` with ``allow_patterns``, so downloads
land in the usual Hub cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``), are shared with
every other Hub user on the machine, resume after an interruption, and work offline from the cache
(``HF_HUB_OFFLINE=1``, or ``local_files_only=True``). A file missing offline is a
:class:`HubFileNotFound` that says where it looked and how to get it.

    from dflash_gguf import Llama
    llm = Llama.from_pretrained("ggml-org/Qwen3-8B-GGUF", "*Q8_0.gguf")   # + the dspark-/dflash- GGUF beside it
    llm = Llama.from_pretrained("org/Qwen3-8B-GGUF", "*q8_0.gguf",
                                draft_repo_id="org/Qwen3-8B-DFlash-GGUF", draft_filename="*.gguf")
    llm = Llama.from_pair_pretrained("org/qwen3-8b-dflash-pair")      # a pair with its pair.json
"""
from __future__ import annotations

import fnmatch
import glob
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("dflash_gguf.hub")

INSTALL = "pip install 'dflash-gguf[hub]' (or: pip install huggingface_hub)"
# what the converter reads from a Hugging Face checkpoint (weights, config, tokenizer, template)
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class HubFileNotFound(FileNotFoundError, ValueError):
    """A file that is neither in the local Hub cache nor downloadable (offline, or not in the repo).
    Also a ValueError: what ``llama_cpp.Llama.from_pretrained`` raises when no file matches."""


def _hub():
    try:
        import huggingface_hub
    except ImportError as e:
        raise ImportError(f"Hugging Face Hub downloads need huggingface_hub: {INSTALL}") from e
    return huggingface_hub


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def looks_like_repo_id(value: str | os.PathLike) -> bool:
    """``org/name`` that is not an existing local path."""
    s = str(value)
    return bool(_REPO_ID.match(s)) and not Path(s).expanduser().exists()


def snapshot(repo_id: str, patterns: list[str], *, revision: str | None = None, cache_dir=None,
             local_files_only: bool = False, local_dir=None, local_dir_use_symlinks="auto") -> Path:
    """The local snapshot folder of ``repo_id`` holding (at least) the files matching ``patterns``
    (``local_dir``: that folder instead of the cache, as huggingface_hub lays it out)."""
    hub = _hub()
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    where = local_dir or cache_dir or os.environ.get("HF_HUB_CACHE") or "the Hugging Face cache"
    extra = {"local_dir": local_dir} if local_dir is not None else {}
    if local_dir is not None and local_dir_use_symlinks != "auto":   # deprecated by huggingface_hub: only if asked
        extra["local_dir_use_symlinks"] = local_dir_use_symlinks
    try:
        path = hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache_dir,
                                     local_files_only=local_files_only, **extra)
    except Exception as e:   # LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, HTTP errors
        if offline() or local_files_only or type(e).__name__ == "LocalEntryNotFoundError":
            raise HubFileNotFound(
                f"{repo_id}{'@' + revision if revision else ''} ({', '.join(patterns)}) is not in {where} and "
                f"downloading is off ({'HF_HUB_OFFLINE=1' if offline() else 'local_files_only'}): run once with "
                f"network access, or `huggingface-cli download {repo_id}` ({type(e).__name__})") from e
        raise
    return Path(path)


def _files(root: Path) -> list[str]:
    """The repository's files under a snapshot folder (a local_dir's own ``.cache`` left out)."""
    return sorted(rel for rel in (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
                  if not rel.startswith(".cache/"))


def _match(repo_id: str, root: Path | None, filename: str, offline_mode: bool, model: bool = False,
           files: list[str] | None = None) -> str:
    """The one file of ``files`` (default: those under ``root``) that ``filename`` matches."""
    files = _files(root) if files is None else files
    found = [rel for rel in files if fnmatch.fnmatch(rel, filename)]
    if model and len(found) > 1:
        # a glob such as "*Q8_0.gguf" also matches the sidecars published beside the target
        # (dflash-NAME-Q8_0.gguf): as upstream's rule does, those are not candidates for the model itself
        found = [rel for rel in found if not is_sidecar_name(rel)] or found
    if not found:
        mode = " (offline: only the cache was searched)" if offline_mode else ""
        raise HubFileNotFound(f"no file matching {filename!r} in {repo_id}{mode}; "
                              f"have: {', '.join(files) or 'nothing'}{f' (in {root})' if root else ''}")
    if len(found) > 1:
        raise ValueError(f"{len(found)} files of {repo_id} match {filename!r}: {', '.join(found)}; name one")
    return found[0]


def hub_file(repo_id: str, filename: str, *, revision: str | None = None, cache_dir=None,
             local_files_only: bool = False, local_dir=None, local_dir_use_symlinks="auto") -> Path:
    """The one file of ``repo_id`` that ``filename`` (a name or a glob, e.g. ``*q8_0.gguf``) matches."""
    kw = dict(revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, local_dir=local_dir,
              local_dir_use_symlinks=local_dir_use_symlinks)
    root = snapshot(repo_id, [filename], **kw)
    rel = _match(repo_id, root, filename, offline() or local_files_only)
    log.info("%s: %s", repo_id, root / rel)
    return root / rel


# llama.cpp's split GGUF names (gguf-split, llama_split_path): PREFIX-00001-of-00003.gguf
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_shards(path: str) -> list[str]:
    """For the first shard of a split GGUF, the names of all its shards in order (llama.cpp opens the
    others beside the first); [] for any other name."""
    m = _SHARD.match(path)
    if m is None or int(m["no"]) != 1:
        return []
    n = int(m["n"])
    return [f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def hub_model(repo_id: str, filename: str, additional_files: list[str] | None = None, **kw) -> Path:
    """A GGUF of ``repo_id`` as ``llama_cpp.Llama.from_pretrained`` fetches it: the file ``filename``
    matches, then each of ``additional_files`` (a name or a glob matching one file each: the other
    shards of a split GGUF, say) into the same folder. For the first shard of a split GGUF the shards
    not named are fetched too. Returns the path of the file to open (the first shard)."""
    root, rel = fetch_model(repo_id, filename, additional_files, **kw)
    return root / rel


def fetch_model(repo_id: str, filename: str, additional_files: list[str] | None = None, **kw) -> tuple[Path, str]:
    """:func:`hub_model`, as the snapshot folder and the file's path in the repository."""
    quiet = offline() or bool(kw.get("local_files_only"))
    listed = None if quiet else _listing(repo_id, kw.get("revision"))
    if listed is not None:
        # the name first, from the repository's list, so that a glob that also matches the sidecars
        # beside the target downloads the target alone
        filename = glob.escape(_match(repo_id, None, filename, quiet, model=True, files=listed))
    root = snapshot(repo_id, [filename], **kw)
    rel = _match(repo_id, root, filename, quiet, model=True)
    for extra in additional_files or []:
        root = snapshot(repo_id, [extra], **kw)   # the same snapshot folder: one revision
        _match(repo_id, root, extra, quiet)
    shards = split_shards(rel)
    if shards:
        root = snapshot(repo_id, shards, **kw)
        missing = [s for s in shards if not (root / s).is_file()]
        if missing:
            where = "the cache (offline)" if quiet else repo_id
            raise HubFileNotFound(f"{repo_id}: shard {', '.join(missing)} of the split GGUF {rel} is not in {where}")
    log.info("%s: %s%s", repo_id, root / rel, f" ({len(shards)} shards)" if shards else "")
    return root, rel


# --------------------------------------------------------------------------- drafters published beside the target
# ggml-org publishes drafters inside the target's own GGUF repository (Qwen3-8B-Q8_0.gguf beside
# dflash-Qwen3-8B-Q8_0.gguf and dspark-Qwen3-8B-BF16.gguf). Which files count is upstream's rule, as
# its `-hf` finds them (common/download.cpp: find_best_sibling, gguf_filename_is_model): a `.gguf`
# whose file name holds the kind's prefix, in the target's folder or a folder above it, the nearest
# folder first. Which one to use when several are there is these two tables, in order.
SIDECAR_KINDS: tuple[tuple[str, str], ...] = (
    # DSpark first (upstream ranks it above DFlash too): the same backbone plus a Markov head that drafts
    # better at the same cost, and a confidence head that lets the engine verify fewer rows
    ("dspark", "dspark-"),
    ("dflash", "dflash-"),
)
# then the quantization: Q8_0 first, half the memory of the 16-bit files and faster on CPUs, where
# a drafter's weights are read once per drafted block; then the 16-bit ones; any other after these.
# Upstream instead takes the quantization nearest the target's; for a drafter the smaller file pays.
SIDECAR_QUANTS: tuple[str, ...] = ("Q8_0", "BF16", "F16")
# every name upstream keeps out of the model choice (projectors, imatrices and every drafter kind)
_NOT_A_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")
# upstream's quantization tag: the name's last [-.]-separated word, the shard suffix left out
_QUANT_TAG = re.compile(r"[-.]([A-Za-z0-9_]+)$")


@dataclass(frozen=True)
class Sidecar:
    """The drafter :func:`choose_drafter` picked: its path in the repository, and why."""
    file: str
    kind: str          # a SIDECAR_KINDS name, or "" for a GGUF named otherwise (a drafter-only repository)
    quant: str         # "Q8_0", "BF16", ... ("" when the name has no tag)
    reason: str


def is_sidecar_name(path: str) -> bool:
    """A GGUF name upstream never takes for the model itself (a drafter, projector or imatrix)."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and any(word in name for word in _NOT_A_MODEL)


def quant_tag(path: str) -> str:
    """``Q8_0`` for ``dflash-Qwen3-8B-Q8_0.gguf`` (and its shards), ``""`` for a name without one."""
    stem = path.rsplit("/", 1)[-1].removesuffix(".gguf")
    m = _SHARD.match(stem + ".gguf")
    stem = m["prefix"] if m else stem
    m = _QUANT_TAG.search(stem)
    return m[1].upper() if m else ""


def _kind(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    return next((kind for kind, prefix in SIDECAR_KINDS if prefix in name), "")


def _rank(table: tuple[str, ...], value: str) -> int:
    return table.index(value) if value in table else len(table)


def choose_drafter(files: list[str], target: str | None = None) -> Sidecar | None:
    """The drafter to use among a repository's ``files``, or None.

    ``target``: the target's path in the same repository; then only sidecars count (upstream's rule
    above), the nearest folder first. Without it the repository is the drafter's own: sidecar names
    still come first, then any other GGUF (a DSpark or DFlash GGUF published alone). Among the rest
    the kind, then the quantization, go by :data:`SIDECAR_KINDS` and :data:`SIDECAR_QUANTS`.
    """
    kinds = tuple(kind for kind, _ in SIDECAR_KINDS)
    ggufs = [f for f in files if f.endswith(".gguf") and (_SHARD.match(f.rsplit("/", 1)[-1]) is None or split_shards(f))]
    if target is not None:
        folder = target.split("/")[:-1]
        candidates = [(len(f.split("/")) - 1, f) for f in ggufs if _kind(f) and f != target
                      and f.split("/")[:-1] == folder[: len(f.split("/")) - 1]]
    else:
        candidates = [(0, f) for f in ggufs]
    if not candidates:
        return None
    _, best = min(candidates, key=lambda c: (_rank(kinds, _kind(c[1])), -c[0], _rank(SIDECAR_QUANTS, quant_tag(c[1])), c[1]))
    kind, quant = _kind(best), quant_tag(best)
    others = sorted(f for _, f in candidates if f != best)
    why = [f"the {kind} sidecar{' beside the target' if target is not None else ''}" if kind else
           "a GGUF of the drafter's repository"]
    if others:
        why.append(f"preferred to {', '.join(others)} (kinds: {' > '.join(kinds)}; quantizations: "
                   f"{' > '.join(SIDECAR_QUANTS)} > others{'; the nearest folder first' if target is not None else ''})")
    return Sidecar(best, kind, quant, "; ".join(why))


# upstream's `-hf USER/MODEL[:QUANT]` (common/arg.cpp, common/download.cpp): the quantization tag is
# case-insensitive and defaults to Q4_K_M; with no tag given and no Q4_K_M file, the first model GGUF
DEFAULT_QUANT = "Q4_K_M"


def split_hf_spec(spec: str) -> tuple[str, str | None]:
    """``("org/Model-GGUF", "Q8_0")`` for ``org/Model-GGUF:Q8_0`` (no tag: None)."""
    repo, _, quant = spec.partition(":")
    if not looks_like_repo_id(repo):
        raise ValueError(f"{spec!r} is not USER/MODEL[:QUANT] (a Hugging Face repository, e.g. ggml-org/Qwen3-8B-GGUF:Q8_0)")
    return repo, quant or None


def choose_model(files: list[str], quant: str | None) -> str:
    """The model GGUF of a repository's ``files`` for a ``-hf`` tag (sidecars, projectors and the later
    shards of a split GGUF are never taken). Raises :class:`HubFileNotFound` naming the tags there are."""
    models = sorted(f for f in files if f.endswith(".gguf") and not is_sidecar_name(f)
                    and (_SHARD.match(f.rsplit("/", 1)[-1]) is None or split_shards(f)))
    want = (quant or DEFAULT_QUANT).upper()
    hits = [f for f in models if quant_tag(f) == want]
    if hits:
        return hits[0]
    if quant is None and models:
        return models[0]
    tags = sorted({quant_tag(f) or f for f in models})
    raise HubFileNotFound(f"no {want} model GGUF" + (f"; there are: {', '.join(tags)}" if tags else " (no model GGUF at all)"))


def model_for_tag(repo_id: str, quant: str | None, *, revision: str | None = None, **kw) -> str:
    """:func:`choose_model` over ``repo_id``'s files (the Hub's list online, the cache offline), as a
    file name to fetch."""
    try:
        return glob.escape(choose_model(repo_files(repo_id, revision=revision, **kw), quant))
    except HubFileNotFound as e:
        raise HubFileNotFound(f"{repo_id}: {e}") from None


def _listing(repo_id: str, revision: str | None) -> list[str] | None:
    """The Hub's list of ``repo_id``'s files, or None where it cannot be had (the cache answers then)."""
    try:
        return sorted(_hub().HfApi().list_repo_files(repo_id, revision=revision))
    except ImportError:
        raise
    except Exception as e:   # network errors, a gated or private repository: as snapshot_download, fall back to the cache
        log.info("%s: listing the repository failed (%s: %s); using the files already here", repo_id, type(e).__name__, e)
        return None


def repo_files(repo_id: str, root: Path | None = None, *, revision: str | None = None,
               local_files_only: bool = False, **kw) -> list[str]:
    """``repo_id``'s files at ``revision``: the Hub's list online, else what its snapshot folder
    (``root``, or the cache's, or ``local_dir``) holds. A listing that fails online falls back to that
    folder too, as the files themselves do when the Hub cannot be reached."""
    listed = None if offline() or local_files_only else _listing(repo_id, revision)
    if listed is not None:
        return listed
    if root is None:   # from the cache alone: nothing is downloaded to list a folder
        root = snapshot(repo_id, ["*.gguf"], revision=revision, local_files_only=True, **kw)
    return _files(root)


def find_drafter(repo_id: str, target: str | None = None, *, root: Path | None = None, revision: str | None = None,
                 local_files_only: bool = False, **kw) -> Path | None:
    """The drafter of ``repo_id`` that :func:`choose_drafter` picks, fetched as :func:`hub_model` fetches
    a model; None if there is none. ``target``: the target's path when it is the same repository,
    ``root`` its snapshot folder; ``kw``: :func:`snapshot`'s ``cache_dir``, ``local_dir``, ..."""
    files = repo_files(repo_id, root, revision=revision, local_files_only=local_files_only, **kw)
    pick = choose_drafter(files, target)
    if pick is None:
        log.info("%s: no drafter GGUF%s", repo_id, f" ({', '.join(f'{prefix}*.gguf' for _, prefix in SIDECAR_KINDS)}) "
                 f"beside {target}: plain decoding" if target is not None else "")
        return None
    log.info("%s: drafter %s: %s", repo_id, pick.file, pick.reason)
    return hub_model(repo_id, glob.escape(pick.file), revision=revision, local_files_only=local_files_only, **kw)


def pair_snapshot(repo_id: str, *, revision: str | None = None, cache_dir=None, local_files_only: bool = False) -> Path:
    """A converted pair published with its ``pair.json``: the manifest first, then the two GGUFs it names."""
    from dflash_gguf.pair import MANIFEST

    manifest = hub_file(repo_id, MANIFEST, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
    try:
        doc = json.loads(manifest.read_text())
        files = [doc["target"]["file"], doc["drafter"]["file"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{repo_id}: {MANIFEST} is not a dflash-gguf pair manifest ({e})") from e
    root = snapshot(repo_id, [MANIFEST, *files], revision=revision, cache_dir=cache_dir,
                    local_files_only=local_files_only)
    missing = [f for f in files if not (root / f).is_file()]
    if missing:
        raise HubFileNotFound(f"{repo_id}: {', '.join(missing)} named by {MANIFEST} "
                              f"{'not in the cache (offline)' if offline() or local_files_only else 'not in the repo'}")
    return root


def checkpoint(value: str | os.PathLike, *, revision: str | None = None) -> Path:
    """A Hugging Face checkpoint folder: ``value`` itself, or the snapshot of hub id ``value``."""
    if not looks_like_repo_id(value):
        return Path(value)
    log.info("fetching %s from the Hugging Face Hub (%s)", value, ", ".join(CHECKPOINT_PATTERNS))
    return snapshot(str(value), CHECKPOINT_PATTERNS, revision=revision)
