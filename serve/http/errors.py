"""OpenAI's error shape, and the exception handlers that put every failure into it.

A route raises :class:`ApiError`; FastAPI's own failures (routing, an unparsable body, a
field that does not validate) and our bugs come out in the same JSON shape, so a client
written for OpenAI or vLLM reads every error the same way.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException


class ApiError(Exception):
    """A refused request: its HTTP status, message, OpenAI error ``type`` and the field at fault."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    """OpenAI's ``{"error": {...}}`` body; quoted client text is made encodable first."""
    return JSONResponse(status_code=status, content={"error": {"message": printable(message), "type": kind,
                                                               "param": param and printable(param), "code": status}})


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot carry (a lone surrogate) as "?": an error that quotes a
    client's text must still encode, or its reply becomes a plain-text 500."""
    return text.encode("utf-8", "replace").decode("utf-8")


async def api_error(request: Request, err: ApiError) -> JSONResponse:
    """A route's own refusal."""
    return error_response(err.status, err.message, err.kind, err.param)


async def http_error(request: Request, err: HTTPException) -> JSONResponse:
    """Starlette's errors (routing, unparsable bodies), in OpenAI's shape."""
    return error_response(err.status_code, str(err.detail), "invalid_request_error" if err.status_code < 500
                          else "server_error")


async def unexpected_error(request: Request, err: Exception) -> JSONResponse:
    """A bug of ours: OpenAI's shape, with no detail; Starlette logs the traceback."""
    return error_response(500, f"internal server error ({type(err).__name__}); see the server's log", "server_error")


async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
    """A 400 naming the first field that failed; a field we do not know is named as unsupported
    (e.g. vLLM's use_beam_search, guided_json)."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if p != "body")
    if first["type"] == "extra_forbidden":
        return error_response(400, f"{where}: this field is not supported by kvshare", param=where or None)
    return error_response(400, f"{where}: {first['msg']}", param=where or None)
