"""Typed exceptions. Every status code of the C API maps to one class, with a remedy."""
from __future__ import annotations


class DFlashError(RuntimeError):
    """Base class of every dflash-gguf error."""


class BuildMismatchError(ImportError):
    """The installed llama-cpp-python is not the patched build this package expects."""


class InvalidArgumentError(DFlashError, ValueError):
    code = -1


class LayerError(DFlashError, ValueError):
    code = -2


class TapDisabledError(DFlashError):
    code = -3


class RowRangeError(DFlashError, IndexError):
    code = -4


class NotADrafterError(DFlashError, ValueError):
    code = -5


class UnsupportedError(DFlashError):
    code = -6


class PairMismatchError(DFlashError, ValueError):
    code = -7


class BufferTooSmallError(DFlashError, ValueError):
    code = -8


class DecodeError(DFlashError):
    """A llama.cpp decode failed."""
    code = -13


class ContextFullError(DecodeError):
    """No KV slot was left: the context window is full."""
    code = -10


class DecodeAbortedError(DecodeError):
    code = -11


class InvalidBatchError(DecodeError):
    code = -12


class RollbackError(DFlashError):
    """A cache could not be rolled back to the committed length."""


class ContextOverflowError(DFlashError, ValueError):
    """A request does not fit the context window."""


class ModelFileError(DFlashError, ValueError):
    """A model file is truncated, corrupt or inconsistent (found before llama.cpp loads it)."""


class ModelNotFoundError(DFlashError, FileNotFoundError, ValueError):
    """A model file does not exist (a ValueError too, as llama_cpp raises for a missing path)."""


class StateFileError(DFlashError, OSError):
    """A saved state could not be written or read (disk full, permissions, a damaged file)."""


class BusyError(DFlashError):
    """Another thread is generating with this ``Llama``: use one per thread, or serialize the calls."""


_BY_CODE = {c.code: c for c in (InvalidArgumentError, LayerError, TapDisabledError, RowRangeError,
                                NotADrafterError, UnsupportedError, PairMismatchError, BufferTooSmallError,
                                DecodeError, ContextFullError, DecodeAbortedError, InvalidBatchError)}

_REMEDY = {
    -2: "use layer ids in [0, n_layer) of the target",
    -3: "enable the tap first (llama_dflash_set_taps / Engine prepares it for you)",
    -4: "read only rows of the last decode (0 <= row0, row0 + n_rows <= tap_rows)",
    -5: "pass a GGUF whose general.architecture is 'dflash' as the drafter",
    -6: "use a DFlash or DFlash2 drafter with a Qwen3, Qwen3.5, Qwen3-Next or Llama target",
    -7: "convert the drafter against this target (python -m dflash_gguf.convert TARGET DRAFTER -o OUT)",
    -10: "raise n_ctx or shorten the prompt / max_tokens",
}


def raise_for_status(code: int, what: str, describe=None) -> None:
    """Raise the typed exception for a negative status code of the C API."""
    if code >= 0:
        return
    cls = _BY_CODE.get(code, DFlashError)
    text = describe(code) if describe else f"status {code}"
    remedy = _REMEDY.get(code)
    raise cls(f"{what}: {text}" + (f" ({remedy})" if remedy else ""))


class ManifestError(DFlashError, ValueError):
    """A pair directory is incomplete or damaged (``pair.json`` missing, a file missing or changed)."""


class RpcError(DFlashError, ConnectionError):
    """An rpc-server (llama.cpp's RPC backend) could not be used: see the subclasses."""


class RpcConnectError(RpcError):
    """An rpc-server endpoint is unreachable (refused, no route, or no answer within the timeout)."""


class RpcProtocolError(RpcError):
    """Something answers at the endpoint, but not as an rpc-server of this build's protocol version."""


class RpcLostError(RpcError, DecodeError):
    """An rpc-server holding the model's layers went away during a decode: the request fails, the process lives."""
