"""Session-less REST routes: training runs (one, or a page of all), checkpoints (of a run, or a
page of all; a checkpoint's TTL), weights info, capabilities.

These read the storage directory, so they answer for runs saved before a restart too.
"""

from __future__ import annotations

from fastapi import Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from tinker import types as tinker_types

from temper.server.http.errors import BadRequest
from temper.server.http.responses import json_response
from temper.server.http.security import CurrentUser
from temper.server.routes.common import Server, api_router
from temper.server.routes.validation import check_page
from temper.server.state.expiry import check_ttl
from temper.server.state.ids import checked


class WeightsInfoRequest(BaseModel):
    tinker_path: str


class CheckpointTtlRequest(BaseModel):
    ttl_seconds: int | None
    """Seconds from now until the checkpoint expires (3600 .. 10 years), or null: never."""


router = api_router()


@router.get("/training_runs")
async def training_runs(
    user: CurrentUser,
    server: Server,
    limit: int = 20,
    offset: int = 0,
    project_id: str | None = None,
) -> Response:
    check_page(limit=limit, offset=offset)
    if project_id is not None:
        raise BadRequest("project_id: this server has no projects; list without it")
    times = {run_id: model.last_request_time for run_id, model in server.models.items()}
    return json_response(
        server.catalog.training_runs(
            user=user, limit=limit, offset=offset, last_request_times=times
        )
    )


@router.get("/checkpoints")
async def all_checkpoints(
    user: CurrentUser, server: Server, limit: int = 100, offset: int = 0
) -> Response:
    check_page(limit=limit, offset=offset)
    return json_response(server.catalog.all_checkpoints(user=user, limit=limit, offset=offset))


@router.get("/training_runs/{training_run_id}")
async def training_run(training_run_id: str, user: CurrentUser, server: Server) -> Response:
    live = server.models.get(training_run_id)
    return json_response(
        server.catalog.training_run(
            training_run_id,
            user=user,
            last_request_time=live.last_request_time if live else None,
        )
    )


@router.get("/training_runs/{training_run_id}/checkpoints")
async def list_checkpoints(training_run_id: str, user: CurrentUser, server: Server) -> Response:
    return json_response(
        tinker_types.CheckpointsListResponse(
            checkpoints=server.catalog.checkpoints(training_run_id, user=user)
        )
    )


# Declared before the DELETE below, whose {checkpoint_id:path} also matches ".../ttl".
@router.put("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(
    training_run_id: str,
    checkpoint_id: str,
    body: CheckpointTtlRequest,
    user: CurrentUser,
    server: Server,
) -> Response:
    run_id = checked(training_run_id, field="training run id")
    ttl_seconds = check_ttl(body.ttl_seconds)
    path = server.catalog.parse(f"tinker://{run_id}/{checkpoint_id}", user=user, owner_only=True)
    expires_at = server.catalog.expiry.set_ttl(path, ttl_seconds)
    return JSONResponse({"expires_at": None if expires_at is None else expires_at.isoformat()})


@router.delete("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(
    training_run_id: str, checkpoint_id: str, user: CurrentUser, server: Server
) -> Response:
    run_id = checked(training_run_id, field="training run id")
    deleted = server.catalog.delete(f"tinker://{run_id}/{checkpoint_id}", user=user)
    server.forget_sampler(str(deleted))
    return Response(status_code=204)


@router.post("/weights_info")
async def weights_info(body: WeightsInfoRequest, user: CurrentUser, server: Server) -> Response:
    return json_response(server.catalog.weights_info(body.tinker_path, user=user))


@router.get("/get_server_capabilities")
async def capabilities(server: Server) -> Response:
    models = [
        tinker_types.SupportedModel(
            model_name=model.name,
            max_context_length=model.limits.max_seq_len,
            trainable=model.trainable,
            sampleable=model.sampleable,
        )
        for model in server.base_models
    ]
    return json_response(tinker_types.GetServerCapabilitiesResponse(supported_models=models))
