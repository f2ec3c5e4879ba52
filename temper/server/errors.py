"""Errors a request can end in, and the category Tinker's SDK shows for each.

A rejected submission is an HTTP 4xx with a JSON body `{"detail": ..., "category": "user"}`
(the SDK raises the matching `tinker.APIStatusError`). A request that fails after it was
accepted answers its future with `{"error": ..., "category": ...}` (`tinker.RequestFailedError`).
Never 5xx for a user's mistake: the SDK retries those for minutes.
"""

from __future__ import annotations

from typing import Literal

from temper.server import request_log

Category = Literal["user", "server", "unknown"]

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


class Unavailable(RequestError):
    """The server cannot take this request now (503, e.g. no memory for the model it
    needs). Answered with `x-should-retry: false`, so the SDK raises it at once instead of
    retrying for minutes."""

    status_code = 503


def category_of(error: BaseException) -> Category:
    return "user" if isinstance(error, (*USER_ERRORS, RequestError)) else "server"


def error_body(message: str, *, category: Category = "user") -> dict[str, str]:
    request_log.note_error(category, message)
    return {"detail": message, "category": category}
