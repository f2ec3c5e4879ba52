"""External weights routes: save_weights_external, external_weights_urls, and the files
themselves (a plain GET route whose URLs carry their own signature: state/external_weights.py).

`tinker checkpoint download` runs on these: it loads a training checkpoint into a new model
(create_training_client_from_state), exports it here, asks for the URLs, renews the export's
TTL, fetches every file with a bare GET, and deletes the export.
"""

from __future__ import annotations

import datetime
import uuid

from fastapi import Request, Response
from starlette.responses import FileResponse
from starlette.routing import Route
from tinker import types as tinker_types

from temper.checkpoint.storage import CheckpointPath
from temper.server.dispatch.scheduler import Answer
from temper.server.http.errors import BadRequest, Forbidden, NotFound
from temper.server.http.responses import json_answer, json_response
from temper.server.http.security import CurrentUser
from temper.server.routes.common import Server, api_router
from temper.server.routes.training import queue
from temper.server.state.expiry import check_ttl
from temper.server.state.external_weights import (
    DOWNLOAD_PREFIX,
    export_sampler_weights,
    files_of,
)
from temper.server.state.ids import checked

router = api_router()


@router.post("/save_weights_external")
async def save_weights_external(
    body: tinker_types.SaveWeightsExternalRequest, user: CurrentUser, server: Server
) -> Response:
    served = server.model(body.model_id, user=user)
    if body.age_encryption_recipients is not None:
        raise BadRequest(
            "age_encryption_recipients: this server does not encrypt exports; the files are "
            "served over this server's own connection (use TLS in front of it)"
        )
    name = checked(body.path, field="checkpoint name")
    target = CheckpointPath(served.model_id, "external_weights", name)
    if server.catalog.exists(target):
        raise BadRequest(f"external weights {target} exist already; choose another name")
    ttl_seconds = check_ttl(body.ttl_seconds)
    storage = server.catalog.storage

    def export() -> CheckpointPath:
        # On the model's queue, after the requests before it: the weights as they are now.
        staging = f"{name}.export-{uuid.uuid4().hex[:8]}"
        training = server.training(served)
        saved = training.save_weights_for_sampler(staging).result()
        sampler_path = CheckpointPath.parse(saved.path)
        try:
            export_sampler_weights(storage.directory(sampler_path), storage.directory(target))
        finally:
            storage.delete(sampler_path)
        return target

    def exported(path: CheckpointPath) -> Answer:
        server.catalog.expiry.set_ttl(path, ttl_seconds)
        size = sum(f.stat().st_size for f in storage.directory(path).rglob("*") if f.is_file())
        return json_answer(
            tinker_types.SaveWeightsExternalResponseInternal(
                path=str(path), size_bytes=size, type="save_weights_external"
            )
        )

    return queue(server, served, export, user=user, encode=exported, seq_id=body.seq_id)


@router.get("/training_runs/{training_run_id}/checkpoints/{kind}/{name}/external_weights_urls")
async def external_weights_urls(
    training_run_id: str, kind: str, name: str, request: Request, user: CurrentUser, server: Server
) -> Response:
    path = server.catalog.parse(
        f"tinker://{training_run_id}/{kind}/{name}", user=user, kind="external_weights"
    )
    files = files_of(server.catalog.storage.directory(path))
    urls, expires = server.catalog.downloads.urls(path, files, base_url=str(request.base_url))
    return json_response(
        tinker_types.ExternalWeightsUrlsResponse(
            urls=urls, expires=datetime.datetime.fromtimestamp(expires, tz=datetime.UTC)
        )
    )


async def download_file(request: Request) -> Response:
    """One file of external weights, for a URL `external_weights_urls` signed (no key)."""
    server = request.app.state.server
    params = request.path_params
    try:
        path = CheckpointPath(
            checked(params["run_id"], field="run id"),
            "external_weights",
            checked(params["name"], field="checkpoint name"),
        )
    except BadRequest:
        raise NotFound("no such file") from None
    file = params["file"]
    signature = request.query_params.get("signature", "")
    expires = request.query_params.get("expires", "")
    if not server.catalog.downloads.check(path, file, expires=expires, signature=signature):
        raise Forbidden(
            "the download URL is invalid or expired; ask external_weights_urls for new ones"
        )
    directory = server.catalog.storage.directory(path)
    if file not in files_of(directory):  # also refuses '..' and absolute names
        raise NotFound(f"no file {file!r} in {path}")
    return FileResponse(directory / file, media_type="application/octet-stream")


download_route = Route(
    f"{DOWNLOAD_PREFIX}/{{run_id}}/{{name}}/{{file:path}}", download_file, methods=["GET"]
)
