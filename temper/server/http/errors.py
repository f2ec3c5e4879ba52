"""Errors a request can end in, and the category Tinker's SDK shows for each.

A rejected submission is an HTTP 4xx with a JSON body `{"detail": ..., "category": "user"}`
(the SDK raises the matching `tinker.APIStatusError`). A request that fails after it was
accepted answers its future with `{"error": ..., "category": ...}` (`tinker.RequestFailedError`).
Never 5xx for a user's mistake: the SDK retries those for minutes.
"""

from __future__ import annotations

from typing import Literal

from temper.server.http import request_log

Category = Literal["user", "server", "unknown"]

MAX_MESSAGE_CHARS = 1000
"""Longest error message an answer carries (`bounded`)."""

USER_ERRORS: tuple[type[Exception], ...] = (
    ValueError,
    TypeError,
    FileNotFoundError,
    FileExistsError,
)
"""Exceptions the engines raise for bad input: the caller's fault, reported as category 'user'."""


class RequestError(Exception):
    """A request the server rejects before doing any work."""

    status_code = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class BadRequest(RequestError):
    status_code = 400


class NotFound(RequestError):
    status_code = 404


class Unauthorized(RequestError):
    status_code = 401


class Forbidden(RequestError):
    status_code = 403


class Gone(RequestError):
    """An id that existed and has ended (its session finished or expired); 410 says why."""

    status_code = 410


class TooManyRequests(RequestError):
    """A per-user limit is reached (429 naming it). Answered with `x-should-retry: false`
    unless `retry` (the limit frees itself soon, e.g. queued requests finishing)."""

    status_code = 429

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


class Unavailable(RequestError):
    """The server cannot take this request now (503, e.g. no memory for the model it
    needs). Answered with `x-should-retry: false`, so the SDK raises it at once instead of
    retrying for minutes."""

    status_code = 503


def category_of(error: BaseException) -> Category:
    return "user" if isinstance(error, (*USER_ERRORS, RequestError)) else "server"


def error_body(message: str, *, category: Category = "user") -> dict[str, str]:
    message = bounded(message)
    request_log.note_error(category, message)
    return {"detail": message, "category": category}


def bounded(message: str) -> str:
    """`message` cut to MAX_MESSAGE_CHARS: an error never echoes more than about 1 KB of what
    a request sent (a million bad items would otherwise come back as a 50 MB answer)."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return f"{message[:MAX_MESSAGE_CHARS]}... ({len(message) - MAX_MESSAGE_CHARS} more characters)"
