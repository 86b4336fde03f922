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
                        draft_filename: str | Literal[False] | None = None, revision: str | None = None,
                        draft_revision: str | None = None, local_files_only: bool = False, **kwargs) -> L:
        """``llama_cpp.Llama.from_pretrained`` (same arguments, in the same order), plus a drafter.

        ``filename``: a file name or a glob matching exactly one file of ``repo_id`` (``"*Q8_0.gguf"``;
        drafters published beside the target, ``dflash-*`` and ``dspark-*``, are not taken for it);
        ``additional_files``: more names or globs, one file each, fetched into the same folder (the
        other shards of a split GGUF: ``filename`` then names the first, ``*-00001-of-0000N.gguf``,
        which llama.cpp opens with the rest beside it; shards not listed are fetched too).
        ``local_dir``: put the files there instead of the Hub cache (``cache_dir``); the drafter goes
        there too when it comes from the same repository.

        The drafter (keyword-only arguments): by default the one published in the target's own
        repository, as upstream's ``-hf`` finds it (``dspark-NAME-Q8_0.gguf``, ``dflash-NAME-BF16.gguf``,
        ...; DSpark before DFlash, Q8_0 before BF16/F16: :data:`dflash_gguf.hub.SIDECAR_KINDS`, ``SIDECAR_QUANTS``), and
        plain decoding when there is none. ``draft_filename``: that file instead (a name or glob; a
        split drafter is fetched whole), or ``False`` for no drafter. ``draft_repo_id``: the drafter's
        own repository (a DSpark or DFlash GGUF published alone); without ``draft_filename`` its
        drafter is picked the same way. ``revision`` / ``draft_revision``, ``local_files_only``:
        offline (``HF_HUB_OFFLINE=1`` or ``local_files_only=True``) only the cache (or ``local_dir``)
        is read, and searched. Needs ``huggingface_hub`` (``pip install 'dflash-gguf[hub]'``); see
        :mod:`dflash_gguf.hub`.
        """
        target, drafter = cls.pretrained_files(
            repo_id, filename, additional_files, local_dir, local_dir_use_symlinks, cache_dir,
            draft_repo_id=draft_repo_id, draft_filename=draft_filename, revision=revision,
            draft_revision=draft_revision, local_files_only=local_files_only)
        return cls(str(target), draft_model_path=str(drafter) if drafter else None, **kwargs)

    @staticmethod
    def pretrained_files(repo_id: str, filename: str | None, additional_files: list | None = None,
                         local_dir: str | os.PathLike | None = None,
                         local_dir_use_symlinks: bool | Literal["auto"] = "auto",
                         cache_dir: str | os.PathLike | None = None, *, draft_repo_id: str | None = None,
                         draft_filename: str | Literal[False] | None = None, revision: str | None = None,
                         draft_revision: str | None = None, local_files_only: bool = False):
        """The local paths :meth:`from_pretrained` opens - ``(target, drafter or None)`` - fetched as it
        fetches them (the command line reads the target's header before it opens it, with one fetch)."""
        from dflash_gguf.hub import HubFileNotFound, fetch_model, find_drafter, hub_model

        if filename is None:
            raise ValueError("filename is required: the GGUF's name or a glob matching it (e.g. '*Q8_0.gguf')")
        if draft_filename is False and draft_repo_id is not None:
            raise ValueError("draft_repo_id with draft_filename=False: either a drafter's repository or no drafter")
        if draft_filename is not None and draft_filename is not False and not isinstance(draft_filename, str):
            raise TypeError(f"draft_filename: a file name or glob, None (find the drafter) or False (none), "
                            f"not {type(draft_filename).__name__}")
        where = dict(cache_dir=cache_dir, local_files_only=local_files_only)
        local = dict(local_dir=local_dir, local_dir_use_symlinks=local_dir_use_symlinks)
        root, rel = fetch_model(repo_id, filename, additional_files, revision=revision, **where, **local)
        draft_repo = draft_repo_id or repo_id
        same = draft_repo == repo_id
        drafter = None
        if isinstance(draft_filename, str):
            drafter = hub_model(draft_repo, draft_filename, revision=draft_revision, **where, **(local if same else {}))
        elif draft_filename is None and same:
            rev = draft_revision or revision    # the target's snapshot folder lists only its own revision
            drafter = find_drafter(repo_id, rel, root=root if rev == revision else None, revision=rev, **where, **local)
        elif draft_filename is None:
            drafter = find_drafter(draft_repo, revision=draft_revision, **where)
            if drafter is None:
                raise HubFileNotFound(f"no GGUF in {draft_repo} to draft with (name one: draft_filename=...)")
        return root / rel, drafter

    @classmethod
    def from_pair_pretrained(cls: type[L], repo_id: str, *, revision: str | None = None,
                             cache_dir: str | os.PathLike | None = None, local_files_only: bool = False,
                             **kwargs) -> L:
        """A converted pair published on the Hub with its ``pair.json`` (made by ``dflash_gguf.convert``):
        the manifest, then the two GGUFs it names (sizes checked as :meth:`from_pair` does)."""
        from dflash_gguf.hub import pair_snapshot

        root = pair_snapshot(repo_id, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only)
        return cls.from_pair(root, **kwargs)
