"""The request log: one line per HTTP request on the `temper.server.requests` logger (INFO).

    POST /api/v1/forward_backward 200 3.1ms model=sess-1a2b:train:0 request=req-9f..
    POST /api/v1/retrieve_future 200 20.4ms request=req-9f..
    POST /api/v1/asample 404 0.3ms sampler=samp-77.. error=user: sampling session ... is gone: ..

Fields: method, route template (`/api/v1/samplers/{sampling_session_id}`, else the raw path),
status, duration, then what the request named: `session=`, `model=`, `sampler=` (as looked up,
so an unknown id shows too), `request=` (the future's request id, the one the SDK prints in
its errors; for retrieve_future the one polled), and for a 4xx/5xx `error=<category>: <detail>`.
A request that fails after it was accepted answers its future with an error; the scheduler
logs that as `request <id> failed` (user errors at INFO, server errors at ERROR with the
traceback).

It is a plain ASGI middleware (no per-request task or body copy); routes and lookups add
fields through `note()`, which finds the current request's line through a context variable.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("temper.server.requests")


@dataclass
class _Line:
    fields: dict[str, str] = field(default_factory=dict)
    error: str | None = None


_current: contextvars.ContextVar[_Line | None] = contextvars.ContextVar(
    "temper_request_line", default=None
)


def note(**fields: str) -> None:
    """Add `name=value` fields to the current request's line (first value of a name wins)."""
    line = _current.get()
    if line is not None:
        for name, value in fields.items():
            line.fields.setdefault(name, value)


def note_error(category: str, detail: str) -> None:
    line = _current.get()
    if line is not None:
        line.error = f"{category}: {detail}"


class RequestLog:
    """ASGI middleware that writes the request log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        line = _Line()
        token = _current.set(line)
        status = 500  # unless a response starts: an exception escaped every handler
        started = time.perf_counter()

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as error:
            line.error = f"server: {type(error).__name__}: {error}"
            raise
        finally:
            _current.reset(token)
            milliseconds = (time.perf_counter() - started) * 1e3
            log.info("%s", _format(scope, status, milliseconds, line))


def _format(scope: Scope, status: int, milliseconds: float, line: _Line) -> str:
    route: Any = scope.get("route")
    path = getattr(route, "path", None) or scope["path"]
    parts = [scope["method"], path, str(status), f"{milliseconds:.1f}ms"]
    parts += [f"{name}={value}" for name, value in line.fields.items()]
    if line.error is not None and status >= 400:
        parts.append(f"error={line.error}")
    return " ".join(parts)


def configure_logging(level: str) -> None:
    """Send the `temper` loggers to stderr at `level` (`temper serve --log-level`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    temper_log = logging.getLogger("temper")
    temper_log.handlers[:] = [handler]
    temper_log.setLevel(level.upper())
    temper_log.propagate = False
