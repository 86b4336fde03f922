"""Typed errors of the converter. Every message says what is wrong and what to do about it."""
from __future__ import annotations

from dflash_gguf.errors import DFlashError, ManifestError  # noqa: F401 (ManifestError: the runtime's)


class PairError(DFlashError, ValueError):
    """The Hugging Face target and drafter folders do not make a valid DFlash pair."""


class OutputError(DFlashError, OSError):
    """The output directory cannot be written (not writable, exists already, disk full)."""


class ConvertError(DFlashError):
    """A conversion step (upstream converter, llama.cpp quantizer) failed."""
