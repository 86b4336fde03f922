"""Files from the Hugging Face Hub, the way llama_cpp users fetch models (optional: ``huggingface_hub``).

Everything goes through ``huggingface_hub.snapshot_download`` with ``allow_patterns``, so downloads
land in the usual Hub cache (``HF_HUB_CACHE``, default ``~/.cache/huggingface/hub``), are shared with
every other Hub user on the machine, resume after an interruption, and work offline from the cache
(``HF_HUB_OFFLINE=1``, or ``local_files_only=True``). A file missing offline is a
:class:`HubFileNotFound` that says where it looked and how to get it.

    from dflash_gguf import Llama
    llm = Llama.from_pretrained("org/Qwen3-8B-GGUF", "*q8_0.gguf",
                                draft_repo_id="org/Qwen3-8B-DFlash-GGUF", draft_filename="*.gguf")
    llm = Llama.from_pair_pretrained("org/qwen3-8b-dflash-pair")      # a pair with its pair.json
"""
from __future__ import annotations

import fnmatch
import json
import logging
import os
import re
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


def _match(repo_id: str, root: Path, filename: str, offline_mode: bool) -> str:
    found = [rel for rel in _files(root) if fnmatch.fnmatch(rel, filename)]
    if not found:
        mode = " (offline: only the cache was searched)" if offline_mode else ""
        raise HubFileNotFound(f"no file matching {filename!r} in {repo_id}{mode}; "
                              f"have: {', '.join(_files(root)) or 'nothing'} (in {root})")
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
    quiet = offline() or bool(kw.get("local_files_only"))
    root = snapshot(repo_id, [filename], **kw)
    rel = _match(repo_id, root, filename, quiet)
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
    return root / rel


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
