"""Route llama.cpp's log output into :mod:`logging` (explicitly: nothing happens at import)."""
from __future__ import annotations

import logging

from dflash_gguf.native.llama import llama_low as C

_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR, 5: logging.DEBUG}
_logger = logging.getLogger("dflash_gguf.llama_cpp")
_callback = None  # keep a reference: llama.cpp holds a raw pointer to it
_partial = ""


def set_log_handler(logger: logging.Logger | None = None) -> None:
    """Send llama.cpp / ggml log lines to ``logger`` (default ``dflash_gguf.llama_cpp``).

    Informational lines go to DEBUG, warnings and errors keep their level.
    """
    global _callback, _logger
    if logger is not None:
        _logger = logger

    def _cb(level, text, _user):
        global _partial
        msg = _partial + text.decode("utf-8", "replace")
        if not msg.endswith("\n"):
            _partial = msg
            return
        _partial = ""
        lvl = _LEVELS.get(int(level), logging.DEBUG)
        _logger.log(logging.DEBUG if lvl == logging.INFO else lvl, "%s", msg.rstrip("\n"))

    _callback = C.llama_log_callback(_cb)
    C.llama_log_set(_callback, None)
