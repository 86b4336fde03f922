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


class HubFileNotFound(FileNotFoundError):
    """A file that is neither in the local Hub cache nor downloadable (offline, or not in the repo)."""


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
             local_files_only: bool = False) -> Path:
    """The local snapshot folder of ``repo_id`` holding (at least) the files matching ``patterns``."""
    hub = _hub()
    from huggingface_hub.utils import validate_repo_id

    validate_repo_id(repo_id)
    where = cache_dir or os.environ.get("HF_HUB_CACHE") or "the Hugging Face cache"
    try:
        path = hub.snapshot_download(repo_id, revision=revision, allow_patterns=patterns, cache_dir=cache_dir,
                                     local_files_only=local_files_only)
    except Exception as e:   # LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError, HTTP errors
        if offline() or local_files_only or type(e).__name__ == "LocalEntryNotFoundError":
            raise HubFileNotFound(
                f"{repo_id}{'@' + revision if revision else ''} ({', '.join(patterns)}) is not in {where} and "
                f"downloading is off ({'HF_HUB_OFFLINE=1' if offline() else 'local_files_only'}): run once with "
                f"network access, or `huggingface-cli download {repo_id}` ({type(e).__name__})") from e
        raise
    return Path(path)


def hub_file(repo_id: str, filename: str, *, revision: str | None = None, cache_dir=None,
             local_files_only: bool = False) -> Path:
    """The one file of ``repo_id`` that ``filename`` (a name or a glob, e.g. ``*q8_0.gguf``) matches."""
    root = snapshot(repo_id, [filename], revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
    found = sorted(p for p in root.rglob("*") if p.is_file() and fnmatch.fnmatch(p.relative_to(root).as_posix(),
                                                                                  filename))
    if not found:
        mode = " (offline: only the cache was searched)" if offline() or local_files_only else ""
        have = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        raise HubFileNotFound(f"no file matching {filename!r} in {repo_id}{mode}; "
                              f"have: {', '.join(have) or 'nothing'} (in {root})")
    if len(found) > 1:
        raise ValueError(f"{len(found)} files of {repo_id} match {filename!r}: "
                         f"{', '.join(p.relative_to(root).as_posix() for p in found)}; name one")
    log.info("%s: %s", repo_id, found[0])
    return found[0]


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
