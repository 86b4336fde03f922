"""The DFlash block draft-verify loop (see :mod:`.decoder`)."""
from __future__ import annotations

from dflash_gguf.spec.decoder import (DFlashDecoder, DrafterInfo, GenerationStats, SpecOptions,
                                      common_prefix_len)

__all__ = ["DFlashDecoder", "DrafterInfo", "GenerationStats", "SpecOptions", "common_prefix_len"]
