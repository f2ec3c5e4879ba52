"""The FastAPI app: client config, sessions, telemetry, errors, and the route modules.

Routes are thin: they validate, queue a backend call and answer with a future (see
scheduler.py). Every rejection is a 4xx with a JSON body `{"detail", "category"}`; the server
keeps serving after any bad request. Client config turns off the SDK features a local server
does not need (JWT exchange, parallel forward/backward chunks, server-side custom losses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from tinker import types as tinker_types

from temper.server.catalog import new_session_id
from temper.server.errors import (
    USER_ERRORS,
    BadRequest,
    RequestError,
    Unavailable,
    error_body,
)
from temper.server.request_log import RequestLog
from temper.server.responses import json_response
from temper.server.runs_routes import check_page, runs_router
from temper.server.sampling_routes import hot_routes, sampling_router
from temper.server.security import key_checker
from temper.server.server import Session, TemperServer
from temper.server.training_routes import training_router

log = logging.getLogger("temper.server")

CLIENT_CONFIG = tinker_types.ClientConfigResponse(
    pjwt_auth_enabled=False,
    # One chunk at a time: arrival order is then submission order for a model's requests.
    parallel_fwdbwd_chunks=False,
    proto_compress_fwdbwd=False,
    sample_use_retrieve_futures=False,
    custom_loss_server_side=False,
    sample_join_sampling_session=False,
    sample_max_concurrent_requests=256,
)


def create_app(server: TemperServer) -> FastAPI:
    app = FastAPI(
        title="Temper (Tinker-compatible)",
        dependencies=[Depends(key_checker(server.config.api_key))],
        lifespan=_sweeping(server),
    )
    app.state.server = server
    app.add_middleware(RequestLog)
    _add_error_handlers(app)
    app.include_router(_session_router(server))
    app.include_router(training_router(server))
    app.include_router(sampling_router(server))
    app.include_router(runs_router(server))
    # First in line: matched before any router, with the app's exception handlers around them.
    app.router.routes[:0] = hot_routes(server)
    return app


def _session_router(server: TemperServer):
    from fastapi import APIRouter

    router = APIRouter(prefix="/api/v1")

    @router.post("/client/config")
    async def client_config() -> Response:
        return json_response(CLIENT_CONFIG)

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> Response:
        return json_response(tinker_types.ClientDynamicConfigResponse(refresh_interval_sec=300))

    @router.post("/create_session")
    async def create_session(body: tinker_types.CreateSessionRequest) -> Response:
        session_id = new_session_id()
        metadata = body.user_metadata
        server.sessions[session_id] = Session(
            session_id=session_id,
            user_metadata=None if metadata is None else {k: str(v) for k, v in metadata.items()},
            display_name=body.display_name,
        )
        log.info("session %s (sdk %s)", session_id, body.sdk_version)
        return json_response(
            tinker_types.CreateSessionResponse(
                session_id=session_id,
                info_message=f"Temper serving {server.served_names()}",
            )
        )

    @router.post("/session_heartbeat")
    async def heartbeat(body: tinker_types.SessionHeartbeatRequest) -> Response:
        if body.session_id not in server.sessions:
            # 410 tells the SDK the session is over (e.g. the server restarted).
            return JSONResponse(error_body("session is gone"), status_code=410)
        return json_response(tinker_types.SessionHeartbeatResponse())

    @router.get("/sessions")
    async def list_sessions(
        limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> Response:
        # One user per server: "owned" and "accessible" list the same sessions.
        if access_scope not in ("owned", "accessible"):
            raise BadRequest(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")
        check_page(limit=limit, offset=offset)
        newest_first = list(reversed(server.sessions))
        return json_response(
            tinker_types.ListSessionsResponse(sessions=newest_first[offset : offset + limit])
        )

    @router.get("/sessions/{session_id}")
    async def get_session(session_id: str, access_scope: str = "owned") -> Response:
        session = server.session(session_id)
        return json_response(
            tinker_types.GetSessionResponse(
                training_run_ids=list(session.model_ids),
                sampler_ids=[
                    sampler_id
                    for sampler_id in session.sampling_session_ids
                    if sampler_id in server.sampling_sessions
                ],
                user_metadata=session.user_metadata,
                display_name=session.display_name,
            )
        )

    @router.post("/sessions/{session_id}/finish")
    async def finish(session_id: str) -> Response:
        server.finish_session(session_id)
        return Response(status_code=204)

    @router.post("/telemetry")
    async def telemetry() -> Response:
        return json_response(tinker_types.TelemetryResponse(status="accepted"))

    @router.get("/healthz")
    async def healthz() -> Response:
        return json_response(tinker_types.HealthResponse(status="ok"))

    return router


def _sweeping(server: TemperServer):
    """The app's lifespan: a task that runs `server.sweep()` (expired checkpoints, idle
    snapshots) every `checkpoint_sweep_seconds` while the app serves."""

    async def sweep_forever() -> None:
        while True:
            await asyncio.sleep(server.config.checkpoint_sweep_seconds)
            try:
                deleted = await asyncio.to_thread(server.sweep)
            except Exception:
                log.exception("checkpoint sweep failed")
                continue
            for path in deleted:
                log.info("checkpoint %s expired (ttl_seconds) and was deleted", path)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(sweep_forever())
        try:
            yield
        finally:
            task.cancel()

    return lifespan


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(_: Request, error: RequestError) -> JSONResponse:
        if isinstance(error, Unavailable):  # the server's state, not the request, is at fault
            return JSONResponse(
                error_body(error.message, category="server"),
                status_code=error.status_code,
                headers={"x-should-retry": "false"},
            )
        return JSONResponse(error_body(error.message), status_code=error.status_code)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        # Unknown paths and methods: still a JSON body with a category.
        return JSONResponse(error_body(str(error.detail)), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
            for problem in error.errors()
        )
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
