"""Sampling routes: create_sampling_session, samplers/{id}, and asample (a plain route).

A sampling session is a handle on one backend sampling client. Sessions on a base model
share one client, as do sessions on the same sampler checkpoint (released when idle and
loaded again on the next sample, state/server.py); each
`save_weights_and_get_sampling_client` makes its own (routes/training.py). Samples on one
client that arrive together are started together (dispatch/coalescer.py), and the backend
decodes them as one batch. `asample`, two requests per sample with `retrieve_future`
(futures.py), is a plain route (http/plain_routes.py). With `record_stability_info`, each
finished sequence is recorded under its `sample_sequence_ids` entry for stable_reinforce
(state/stability.py) before its result can be retrieved.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import numpy as np
from fastapi import Response
from tinker import types as tinker_types

from temper.api.backend import SamplingBackend
from temper.api.types import SampleResponse
from temper.server.dispatch.feeds import feed_target
from temper.server.dispatch.scheduler import Answer
from temper.server.http.errors import BadRequest
from temper.server.http.plain_routes import plain_post
from temper.server.http.responses import future_response, json_response, protobuf_answer
from temper.server.http.security import CurrentUser
from temper.server.http.users import User
from temper.server.routes.common import Server, api_router
from temper.server.routes.validation import check_prompt_json, check_sample
from temper.server.state.ids import new_sampling_session_id
from temper.server.state.model_memory import OverBudget
from temper.server.state.server import TemperServer
from temper.server.state.sessions import SamplingCreation, SamplingSession, Session
from temper.server.state.stability import SequenceRecord, StabilityStore
from temper.server.state.weight_versions import log_weight_versions
from temper.server.wire import codec

log = logging.getLogger("temper.server")
router = api_router()


@router.post("/create_sampling_session")
async def create_sampling_session(
    body: tinker_types.CreateSamplingSessionRequest, user: CurrentUser, server: Server
) -> Response:
    session = server.session(body.session_id, user=user)
    asked = (body.base_model, body.model_path)
    created = session.sampling_by_seq_id.get(body.sampling_session_seq_id)
    if created is None:
        created = SamplingCreation(
            request=asked, sampling_session_id=asyncio.get_running_loop().create_future()
        )
        # Registered before the sampler loads, so a retry arriving meanwhile waits for it.
        session.sampling_by_seq_id[body.sampling_session_seq_id] = created
        answer = created.sampling_session_id
        try:
            answer.set_result(await _new_sampling_session(body, session, user, server))
        except BaseException as error:  # a retry may try again; one waiting fails alike
            del session.sampling_by_seq_id[body.sampling_session_seq_id]
            if isinstance(error, Exception):
                answer.set_exception(error)
                answer.exception()  # marked retrieved: no retry may be waiting
            else:
                answer.cancel()
            raise
    elif created.request != asked:
        raise BadRequest(
            f"create_sampling_session: sampling_session_seq_id {body.sampling_session_seq_id} "
            f"of session {body.session_id} was used for base_model={created.request[0]!r}, "
            f"model_path={created.request[1]!r}; each sampling session needs its own seq id"
        )
    sampling_session_id = await asyncio.shield(created.sampling_session_id)
    return json_response(
        tinker_types.CreateSamplingSessionResponse(sampling_session_id=sampling_session_id)
    )


async def _new_sampling_session(
    body: tinker_types.CreateSamplingSessionRequest,
    session: Session,
    user: User,
    server: TemperServer,
) -> str:
    """A new sampling session on the base model or sampler checkpoint `body` names, its
    sampler loaded (503 if it cannot fit, so a bad checkpoint fails here)."""
    server.check_room(user, kind="sampling sessions")
    if body.model_path is not None:
        path = server.catalog.parse(body.model_path, kind="sampler_weights", user=user)
        run = server.catalog.run_of(path, user=user)
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
    await asyncio.to_thread(server.load_client, sampling)
    server.add_sampling_session(body.session_id, sampling)
    return sampling.sampling_session_id


@router.get("/samplers/{sampling_session_id}")
async def get_sampler(sampling_session_id: str, user: CurrentUser, server: Server) -> Response:
    sampling = server.sampling_session(sampling_session_id, user=user)
    return json_response(
        tinker_types.GetSamplerResponse(
            sampler_id=sampling.sampling_session_id,
            base_model=sampling.base_model,
            model_path=sampling.model_path,
        )
    )


async def asample(body: tinker_types.SampleRequest, user: User, server: TemperServer) -> Response:
    if body.sampling_session_id is None:
        raise BadRequest("asample needs a sampling_session_id (from create_sampling_session)")
    sampling = server.sampling_session(body.sampling_session_id, user=user)
    call = codec.decode_sample(body)
    limits = server.base_model(sampling.base_model).limits
    check_sample(call, limits=limits)
    key = None if body.seq_id is None else (sampling.sampling_session_id, body.seq_id)
    request_id = server.scheduler.known(key)
    if request_id is not None:
        return future_response(request_id, sample_sequence_ids=_sequence_ids(request_id, call))
    server.check_queue_room(user)
    started = asyncio.get_running_loop().create_future()
    # Filled right after submit; `encode` runs in a later turn of the event loop.
    sequence_ids: list[str] = []
    client = server.loaded_client(sampling)
    if client is None:  # released after --model-idle-seconds: load it again
        try:
            client = await asyncio.to_thread(server.load_client, sampling)
        except OverBudget as error:
            # The SDK's sampler retries a 503 without end: fail the request's future.
            started.set_exception(error)
    if client is not None:
        start = _starter(client, call, started)
        server.coalescer.add(
            client, start, lineage=sampling.lineage, num_sequences=call.num_samples
        )
    request_id = server.scheduler.submit(
        lambda: started,
        encode=_encoder(
            server.stability, sampling, client, call, sequence_ids, context=limits.max_sample_len
        ),
        owner=sampling.owner,
        scope=sampling.session_id,
        key=key,
        feed=None
        if body.seq_id is None
        else feed_target(sampling.sampling_session_id, body.seq_id),
    )
    sequence_ids += _sequence_ids(request_id, call)
    return future_response(request_id, sample_sequence_ids=sequence_ids)


asample_route = plain_post(
    "/api/v1/asample", tinker_types.SampleRequest, asample, precheck=check_prompt_json
)


def _sequence_ids(request_id: str, call: codec.SampleCall) -> list[str]:
    return [f"{request_id}-{index}" for index in range(call.num_samples)]


def _starter(
    client: SamplingBackend, call: codec.SampleCall, started: asyncio.Future
) -> Callable[[], None]:
    """What the coalescer calls to start the sample: the backend verb, its future (or error)
    handed to `started`, which the request's future waits on."""

    def start() -> None:
        if started.done():  # cancelled (cancel_future) while held: never started
            return
        try:
            started.set_result(
                client.sample(
                    call.prompt,
                    call.num_samples,
                    call.params,
                    include_prompt_logprobs=call.prompt_logprobs,
                    topk_prompt_logprobs=call.topk_prompt_logprobs,
                    topk_sample_logprobs=call.topk_sample_logprobs,
                    target_prompt_logprobs=call.target_prompt_logprobs,
                )
            )
        except Exception as error:  # becomes the request's failed future
            started.set_exception(error)

    return start


