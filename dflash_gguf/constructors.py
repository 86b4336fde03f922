"""Ways to open a :class:`dflash_gguf.Llama` besides its constructor: a converted pair directory,
files on the Hugging Face Hub, a pair published on the Hub (a mixin: ``cls`` is the Llama class)."""
from __future__ import annotations

import os
from typing import Literal, TypeVar

from dflash_gguf.pair import pair_files

L = TypeVar("L", bound="PairConstructors")


class PairConstructors:
    """``from_pair``, ``from_pretrained`` and ``from_pair_pretrained`` for :class:`dflash_gguf.Llama`
    (each returns an instance of the class it is called on; this module does not import the API)."""

    @classmethod
    def from_pair(cls: type[L], path: str | os.PathLike, *, verify: bool = False, **kwargs) -> L:
        """Open a converted pair directory (``pair.json`` + ``target*.gguf`` + ``drafter*.gguf``).

        ``verify=True`` also checks both files against the sha256 sums in ``pair.json``.
        """
        target, drafter = pair_files(path, verify=verify)
        return cls(str(target), draft_model_path=str(drafter), **kwargs)

    @classmethod
    def from_pretrained(cls: type[L], repo_id: str, filename: str | None, additional_files: list | None = None,
                        local_dir: str | os.PathLike | None = None,
                        local_dir_use_symlinks: bool | Literal["auto"] = "auto",
                        cache_dir: str | os.PathLike | None = None, *, draft_repo_id: str | None = None,
                        draft_filename: str | None = None, revision: str | None = None,
                        draft_revision: str | None = None, local_files_only: bool = False, **kwargs) -> L:
        """``llama_cpp.Llama.from_pretrained`` (same arguments, in the same order), plus a drafter.

        ``filename``: a file name or a glob matching exactly one file of ``repo_id`` (``"*Q8_0.gguf"``);
        ``additional_files``: more names or globs, one file each, fetched into the same folder (the
        other shards of a split GGUF: ``filename`` then names the first, ``*-00001-of-0000N.gguf``,
        which llama.cpp opens with the rest beside it; shards not listed are fetched too).
        ``local_dir``: put the files there instead of the Hub cache (``cache_dir``); the drafter goes
        there too when it comes from the same repository. Keyword-only: ``draft_repo_id`` (default
        ``repo_id``) and ``draft_filename`` (the drafter GGUF, a name or glob; a split drafter is
        fetched whole), ``revision`` / ``draft_revision``, ``local_files_only``. Offline
        (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``) only the cache (or ``local_dir``) is read.
        Needs ``huggingface_hub`` (``pip install 'dflash-gguf[hub]'``); see :mod:`dflash_gguf.hub`.
        """
        from dflash_gguf.hub import hub_model

        if filename is None:
            raise ValueError("filename is required: the GGUF's name or a glob matching it (e.g. '*Q8_0.gguf')")
        if draft_repo_id is not None and draft_filename is None:
            raise ValueError("draft_repo_id needs draft_filename (the drafter GGUF's name or a glob)")
        where = dict(cache_dir=cache_dir, local_files_only=local_files_only)
        local = dict(local_dir=local_dir, local_dir_use_symlinks=local_dir_use_symlinks)
        target = hub_model(repo_id, filename, additional_files, revision=revision, **where, **local)
        drafter = None
        if draft_filename is not None:
            draft_repo = draft_repo_id or repo_id
            drafter = hub_model(draft_repo, draft_filename, revision=draft_revision, **where,
                                **(local if draft_repo == repo_id else {}))
        return cls(str(target), draft_model_path=str(drafter) if drafter else None, **kwargs)

    @classmethod
    def from_pair_pretrained(cls: type[L], repo_id: str, *, revision: str | None = None,
                             cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                             **kwargs) -> L:
        """A converted pair published on the Hub with its ``pair.json`` (made by ``dflash_gguf.convert``):
        the manifest, then the two GGUFs it names (sizes checked as :meth:`from_pair` does)."""
        from dflash_gguf.hub import pair_snapshot

        root = pair_snapshot(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
        return cls.from_pair(root, **kwargs)
