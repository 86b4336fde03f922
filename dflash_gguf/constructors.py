"""Ways to open a :class:`dflash_gguf.Llama` besides its constructor: a converted pair directory,
files on the Hugging Face Hub, a pair published on the Hub (a mixin: ``cls`` is the Llama class)."""
from __future__ import annotations

import os
from typing import TypeVar

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
    def from_pretrained(cls: type[L], repo_id: str, filename: str, draft_repo_id: str | None = None,
                        draft_filename: str | None = None, *, revision: str | None = None,
                        draft_revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                        local_files_only: bool = False, **kwargs) -> L:
        """A target GGUF (and a drafter GGUF) from the Hugging Face Hub, through its cache.

        ``filename`` / ``draft_filename``: a file name or a glob matching exactly one file
        (``"*Q8_0.gguf"``). ``draft_repo_id`` defaults to ``repo_id`` when only ``draft_filename`` is
        given. Offline (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``) only the cache is read.
        Needs ``huggingface_hub`` (``pip install 'dflash-gguf[hub]'``); see :mod:`dflash_gguf.hub`.
        """
        from dflash_gguf.hub import hub_file

        target = hub_file(repo_id, filename, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
        drafter = None
        if draft_filename is not None:
            drafter = hub_file(draft_repo_id or repo_id, draft_filename, revision=draft_revision, cache_dir=cache_dir,
                               local_files_only=local_files_only)
        elif draft_repo_id is not None:
            raise ValueError("draft_repo_id needs draft_filename (the drafter GGUF's name or a glob)")
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
