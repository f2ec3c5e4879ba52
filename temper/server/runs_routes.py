"""Session-less REST routes: training runs, their checkpoints, weights info, capabilities.

These read the storage directory, so they answer for runs saved before a restart too.
"""

from __future__ import annotations

from fastapi import APIRouter, Response
from pydantic import BaseModel
from tinker import types as tinker_types

from temper.server.responses import json_response
from temper.server.server import TemperServer
from temper.server.storage import checked


class WeightsInfoRequest(BaseModel):
    tinker_path: str


def runs_router(server: TemperServer) -> APIRouter:
    router = APIRouter(prefix="/api/v1")
    catalog = server.catalog

    @router.get("/training_runs/{training_run_id}")
    async def training_run(training_run_id: str) -> Response:
        live = server.models.get(training_run_id)
        return json_response(
            catalog.training_run(
                training_run_id, last_request_time=live.last_request_time if live else None
            )
        )

    @router.get("/training_runs/{training_run_id}/checkpoints")
    async def list_checkpoints(training_run_id: str) -> Response:
        return json_response(
            tinker_types.CheckpointsListResponse(checkpoints=catalog.checkpoints(training_run_id))
        )

    @router.delete("/training_runs/{training_run_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(training_run_id: str, checkpoint_id: str) -> Response:
        run_id = checked(training_run_id, field="training run id")
        deleted = catalog.delete(f"tinker://{run_id}/{checkpoint_id}")
        server.forget_sampler(str(deleted))
        return Response(status_code=204)

    @router.post("/weights_info")
    async def weights_info(body: WeightsInfoRequest) -> Response:
        return json_response(catalog.weights_info(body.tinker_path))

    @router.get("/get_server_capabilities")
    async def capabilities() -> Response:
        model = tinker_types.SupportedModel(
            model_name=server.model_name,
            max_context_length=server.limits.max_seq_len,
            trainable=True,
            sampleable=True,
        )
        return json_response(tinker_types.GetServerCapabilitiesResponse(supported_models=[model]))

    return router
