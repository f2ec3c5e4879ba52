"""Futures: retrieve_future (a plain route), retrieve_futures, cancel_future, and
join_sampling_session (the clone ids retrieve_futures polls by).

Every verb answers with a future (`{"request_id": ...}`); the SDK then long-polls here. An
answer not ready within `poll_seconds` is `try_again`, which the SDK polls again; a finished
one is the same bytes however often it is polled (dispatch/scheduler.py). With the client
config's `sample_use_retrieve_futures`, a SamplingClient instead long-polls `retrieve_futures`
for all of its samples at once and fetches each finished one with `retrieve_future`
(dispatch/feeds.py). `cancel_future` is what the SDK sends for a sample it abandoned (a
timeout, a Ctrl-C), when the dynamic config's `sample_cancel_enabled` is on.
"""

from __future__ import annotations

import pydantic
from fastapi import Response
from tinker import types as tinker_types
from tinker.types.try_again_response import TryAgainResponse

from temper.server.http import request_log
from temper.server.http.errors import NotFound
from temper.server.http.plain_routes import plain_post
from temper.server.http.responses import json_response
from temper.server.http.security import CurrentUser
from temper.server.http.users import User
from temper.server.routes.common import Server, api_router
from temper.server.state.server import TemperServer


class CancelFutureRequest(pydantic.BaseModel):
    """The SDK's cancel_future body (it has no type of its own in the SDK)."""

    model_config = pydantic.ConfigDict(extra="forbid")
    request_id: str


router = api_router()


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


async def retrieve_futures(
    body: tinker_types.FuturesRetrieveRequest, user: User, server: TemperServer
) -> Response:
    """A plain route: a sampling client polls it for every sample (with retrieve_future)."""
    target = (body.target.sampling_session_id, body.target.cloned_sampler_id)
    feeds = server.scheduler.feeds
    owner = feeds.owner_of(target)
    if owner is None:  # a first poll: the sampling session must exist
        sampling = server.sampling_session(body.target.sampling_session_id, user=user)
        owner = feeds.open(target, owner=sampling.owner, scope=sampling.session_id)
    if not user.owns(owner):
        raise NotFound(f"unknown sampling session {body.target.sampling_session_id!r}")
    for request_id in body.retrieved_request_ids:
        server.scheduler.forget(request_id, user=user)
    poll_seconds = server.config.poll_seconds
    timeout = poll_seconds if body.timeout is None else min(max(body.timeout, 0.0), poll_seconds)
    completions, cursor = await feeds.poll(target, after=body.prev_cursor, timeout=timeout)
    return json_response(
        tinker_types.FuturesRetrieveResponse(completions=completions, cursor=cursor)
    )


retrieve_futures_route = plain_post(
    "/api/v1/retrieve_futures", tinker_types.FuturesRetrieveRequest, retrieve_futures
)


@router.post("/cancel_future")
async def cancel_future(body: CancelFutureRequest, user: CurrentUser, server: Server) -> Response:
    request_log.note(request=body.request_id)
    server.scheduler.cancel(body.request_id, user=user)
    return Response(status_code=204)


@router.post("/join_sampling_session")
async def join_sampling_session(
    body: tinker_types.JoinSamplingSessionRequest, user: CurrentUser, server: Server
) -> Response:
    sampling = server.sampling_session(body.sampling_session_id, user=user)
    clone_id = server.scheduler.feeds.join(sampling.sampling_session_id)
    return json_response(tinker_types.JoinSamplingSessionResponse(client_counter=clone_id))
