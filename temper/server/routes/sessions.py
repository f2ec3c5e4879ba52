"""Session routes: client config, create_session, heartbeats, listing, finish; key reload and
telemetry.

A session is the SDK's handle on everything it creates (models, sampling sessions); it lives
while its client heartbeats (state/lifetimes.py) and belongs to the user whose key created it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import Response
from fastapi.responses import JSONResponse
from tinker import types as tinker_types

from temper.server.http.errors import BadRequest, Forbidden, Gone, NotFound, error_body
from temper.server.http.responses import json_response
from temper.server.http.security import CurrentUser
from temper.server.routes.common import Server, api_router
from temper.server.routes.validation import check_page, check_tags, check_user_metadata
from temper.server.state.ids import new_session_id
from temper.server.state.lifetimes import release_memory
from temper.server.state.sessions import Session

log = logging.getLogger("temper.server")

CLIENT_CONFIG = tinker_types.ClientConfigResponse(
    pjwt_auth_enabled=False,
    # One chunk at a time: arrival order is then submission order for a model's requests.
    parallel_fwdbwd_chunks=False,
    proto_compress_fwdbwd=False,
    sample_use_retrieve_futures=True,
    custom_loss_server_side=False,
    sample_join_sampling_session=True,
    sample_max_concurrent_requests=256,
)
"""Turns off the SDK features a local server does not need (JWT exchange, parallel
forward/backward chunks, server-side custom losses) and on those it serves (a sampling
client's one poller for all its samples, clone ids from join_sampling_session: futures.py)."""

DYNAMIC_CONFIG = tinker_types.ClientDynamicConfigResponse(
    refresh_interval_sec=300, sample_cancel_enabled=True
)
"""An abandoned sample (a timeout, a Ctrl-C) is cancelled on the server (cancel_future)."""

router = api_router()


@router.post("/client/config")
async def client_config() -> Response:
    return json_response(CLIENT_CONFIG)


@router.post("/client/dynamic_config")
async def dynamic_config() -> Response:
    return json_response(DYNAMIC_CONFIG)


@router.post("/create_session")
async def create_session(
    body: tinker_types.CreateSessionRequest, user: CurrentUser, server: Server
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
        project_id=body.project_id,
    )
    project = "" if body.project_id is None else f", project {body.project_id!r} (not scoped)"
    log.info("session %s of %s (sdk %s%s)", session_id, user.name, body.sdk_version, project)
    return json_response(
        tinker_types.CreateSessionResponse(
            session_id=session_id, info_message=f"Temper serving {server.served_names()}"
        )
    )


@router.post("/session_heartbeat")
async def heartbeat(
    body: tinker_types.SessionHeartbeatRequest, user: CurrentUser, server: Server
) -> Response:
    session = server.sessions.get(body.session_id)
    if session is None or not user.owns(session.user):
        # 410 tells the SDK the session is over (it ended, or the server restarted).
        return JSONResponse(error_body("session is gone"), status_code=410)
    server.session(body.session_id, user=user)  # counts as a sign of life
    return json_response(tinker_types.SessionHeartbeatResponse())


@router.get("/sessions")
async def list_sessions(
    user: CurrentUser,
    server: Server,
    limit: int = 20,
    offset: int = 0,
    access_scope: str = "owned",
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
    user: CurrentUser, server: Server, session_id: str, access_scope: str = "owned"
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
async def finish(session_id: str, user: CurrentUser, server: Server) -> Response:
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
async def reload_keys(user: CurrentUser, server: Server) -> Response:
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
