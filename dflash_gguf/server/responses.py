"""What the server's routes share besides the model: the errors they refuse with and the shape those
take (OpenAI's ``{"error": {...}}``), and how often a running request looks for a gone client. The
one-at-a-time route (:mod:`.app`), the slots (:mod:`.slots`), the other APIs (:mod:`.translate`) and the
extras (:mod:`.extras`) all refuse in these shapes (their answers' shapes: :mod:`dflash_gguf.requests.responses`);
kept apart from :mod:`.app` so that none of them needs the app that routes to them.
"""
from __future__ import annotations

import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

log = logging.getLogger("dflash_gguf.server")
POLL_S = 0.05          # how often a running generation checks for a gone client or a passed deadline


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ServingError(Exception):
    """A refusal decided by the serving state: 503 (queue full), 408 (timeout)."""

    def __init__(self, status: int, message: str, type_: str, code: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.code, self.headers = status, type_, code, headers or {}


def error_body(message: str, type_: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def plain_json(obj):
    """``obj`` with numpy scalars as Python numbers (llama_cpp's logprobs are numpy floats)."""
    if isinstance(obj, dict):
        return {k: plain_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain_json(v) for v in obj]
    return obj.item() if hasattr(obj, "item") and hasattr(obj, "dtype") else obj


def error_response(exc: BaseException) -> JSONResponse:
    if isinstance(exc, ServingError):
        return JSONResponse(error_body(str(exc), exc.type, None, exc.code), status_code=exc.status,
                            headers=exc.headers)
    if isinstance(exc, ValueError):   # bad input: validation, context overflow, unknown token ids, ...
        return JSONResponse(error_body(str(exc) or type(exc).__name__, "invalid_request_error",
                                       getattr(exc, "param", None)), status_code=400)
    log.exception("request failed", exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), status_code=500)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or (where or None)
        msg = err.get("msg", "invalid value")
        if err.get("type") == "json_invalid":
            error = (err.get("ctx") or {}).get("error", "")
            parts.append(f"the body is not valid JSON ({error} at character {where})")
            return "; ".join(parts), None
        if err.get("type") == "extra_forbidden":
            msg = "unknown field (not supported by this server)"
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "invalid request", param
