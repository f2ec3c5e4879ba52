"""POST /sessions/search: the SDK's `RestClient.search_sessions`, over the server's live sessions.

The server keeps sessions while they live (state/lifetimes.py), so every session it can find
is active: a search for other statuses (finished, failed, cancelled) matches nothing. There
are no projects: a search naming `project_ids` is a 400, as `list_training_runs` answers, and
each summary's `project_id` is `NO_PROJECT`. Pages run newest first; the cursor is the last
session of a page (its creation time and id), so sessions created meanwhile never shift a
later page.
"""

from __future__ import annotations

from fastapi import Response
from tinker import types as tinker_types

from temper.server.http.errors import BadRequest
from temper.server.http.responses import json_response
from temper.server.http.security import CurrentUser
from temper.server.http.users import User
from temper.server.routes.common import Server, api_router
from temper.server.state.server import TemperServer
from temper.server.state.sessions import Session

NO_PROJECT = "default"
"""The `project_id` of every session (the server has no projects)."""

router = api_router()


@router.post("/sessions/search")
async def search_sessions(
    body: tinker_types.SessionSearchRequest, user: CurrentUser, server: Server
) -> Response:
    if body.project_ids is not None:
        raise BadRequest("project_ids: this server has no projects; search without it")
    found = [
        session
        for session in server.sessions.values()
        if _visible(session, body.owner, user=user) and _matches(session, body)
    ]
    found.sort(key=lambda session: (session.created_at, session.session_id), reverse=True)
    if body.cursor is not None:
        last = (body.cursor.last_created_at, body.cursor.last_session_id)
        found = [s for s in found if (s.created_at, s.session_id) < last]
    page = found[: body.limit]
    next_cursor = None
    if len(found) > body.limit:
        next_cursor = tinker_types.SessionSearchCursor(
            last_created_at=page[-1].created_at, last_session_id=page[-1].session_id
        )
    return json_response(
        tinker_types.SessionSearchResponse(
            sessions=[_summary(server, session) for session in page], next_cursor=next_cursor
        )
    )


def _visible(session: Session, owner: tinker_types.SearchOwner, *, user: User) -> bool:
    """One's own sessions; 'accessible' and named users reach others' for an admin only."""
    if not user.owns(session.user):
        return False
    if isinstance(owner, tinker_types.UserSearchOwner):
        return session.user in owner.owner_urns
    if isinstance(owner, tinker_types.AccessibleSearchOwner):
        return True
    return session.user == user.name


def _matches(session: Session, body: tinker_types.SessionSearchRequest) -> bool:
    if body.statuses is not None and not any(
        isinstance(status, tinker_types.ActiveSessionStatusQuery) for status in body.statuses
    ):
        return False  # every session the server holds is active
    metadata = session.user_metadata or {}
    if any(metadata.get(key) != value for key, value in body.user_metadata.items()):
        return False
    if body.session_id is None and body.display_name is None:
        return True
    by_id = body.session_id is not None and session.session_id == body.session_id
    by_name = body.display_name is not None and all(
        word in (session.display_name or "").lower() for word in body.display_name.lower().split()
    )
    return by_id or by_name


def _summary(server: TemperServer, session: Session) -> tinker_types.SessionSummary:
    storage = server.catalog.storage
    num_checkpoints = sum(
        len(storage.list(run_id))
        for run_id in session.model_ids
        if (storage.root / run_id / "run.json").is_file()
    )
    return tinker_types.SessionSummary(
        session_id=session.session_id,
        created_at=session.created_at,
        owner=session.user,
        project_id=NO_PROJECT,
        status=tinker_types.SessionActive(),
        checkpoints_count=num_checkpoints,
        display_name=session.display_name,
        user_metadata=session.user_metadata,
    )
