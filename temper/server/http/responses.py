"""Building HTTP responses and future answers from the tinker SDK's pydantic models.

JSON bodies leave out None fields, as the SDK's own serializer does; `type` literals keep
their defaults so the SDK's strict validation accepts them.
"""

from __future__ import annotations

import pydantic
from fastapi import Response
from tinker import types as tinker_types

from temper.server.dispatch.scheduler import JSON, PROTOBUF, Answer
from temper.server.http import request_log


def json_response(model: pydantic.BaseModel, *, status_code: int = 200) -> Response:
    return Response(
        model.model_dump_json(exclude_none=True), status_code=status_code, media_type=JSON
    )


def json_answer(model: pydantic.BaseModel) -> Answer:
    return Answer(model.model_dump_json(exclude_none=True).encode(), JSON)


def protobuf_answer(content: bytes) -> Answer:
    return Answer(content, PROTOBUF)


def future_response(
    request_id: str, *, model_id: str | None = None, sample_sequence_ids: list[str] | None = None
) -> Response:
    request_log.note(request=request_id)
    return json_response(
        tinker_types.UntypedAPIFuture(
            request_id=request_id, model_id=model_id, sample_sequence_ids=sample_sequence_ids
        )
    )
