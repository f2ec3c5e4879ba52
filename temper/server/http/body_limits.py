"""Bounds on request bodies, enforced before a route parses them.

Data routes (forward_backward, forward, asample) carry training data and prompts and take up
to `data_routes_bytes` (`temper serve --max-body-mb`). Every other route takes at most
`other_routes_bytes`, and its JSON body at most MAX_JSON_ITEMS items (list entries and object
members, at all depths): FastAPI turns each bad item into a validation error and formats
every one on the event loop, so a 1 MiB body of 500,000 bad tags held up every other client
for 7 s, where 9,000 cost 30-50 ms.

Over a limit is a 413 with the usual JSON error body naming the route, the limit and the
setting, and `x-should-retry: false`. A body whose Content-Length is over the limit is
refused before any of it is read (uvicorn drops the rest as it arrives, so the client still
reads the answer); a chunked body is counted as it is read. Body-less requests and small
non-data bodies pass straight through: `retrieve_future` and `healthz` pay nothing.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from temper.server.http.errors import BadRequest, error_body
from temper.server.http.json_bodies import parse_json

# The SDK sends `forward` to forward_backward too (with forward_only set).
DATA_ROUTES = frozenset({"/api/v1/forward_backward", "/api/v1/asample"})
SAMPLE_ROUTE = "/api/v1/asample"
MAX_SAMPLE_BYTES = 32 << 20
"""asample's own cap under the data limit: its JSON is validated by pydantic holding the GIL
(about 2.5 us and 1.2 KB per item), so 32 MiB of prompt is already seconds of the server."""
MAX_JSON_ITEMS = 10_000
"""Most items a JSON body of a non-data route may hold (its lists and objects together)."""
_SMALL_BYTES = 2 * MAX_JSON_ITEMS
"""A body this small cannot hold more than MAX_JSON_ITEMS items (each takes 2 bytes)."""
_RETRY = {"x-should-retry": "false"}
_OTHER_ROUTES = "routes other than asample, forward and forward_backward"


class BodyTooLarge(HTTPException):
    """A chunked body found over its limit while the route reads it. FastAPI passes an
    HTTPException from body reading through, so the app's handler answers the 413."""

    def __init__(self, detail: str) -> None:
        super().__init__(status_code=413, detail=detail, headers=_RETRY)


class BodyLimits:
    """ASGI middleware that refuses request bodies over their route's limit (module doc)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        data_routes_bytes: int = 256 << 20,
        other_routes_bytes: int = 1 << 20,
    ) -> None:
        for name, value in (
            ("data_routes_bytes", data_routes_bytes),
            ("other_routes_bytes", other_routes_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"BodyLimits: {name} must be a positive int, got {value!r}")
        self.app = app
        self.data_routes_bytes = data_routes_bytes
        self.other_routes_bytes = other_routes_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        is_data = path in DATA_ROUTES
        limit = self.data_routes_bytes if is_data else self.other_routes_bytes
        if path == SAMPLE_ROUTE:
            limit = min(limit, MAX_SAMPLE_BYTES)
        declared = _declared_length(scope)
        if declared is not None and declared > limit:
            await _refuse(scope, receive, send, _over(path, limit, size=declared))
        elif is_data:
            counted = receive if declared is not None else _counted(receive, path, limit)
            await self.app(scope, counted, send)
        elif declared is not None and declared <= _SMALL_BYTES:
            await self.app(scope, receive, send)
        else:
            await self._checked(scope, receive, send, path=path, limit=limit)

    async def _checked(
        self, scope: Scope, receive: Receive, send: Send, *, path: str, limit: int
    ) -> None:
        """A non-data body that may be big: read it (at most `limit` bytes), count its JSON
        items, and hand it on to the app."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > limit:
                await _refuse(scope, receive, send, _over(path, limit))
                return
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        crowded = _crowded(body) if size > _SMALL_BYTES else None
        if crowded is not None:
            limit_text = f"requests to {_OTHER_ROUTES} hold at most {MAX_JSON_ITEMS} JSON items"
            await _refuse(scope, receive, send, f"{path}: {crowded}; {limit_text}")
            return
        await self.app(scope, _replaying(body, receive), send)


def _declared_length(scope: Scope) -> int | None:
    """The body's Content-Length; 0 without one (no body), None if chunked: counted as read."""
    headers = dict(scope["headers"])
    if b"content-length" in headers:
        try:
            return int(headers[b"content-length"])
        except ValueError:  # uvicorn refuses these; count it anyway
            return None
    return None if b"transfer-encoding" in headers else 0


def _over(path: str, limit: int, *, size: int | None = None) -> str:
    body = "request body" if size is None else f"request body of {size} bytes"
    if path == SAMPLE_ROUTE and limit == MAX_SAMPLE_BYTES:
        where = "asample (a prompt and its options; send long prompts as token ids)"
    elif path in DATA_ROUTES:
        where = "data routes; raise it with temper serve --max-body-mb"
    else:
        where = _OTHER_ROUTES
    return f"{path}: {body} is over the limit of {_mib(limit)} for {where}"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:g} MiB" if num_bytes >= 2**20 else f"{num_bytes} bytes"


async def _refuse(scope: Scope, receive: Receive, send: Send, detail: str) -> None:
    response = JSONResponse(error_body(detail), status_code=413, headers=_RETRY)
    await response(scope, receive, send)


def _counted(receive: Receive, path: str, limit: int) -> Receive:
    received = 0

    async def counting() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(_over(path, limit))
        return message

    return counting


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`body` as one message, then the connection's own messages (a disconnect)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


def _crowded(body: bytes) -> str | None:
    """What in JSON `body` is over MAX_JSON_ITEMS items, else None (also when `body` is not
    JSON, or nests too deep: the route says what is wrong with it). Stops counting at the
    limit."""
    try:
        value = parse_json(body)
    except BadRequest:
        return None
    num_items = 0
    pending: list[tuple[str, object]] = [("body", value)]
    while pending:
        where, value = pending.pop()
        if not isinstance(value, (dict, list)):
            continue
        if len(value) > MAX_JSON_ITEMS:
            return f"{where} has {len(value)} items"
        num_items += len(value)
        if num_items > MAX_JSON_ITEMS:
            return f"the body has more than {MAX_JSON_ITEMS} items"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        pending += [(f"{where}.{key}", child) for key, child in items]
    return None