def _encoder(
    store: StabilityStore,
    sampling: SamplingSession,
    client: SamplingBackend | None,
    call: codec.SampleCall,
    sequence_ids: list[str],
    *,
    context: int,
) -> Callable[[SampleResponse], Answer]:
    """The wire answer of a finished sample, its sequences recorded first if asked."""
    prompt_length = call.prompt.length

    def encode(result: SampleResponse) -> Answer:
        log_context_cuts(
            result, call=call, sampling=sampling, sequence_ids=sequence_ids, context=context
        )
        if call.record_stability_info:
            assert client is not None, "a sample that ran had a client"
            record_samples(store, result, sampling, client, call, sequence_ids)
        log_weight_versions(
            result, sampling_session_id=sampling.sampling_session_id, sequence_ids=sequence_ids
        )
        return protobuf_answer(
            codec.encode_sample_response(result, call=call, prompt_length=prompt_length)
        )

    return encode


def log_context_cuts(
    result: SampleResponse,
    *,
    call: codec.SampleCall,
    sampling: SamplingSession,
    sequence_ids: list[str],
    context: int,
) -> None:
    """Log the sequences that stopped at the sampler's context before `max_tokens`. The SDK
    knows two stop reasons, 'stop' and 'length', and rejects any other, so on the wire such a
    sequence says 'length' like one that reached `max_tokens`; this line tells them apart."""
    max_tokens = call.params.max_tokens
    cut = [
        sequence_id
        for sequence_id, sequence in zip(sequence_ids, result.sequences, strict=False)
        if sequence.stop_reason == "length"
        and (max_tokens is None or len(sequence.tokens) < max_tokens)
    ]
    if cut:
        log.info(
            "sample %s: %d of %d sequences stopped at the sampler's context of %d tokens "
            "(prompt %d) on %s before max_tokens=%s; reported as stop_reason 'length' "
            "(--sampler.max-seq-len raises the context up to the model's own)",
            cut[0].rpartition("-")[0],
            len(cut),
            len(result.sequences),
            context,
            call.prompt.length,
            sampling.base_model,
            max_tokens,
        )


def record_samples(
    store: StabilityStore,
    result: SampleResponse,
    sampling: SamplingSession,
    client: SamplingBackend,
    call: codec.SampleCall,
    sequence_ids: list[str],
) -> None:
    """Record each sequence of a finished sample for stable_reinforce (state/stability.py)."""
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
                routes=sequence.routed_experts,
            ),
        )
