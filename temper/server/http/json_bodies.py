"""Parsing JSON request bodies: every failure is a 400, and nesting is at most MAX_JSON_DEPTH.

`parse_json` is the one parser for what the server parses itself (the plain routes' big
bodies, BodyLimits' item count), and `JsonBodyRoute` makes FastAPI's routes parse with it
too. It is pydantic_core's `from_json` (jiter), the parser pydantic's `model_validate_json`
uses, so a body is held to one nesting limit whichever way it is read. Python's `json.loads`
recurses on the C stack and raises RecursionError (not a ValueError) at about 1,000 levels,
which a 100 KB body of `[` reaches; jiter stops at its fixed limit with a ValueError. Both
take about the same time on big bodies (measured on 2 cores: 1M prompt tokens, 7.5 MiB, in
32 ms vs json.loads' 45 ms; 300k short strings, 3.3 MiB, in 20 ms vs 16 ms).

What the parser accepts is what json.loads accepts, except lone UTF-16 surrogates (`"\\ud800"`)
and integers of more than 4,300 digits (json.loads refuses those too, with another error).
`NaN`, `Infinity` and numbers past float range (`1e400` is inf) parse; the request models
say whether a field takes them.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from temper.server.http.errors import BadRequest

MAX_JSON_DEPTH = 200
"""Deepest nesting of lists and objects a JSON body may have: jiter's fixed recursion limit
(pydantic_core has no setting for it; tests/server/test_json_bodies.py pins it)."""


def parse_json(raw: bytes | bytearray | memoryview) -> object:
    """The JSON value `raw` holds; BadRequest (400) naming the problem and where it is for
    anything that is not JSON or nests deeper than MAX_JSON_DEPTH."""
    try:
        return pydantic_core.from_json(raw)
    except ValueError as error:
        problem = str(error)
        if problem.startswith("recursion limit exceeded"):
            problem = f"nested more than {MAX_JSON_DEPTH} deep ({problem})"
        raise BadRequest(f"malformed request: the body is not JSON: {problem}") from None


class _JsonBodyRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json(await self.body())
            except BadRequest as error:
                # FastAPI passes an HTTPException from body reading through to the app's
                # handler; any other exception becomes its generic "error parsing the body".
                raise HTTPException(status_code=400, detail=error.message) from None
        return self._json


class JsonBodyRoute(APIRoute):
    """An APIRoute whose JSON body is parsed by `parse_json` (the module doc): the route class
    of every router of the app (`APIRouter(route_class=JsonBodyRoute)`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parsing_handler(request: Request) -> Response:
            return await handler(_JsonBodyRequest(request.scope, request.receive))

        return parsing_handler
