"""The FastAPI app on a `TemperServer`: middleware, error handlers, the route modules.

Routes are thin (routes/): they validate, queue a backend call and answer with a future
(dispatch/scheduler.py). Every rejection is a 4xx with a JSON body `{"detail", "category"}`;
the server keeps serving after any bad request. The two requests an RL step repeats per
sample (`asample`, `retrieve_future`) and `healthz` are plain Starlette routes, matched first
(http/plain_routes.py).
"""

from __future__ import annotations

import logging

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Route
from tinker import types as tinker_types

from temper.server.http.background import lifespan
from temper.server.http.body_limits import BodyLimits
from temper.server.http.errors import (
    USER_ERRORS,
    RequestError,
    TooManyRequests,
    Unavailable,
    error_body,
)
from temper.server.http.plain_routes import list_problems
from temper.server.http.request_log import RequestLog
from temper.server.http.responses import json_response
from temper.server.http.security import current_user
from temper.server.routes import (
    checkpoints,
    external_weights,
    futures,
    refused,
    runs,
    sampling,
    session_search,
    sessions,
    training,
)
from temper.server.state.server import TemperServer

log = logging.getLogger("temper.server")


def create_app(server: TemperServer) -> FastAPI:
    app = FastAPI(
        title="Temper (Tinker-compatible)",
        dependencies=[Depends(current_user)],
        # FastAPI's schema pages are routes of their own that skip the app's key check; the
        # protocol is Tinker's (docs/server.md), so they are off rather than open.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.server = server
    app.add_middleware(BodyLimits, data_routes_bytes=int(server.config.max_body_mb * 2**20))
    app.add_middleware(RequestLog)
    _add_error_handlers(app)
    # In this order: a route whose path also matches a later one's wins (session_search's
    # /sessions/search before sessions' /sessions/{id}; checkpoints' .../publish before
    # runs' DELETE .../checkpoints/{checkpoint_id:path}).
    for routes in (
        session_search,
        sessions,
        training,
        external_weights,
        sampling,
        futures,
        checkpoints,
        runs,
        refused,
    ):
        app.include_router(routes.router)
    # First in line: matched before any router, with the app's exception handlers around them.
    # The download route checks its URL's signature instead of a key (external_weights.py).
    app.router.routes[:0] = [
        sampling.asample_route,
        futures.retrieve_future_route,
        futures.retrieve_futures_route,
        external_weights.download_route,
        Route("/api/v1/healthz", healthz, methods=["GET"]),
    ]
    return app


async def healthz(request: Request) -> Response:
    """Answers without a key (a plain route: the app-wide key check does not run), so a load
    balancer can probe it; it says that the server is up and, on several ranks, each rank's
    role, pid and whether it is alive."""
    rank_health = request.app.state.server.rank_health
    if rank_health is None:
        return json_response(tinker_types.HealthResponse(status="ok"))
    return JSONResponse({"status": "ok", "ranks": rank_health()})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError) -> JSONResponse:
        if isinstance(error, TooManyRequests) and not error.retry:
            return JSONResponse(
                error_body(error.message),
                status_code=error.status_code,
                headers={"x-should-retry": "false"},
            )
        if isinstance(error, Unavailable):  # the server's state, not the request, is at fault
            return JSONResponse(
                error_body(error.message, category="server"),
                status_code=error.status_code,
                headers={"x-should-retry": "false"},
            )
        return JSONResponse(error_body(error.message), status_code=error.status_code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        # Unknown paths and methods, bodies over their limit: a JSON body with a category.
        return JSONResponse(
            error_body(str(error.detail)), status_code=error.status_code, headers=error.headers
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = list_problems(error.errors())
        return JSONResponse(error_body(f"malformed request: {problems}"), status_code=400)

    async def user_error(_: Request, error: Exception) -> JSONResponse:
        # Bad input the backend found while the route ran (e.g. a checkpoint that does not
        # match the served model): the caller's fault, not a retryable server error.
        return JSONResponse(error_body(f"{type(error).__name__}: {error}"), status_code=400)

    for error_type in USER_ERRORS:
        app.add_exception_handler(error_type, user_error)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(
            error_body(f"{type(error).__name__}: {error}", category="server"), status_code=500
        )
