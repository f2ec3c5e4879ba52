"""Checkpoint sharing routes: publish, unpublish, copy_weights.

A published checkpoint is readable by every user of the server (state/publication.py); a copy
is a new run of the caller's holding one checkpoint (state/copies.py). Both read and write
the storage directory only, so they answer for runs saved before a restart too.

The publish routes are declared in a router the app includes before runs.py's, whose
`DELETE .../checkpoints/{checkpoint_id:path}` would otherwise take `DELETE .../publish`.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import Request, Response
from tinker import types as tinker_types

from temper.server.http.errors import BadRequest, Forbidden
from temper.server.http.responses import json_response
from temper.server.http.security import CurrentUser
from temper.server.http.users import User
from temper.server.routes.common import Server, api_router
from temper.server.state.catalog import owner_of
from temper.server.state.expiry import check_ttl
from temper.server.state.ids import checked, model_id
from temper.server.state.server import TemperServer

router = api_router()

_PUBLISH = "/training_runs/{training_run_id}/checkpoints/{kind}/{name}/publish"


@router.post(_PUBLISH)
async def publish(
    training_run_id: str, kind: str, name: str, user: CurrentUser, server: Server
) -> Response:
    _set_published(server, training_run_id, kind, name, user=user, published=True)
    return Response(status_code=204)


@router.delete(_PUBLISH)
async def unpublish(
    training_run_id: str, kind: str, name: str, user: CurrentUser, server: Server
) -> Response:
    _set_published(server, training_run_id, kind, name, user=user, published=False)
    return Response(status_code=204)


def _set_published(
    server: TemperServer, run_id: str, kind: str, name: str, *, user: User, published: bool
) -> None:
    """Only the run's exact owner may (un)publish (an admin sees the run but does not own it).
    Publishing what is published (or unpublishing what is not) is a 400: Tinker documents a
    409, which the SDK retries for 5 minutes before it raises."""
    path = server.catalog.parse(f"tinker://{run_id}/{kind}/{name}", user=user, owner_only=True)
    owner = owner_of(server.catalog.run(path.run_id, user=user))
    if owner != user.name:
        raise Forbidden(f"only the owner of run {path.run_id!r} ({owner!r}) may publish it")
    if not server.catalog.publication.set(path, published=published):
        state = "published" if published else "not published"
        raise BadRequest(f"checkpoint {path} is already {state}")


@router.post("/copy_weights")
async def copy_weights(
    body: tinker_types.CopyWeightsRequest, request: Request, user: CurrentUser, server: Server
) -> Response:
    if body.weights_access_token is not None:
        raise BadRequest(
            "weights_access_token: this server has no access tokens; a checkpoint another "
            "user published is readable (and copyable) by every user without one"
        )
    key = request.headers.get("x-idempotency-key")
    copies = server.catalog.copies
    known = copies.known(key, owner=user.name)
    if known is not None:
        return json_response(tinker_types.CopyWeightsResponse(tinker_path=str(known)))
    source = server.catalog.parse(body.source_path, user=user)
    source_run = server.catalog.run_of(source, user=user)
    ttl_seconds = check_ttl(body.ttl_seconds)
    run_id, extra = _copy_run(server, body, user=user)
    target = await asyncio.to_thread(
        copies.copy,
        source,
        run_id=run_id,
        source_run=source_run,
        owner=user.name,
        key=key,
        extra=extra,
    )
    server.catalog.expiry.set_ttl(target, ttl_seconds)
    return json_response(tinker_types.CopyWeightsResponse(tinker_path=str(target)))


def _copy_run(
    server: TemperServer, body: tinker_types.CopyWeightsRequest, *, user: User
) -> tuple[str, dict[str, str]]:
    """The copy's run id (the session's training-run slot, or a fresh id) and what its
    run.json records of the request."""
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise BadRequest("copy_weights with session_id needs model_seq_id")
        session = server.session(body.session_id, user=user)
        run_id = model_id(session.session_id, body.model_seq_id)
        if run_id in server.models or (server.catalog.storage.root / run_id).exists():
            raise BadRequest(f"model id {run_id!r} exists already (model_seq_id reused)")
        return run_id, {}
    if body.destination_project_id is None:
        raise BadRequest(
            "copy_weights needs destination_project_id, or session_id and model_seq_id"
        )
    project = checked(body.destination_project_id, field="destination_project_id")
    # No projects here: the copy is the caller's; the project is recorded for the record.
    return f"copy-{uuid.uuid4().hex[:16]}", {"project_id": project}
