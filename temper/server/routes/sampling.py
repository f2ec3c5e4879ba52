"""Sampling routes (create_sampling_session, samplers/{id}, asample) and retrieve_future.

A sampling session is a handle on one backend sampling client. Sessions on a base model
share one client, as do sessions on the same sampler checkpoint (released when idle and
loaded again on the next sample, server.py); each
`save_weights_and_get_sampling_client` makes its own (see training_routes). Samples on one
client that arrive together are started together (coalescer.py), and the backend decodes
them as one batch. `asample` and `retrieve_future` are plain routes (plain_routes.py). With
`record_stability_info`, each finished sequence is recorded under its `sample_sequence_ids`
entry for stable_reinforce (stability.py) before its result can be retrieved.
"""

from __future__ import annotations

import asyncio

import numpy as np
from fastapi import APIRouter, Response
from starlette.routing import Route
from tinker import types as tinker_types
from tinker.types.try_again_response import TryAgainResponse

from temper.api.backend import SamplingBackend
from temper.api.types import SampleResponse
from temper.server.dispatch.coalescer import SampleCoalescer
from temper.server.http import request_log
from temper.server.http.errors import BadRequest
from temper.server.http.json_bodies import JsonBodyRoute
from temper.server.http.plain_routes import plain_post
from temper.server.http.responses import future_response, json_response, protobuf_answer
from temper.server.http.security import CurrentUser
from temper.server.http.users import User
from temper.server.routes.validation import check_prompt_json, check_sample
from temper.server.state.catalog import new_sampling_session_id
from temper.server.state.model_memory import OverBudget
from temper.server.state.server import SamplingSession, TemperServer
from temper.server.state.stability import SequenceRecord, StabilityStore
from temper.server.wire import codec as wire


def sampling_router(server: TemperServer) -> APIRouter:
    router = APIRouter(prefix="/api/v1", route_class=JsonBodyRoute)

    @router.post("/create_sampling_session")
    async def create_sampling_session(
        body: tinker_types.CreateSamplingSessionRequest, user: CurrentUser
    ) -> Response:
        session = server.session(body.session_id, user=user)
        server.check_room(user, kind="sampling sessions")
        if body.model_path is not None:
            path = server.catalog.parse(body.model_path, kind="sampler_weights", user=user)
            run = server.catalog.run(path.run_id, user=user)
            base = server.base_model(run["base_model"])
            model_path = str(path)
        elif body.base_model is not None:
            base, model_path = server.base_model(body.base_model), None
        else:
            raise BadRequest("create_sampling_session needs model_path or base_model")
        sampling = SamplingSession(
            sampling_session_id=new_sampling_session_id(),
            client=None,
            base_model=base.name,
            model_path=model_path,
            lineage=model_path or base.name,
            session_id=body.session_id,
            owner=session.user,
        )
        # Loads the sampler now (503 if it cannot fit), so a bad checkpoint fails here.
        await asyncio.to_thread(server.load_client, sampling)
        server.add_sampling_session(body.session_id, sampling)
        return json_response(
            tinker_types.CreateSamplingSessionResponse(
                sampling_session_id=sampling.sampling_session_id
            )
        )

    @router.get("/samplers/{sampling_session_id}")
    async def get_sampler(sampling_session_id: str, user: CurrentUser) -> Response:
        sampling = server.sampling_session(sampling_session_id, user=user)
        return json_response(
            tinker_types.GetSamplerResponse(
                sampler_id=sampling.sampling_session_id,
                base_model=sampling.base_model,
                model_path=sampling.model_path,
            )
        )

    return router


