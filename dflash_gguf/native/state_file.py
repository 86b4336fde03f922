"""Save a ``Llama``'s state to a file and load it back, safely.

``llama_cpp.Llama.save_state()`` returns the state in memory. :func:`save_state_file` writes it
atomically - to a temporary file in the same folder, ``fsync``-ed, then renamed over the target -
so a full disk (ENOSPC), a quota or a crash mid-write leave the previous file (if any) intact and
no partial file behind; the error comes back as :class:`~dflash_gguf.errors.StateFileError` and
the ``Llama`` itself is untouched and usable. The format is a numpy ``.npz`` archive read with
``allow_pickle=False`` (no code runs when a file is loaded).
"""
from __future__ import annotations

import contextlib
import io
import os
import zipfile
from pathlib import Path

import numpy as np

from dflash_gguf.errors import StateFileError

FORMAT = "dflash-gguf-state-1"


def _error(message: str, errno: int | None = None) -> StateFileError:
    e = StateFileError(message)
    e.errno = errno
    return e


def _write(f, data: bytes) -> None:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def save_state_file(llm, path: str | os.PathLike) -> Path:
    """Write ``llm.save_state()`` to ``path`` atomically; raises StateFileError on any I/O failure."""
    path = Path(path)
    state = llm.save_state()
    buf = io.BytesIO()
    np.savez(buf, format=np.array(FORMAT), input_ids=np.asarray(state.input_ids),
             scores=np.asarray(state.scores), n_tokens=np.array(state.n_tokens, dtype=np.int64),
             llama_state=np.frombuffer(state.llama_state, dtype=np.uint8),
             llama_state_size=np.array(state.llama_state_size, dtype=np.int64),
             seed=np.array(-1 if state.seed is None else state.seed, dtype=np.int64))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            _write(f, buf.getvalue())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _error(f"could not save the state to {path}: {e.strerror or e} "
                     "(the previous file, if any, is unchanged)", e.errno) from e
    return path


def load_state_file(llm, path: str | os.PathLike) -> None:
    """Restore a state written by :func:`save_state_file`; raises StateFileError if it is unreadable."""
    from dflash_gguf.native.llama import llama_cpp

    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["format"]) != FORMAT:
                raise ValueError(f"format {str(z['format'])!r}")
            seed = int(z["seed"])
            state = llama_cpp.LlamaState(input_ids=z["input_ids"].copy(), scores=z["scores"].copy(),
                                         n_tokens=int(z["n_tokens"]), llama_state=z["llama_state"].tobytes(),
                                         llama_state_size=int(z["llama_state_size"]), seed=None if seed < 0 else seed)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise _error(f"could not read the state file {path}: {e.strerror or e}", e.errno) from e
    except (ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
        raise _error(f"{path} is not a state file written by save_state_file ({e})") from e
    if len(state.llama_state) != state.llama_state_size:
        raise _error(f"{path} is damaged (state of {len(state.llama_state)} bytes, header says "
                     f"{state.llama_state_size})")
    try:
        llm.load_state(state)
    except RuntimeError as e:
        raise _error(f"llama.cpp refused the state in {path} (saved from another model or context size?)") from e
