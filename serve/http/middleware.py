"""What every request passes before a route sees it: the API key, the body's size, and its
text being Unicode.

The key and the size are pure ASGI middlewares: Starlette's ``BaseHTTPMiddleware``
(``@app.middleware``) hides the client's disconnect from handlers, so a request could never
be cancelled. The Unicode check is a route class, so every route's every field is covered
in one place.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from ..api_key import authorized
from .errors import ApiError, error_response, printable

# a UTF-16 surrogate's JSON escape: only a body with one can parse to text that is not Unicode
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate_at(value) -> str | None:
    """The dotted path of a string (or key) in parsed JSON that holds a lone surrogate ("" for
    the top level), or None when all of it is Unicode; walked without recursion."""
    todo = [(value, "")]
    while todo:
        item, where = todo.pop()
        if isinstance(item, str) and printable(item) != item:
            return where
        children = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, child in children:
            path = f"{where}.{printable(str(key))}" if where else printable(str(key))
            if isinstance(key, str) and printable(key) != key:
                return path
            todo.append((child, path))
    return None


async def check_unicode(request: Request) -> None:
    """A 400 naming the field when a body is not UTF-8 or its JSON holds a lone surrogate
    (``"\\ud800"``): such text failed deep inside a tokenizer, a template or an error reply
    (a plain-text 500). Bodies without a surrogate's escape are only decoded (valid pairs, an
    emoji as ``json.dumps`` escapes it, are walked and pass)."""
    body = await request.body()
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as err:  # a surrogate's own bytes (ED A0 80) among them
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {err.start})") from None
    if not _SURROGATE_ESCAPE.search(text):
        return
    try:
        data = await request.json()  # Starlette keeps it: FastAPI does not parse the body again
    except ValueError:
        return  # not JSON: FastAPI's own 400 says so
    where = lone_surrogate_at(data)
    if where is not None:
        raise ApiError(400, f"{where or 'the body'}: the text is not valid Unicode (a lone UTF-16 surrogate, "
                       "such as \\ud800); send UTF-8 text", param=where or None)


class UnicodeCheckedRoute(APIRoute):
    """Every route checks its body with :func:`check_unicode` before FastAPI parses it, so that
    each field of every route is covered in one place."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        """FastAPI's handler, behind the check."""
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            await check_unicode(request)
            return await handler(request)

        return checked


class ApiKeyGuard:
    """Require ``Authorization: Bearer KEY`` on /v1/*, /tokenize and /detokenize (these read
    an adapter's names and training system prompt), compared in constant time (the rule of
    :mod:`kvshare.serve.api_key`, which the Ray gateway applies too)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not authorized(scope["path"], scope["headers"], self.expected):
            await error_response(401, "invalid API key", kind="authentication_error")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413 before anything buffers or parses
    it: a declared Content-Length is judged up front, a chunked body is read here only up to
    the limit and then handed on."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:  # the HTTP server holds the client to it
            if not declared.isdigit() or int(declared) > self.limit:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body arrived: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # what follows the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        """413, without reading the rest of the body."""
        await error_response(413, f"the request body is over {self.limit} bytes")(scope, receive, send)
