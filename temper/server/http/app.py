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
import signal
from collections.abc import AsyncIterator

from fastapi import Depends, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.routing import Route
from tinker import types as tinker_types

from temper.server.http.body_limits import BodyLimits
from temper.server.http.errors import (
    USER_ERRORS,
    BadRequest,
    Forbidden,
    Gone,
    NotFound,
    RequestError,
    TooManyRequests,
    Unavailable,
    error_body,
)
from temper.server.http.json_bodies import JsonBodyRoute
from temper.server.http.plain_routes import list_problems
from temper.server.http.request_log import RequestLog
from temper.server.http.responses import json_response
from temper.server.http.security import CurrentUser, current_user
from temper.server.routes.runs import check_page, runs_router
from temper.server.routes.sampling import hot_routes, sampling_router
from temper.server.routes.training import training_router
from temper.server.routes.validation import check_tags, check_user_metadata
from temper.server.state.catalog import new_session_id
from temper.server.state.lifetimes import release_memory
from temper.server.state.server import Session, TemperServer

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
        dependencies=[Depends(current_user)],
        lifespan=_background(server),
    )
    app.state.server = server
    app.add_middleware(
        BodyLimits, data_routes_bytes=int(getattr(server.config, "max_body_mb", 256) * 2**20)
    )
    app.add_middleware(RequestLog)
    _add_error_handlers(app)
    app.include_router(_session_router(server))
    app.include_router(training_router(server))
    app.include_router(sampling_router(server))
    app.include_router(runs_router(server))
    # First in line: matched before any router, with the app's exception handlers around them.
    app.router.routes[:0] = [
        *hot_routes(server),
        Route("/api/v1/healthz", healthz, methods=["GET"]),
    ]
    return app


async def healthz(_: Request) -> Response:
    """Answers without a key (a plain route: the app-wide key check does not run), so a load
    balancer can probe it; it says nothing but that the server is up."""
    return json_response(tinker_types.HealthResponse(status="ok"))


def _session_router(server: TemperServer):
    from fastapi import APIRouter

    router = APIRouter(prefix="/api/v1", route_class=JsonBodyRoute)

    @router.post("/client/config")
    async def client_config() -> Response:
        return json_response(CLIENT_CONFIG)

    @router.post("/client/dynamic_config")
    async def dynamic_config() -> Response:
        return json_response(tinker_types.ClientDynamicConfigResponse(refresh_interval_sec=300))

    @router.post("/create_session")
    async def create_session(
        body: tinker_types.CreateSessionRequest, user: CurrentUser
    ) -> Response:
        check_tags(body.tags, route="create_session")
        check_user_metadata(body.user_metadata, route="create_session")
        server.check_room(user, kind="sessions")
        session_id = new_session_id()
        metadata = body.user_metadata
        server.sessions[session_id] = Session(
            session_id=session_id,
            user=user.name,
            user_metadata=None if metadata is None else {k: str(v) for k, v in metadata.items()},
            display_name=body.display_name,
        )
        log.info("session %s of %s (sdk %s)", session_id, user.name, body.sdk_version)
        return json_response(
            tinker_types.CreateSessionResponse(
                session_id=session_id,
                info_message=f"Temper serving {server.served_names()}",
            )
        )

    @router.post("/session_heartbeat")
    async def heartbeat(body: tinker_types.SessionHeartbeatRequest, user: CurrentUser) -> Response:
        session = server.sessions.get(body.session_id)
        if session is None or not user.owns(session.user):
            # 410 tells the SDK the session is over (it ended, or the server restarted).
            return JSONResponse(error_body("session is gone"), status_code=410)
        server.session(body.session_id, user=user)  # counts as a sign of life
        return json_response(tinker_types.SessionHeartbeatResponse())

    @router.get("/sessions")
    async def list_sessions(
        user: CurrentUser, limit: int = 20, offset: int = 0, access_scope: str = "owned"
    ) -> Response:
        # One's own sessions; an admin's "accessible" lists everyone's.
        if access_scope not in ("owned", "accessible"):
            raise BadRequest(f"access_scope must be 'owned' or 'accessible', got {access_scope!r}")
        check_page(limit=limit, offset=offset)
        newest_first = [
            session_id
            for session_id, session in reversed(server.sessions.items())
            if session.user == user.name or (user.admin and access_scope == "accessible")
        ]
        return json_response(
            tinker_types.ListSessionsResponse(sessions=newest_first[offset : offset + limit])
        )

    @router.get("/sessions/{session_id}")
    async def get_session(
        user: CurrentUser, session_id: str, access_scope: str = "owned"
    ) -> Response:
        session = server.session(session_id, user=user, alive=False)
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
    async def finish(session_id: str, user: CurrentUser) -> Response:
        session = server.sessions.get(session_id)
        if session is None or not user.owns(session.user):
            with contextlib.suppress(Gone):  # finished (or expired) already: nothing to do
                server.ended.check(session_id, kind="session", user=user)
                raise NotFound(f"unknown session {session_id!r}")
            return Response(status_code=204)
        server.end_session(session_id, why="was finished by its client")
        await asyncio.to_thread(release_memory)
        return Response(status_code=204)

    @router.post("/admin/reload_keys")
    async def reload_keys(user: CurrentUser) -> Response:
        if not user.admin:
            raise Forbidden('reload_keys is for admin users ("admin": true in the key file)')
        if server.users.key_file is None:
            raise BadRequest("this server has no --key-file to reload")
        try:
            count = server.users.reload()
        except ValueError as error:
            raise BadRequest(f"{error}; the previous users stay in place") from None
        log.info("reloaded %s: %d users", server.users.key_file, count)
        return JSONResponse({"users": count})

    @router.post("/telemetry")
    async def telemetry() -> Response:
        return json_response(tinker_types.TelemetryResponse(status="accepted"))

    return router


def _background(server: TemperServer):
    """The app's lifespan: tasks that run `server.sweep()` (expired checkpoints, idle
    snapshots) every `checkpoint_sweep_seconds` and expire silent sessions, and the SIGHUP
    handler that reloads the key file, while the app serves."""

    async def expire_forever() -> None:
        period = min(5.0, server.config.session_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            expired = server.expire_sessions()
            for session_id in expired:
                log.info("session %s expired (no heartbeat)", session_id)
            if expired:
                await asyncio.to_thread(release_memory)

    def reload_keys() -> None:
        try:
            log.info("SIGHUP: reloaded %s: %d users", server.users.key_file, server.users.reload())
        except ValueError as error:
            log.error("SIGHUP: %s; the previous users stay in place", error)

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
        tasks = [asyncio.create_task(sweep_forever()), asyncio.create_task(expire_forever())]
        loop = asyncio.get_running_loop()
        watching_sighup = False
        if server.users.key_file is not None:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
                loop.add_signal_handler(signal.SIGHUP, reload_keys)  # main thread only
                watching_sighup = True
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if watching_sighup:
                loop.remove_signal_handler(signal.SIGHUP)

    return lifespan


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
