"""retrieve_future: the result of any accepted request, by its request id (a plain route).

Every verb answers with a future (`{"request_id": ...}`); the SDK then long-polls here. An
answer not ready within `poll_seconds` is `try_again`, which the SDK polls again; a finished
one is the same bytes however often it is polled (dispatch/scheduler.py).
"""

from __future__ import annotations

from starlette.responses import Response
from tinker import types as tinker_types
from tinker.types.try_again_response import TryAgainResponse

from temper.server.http import request_log
from temper.server.http.plain_routes import plain_post
from temper.server.http.responses import json_response
from temper.server.http.users import User
from temper.server.state.server import TemperServer


async def retrieve_future(
    body: tinker_types.FutureRetrieveRequest, user: User, server: TemperServer
) -> Response:
    request_log.note(request=body.request_id)
    answer = await server.scheduler.retrieve(
        body.request_id, user=user, timeout=server.config.poll_seconds
    )
    if answer is None:
        return json_response(TryAgainResponse(request_id=body.request_id, queue_state="active"))
    return Response(answer.content, media_type=answer.media_type)


retrieve_future_route = plain_post(
    "/api/v1/retrieve_future", tinker_types.FutureRetrieveRequest, retrieve_future
)