def hot_routes(server: TemperServer) -> list[Route]:
    """`asample` and `retrieve_future`: two per sample, so they run as plain routes."""
    coalescer = SampleCoalescer(
        server.config.sample_window_s,
        max_hold_s=server.config.sample_max_hold_s,
        capacity=server.config.sampler.max_batch,
    )

    async def asample(body: tinker_types.SampleRequest, user: User) -> Response:
        if body.sampling_session_id is None:
            raise BadRequest("asample needs a sampling_session_id (from create_sampling_session)")
        sampling = server.sampling_session(body.sampling_session_id, user=user)
        call = wire.decode_sample(body)
        check_sample(call, limits=server.base_model(sampling.base_model).limits)
        prompt_length = call.prompt.length

        def run():
            return client.sample(
                call.prompt,
                call.num_samples,
                call.params,
                include_prompt_logprobs=call.prompt_logprobs,
                topk_prompt_logprobs=call.topk_prompt_logprobs,
                topk_sample_logprobs=call.topk_sample_logprobs,
                target_prompt_logprobs=call.target_prompt_logprobs,
            )

        key = None if body.seq_id is None else (sampling.sampling_session_id, body.seq_id)
        if server.scheduler.known(key) is not None:
            request_id = server.scheduler.known(key)
            sequence_ids = [f"{request_id}-{index}" for index in range(call.num_samples)]
            return future_response(request_id, sample_sequence_ids=sequence_ids)
        server.check_queue_room(user)
        owned = {"owner": sampling.owner, "scope": sampling.session_id, "key": key}
        started = asyncio.get_running_loop().create_future()

        def start() -> None:
            try:
                started.set_result(run())
            except Exception as error:  # becomes the request's failed future
                started.set_exception(error)

        # Filled right after submit; `encode` runs in a later turn of the event loop.
        sequence_ids: list[str] = []

        def encode(result: SampleResponse):
            if call.record_stability_info:
                record_samples(server.stability, result, sampling, client, call, sequence_ids)
            return protobuf_answer(
                wire.encode_sample_response(result, call=call, prompt_length=prompt_length)
            )

        client = server.loaded_client(sampling)
        if client is None:  # released after --model-idle-seconds: load it again
            try:
                client = await asyncio.to_thread(server.load_client, sampling)
            except OverBudget as error:
                # The SDK's sampler retries a 503 without end: fail the request's future.
                started.set_exception(error)
                request_id = server.scheduler.submit(lambda: started, encode=encode, **owned)
                sequence_ids += [f"{request_id}-{index}" for index in range(call.num_samples)]
                return future_response(request_id, sample_sequence_ids=sequence_ids)
        coalescer.add(client, start, lineage=sampling.lineage, num_sequences=call.num_samples)
        request_id = server.scheduler.submit(lambda: started, encode=encode, **owned)
        sequence_ids += [f"{request_id}-{index}" for index in range(call.num_samples)]
        return future_response(request_id, sample_sequence_ids=sequence_ids)

    async def retrieve_future(body: tinker_types.FutureRetrieveRequest, user: User) -> Response:
        request_log.note(request=body.request_id)
        answer = await server.scheduler.retrieve(
            body.request_id, user=user, timeout=server.config.poll_seconds
        )
        if answer is None:
            return json_response(TryAgainResponse(request_id=body.request_id, queue_state="active"))
        return Response(answer.content, media_type=answer.media_type)

    users = server.users
    return [
        plain_post(
            "/api/v1/asample",
            tinker_types.SampleRequest,
            asample,
            users=users,
            precheck=check_prompt_json,
        ),
        plain_post(
            "/api/v1/retrieve_future",
            tinker_types.FutureRetrieveRequest,
            retrieve_future,
            users=users,
        ),
    ]


def record_samples(
    store: StabilityStore,
    result: SampleResponse,
    sampling: SamplingSession,
    client: SamplingBackend,
    call: wire.SampleCall,
    sequence_ids: list[str],
) -> None:
    """Record each sequence of a finished sample for stable_reinforce (stability.py)."""
    prompt_P = np.asarray(call.prompt.to_ints(), dtype=np.int32)
    version = client.version
    for sequence_id, sequence in zip(sequence_ids, result.sequences, strict=True):
        store.record(
            sequence_id,
            SequenceRecord(
                session_id=sampling.session_id,
                prompt_P=prompt_P,
                tokens_S=np.asarray(sequence.tokens, dtype=np.int32),
                logprobs_S=np.asarray(sequence.logprobs, dtype=np.float32),
                weights=sampling.lineage,
                weights_version=version,
            ),
        )
