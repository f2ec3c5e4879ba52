"""Training routes: create_model, get_info, forward_backward, optim_step, save/load weights.

Each route validates, queues one backend call on the model's queue and answers with a future.
The model id is `<session>:train:<model_seq_id>` (the SDK derives the same id itself when it
creates a model from a checkpoint) and doubles as the run id on disk. A model is created from
scratch (create_model) or from a checkpoint (load_weights with a session id); both register it
the same way (`_register_model`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import Request, Response
from tinker import types as tinker_types

from temper.api.backend import SamplingBackend, TrainingBackend
from temper.checkpoint.storage import CheckpointPath
from temper.server.dispatch.scheduler import Answer
from temper.server.http.errors import BadRequest
from temper.server.http.responses import (
    future_response,
    json_answer,
    json_response,
    protobuf_answer,
)
from temper.server.http.security import CurrentUser
from temper.server.http.users import User
from temper.server.routes.common import Server, api_router
from temper.server.routes.validation import (
    check_lora,
    check_lora_rank_fits,
    check_optimizer_config,
    check_training_data,
    check_user_metadata,
    resolve_provenance,
)
from temper.server.state.base_models import BaseModel
from temper.server.state.expiry import check_ttl
from temper.server.state.ids import checked, model_id, new_sampling_session_id
from temper.server.state.replay_routes import REPLAYED_METRIC, with_sampler_routes
from temper.server.state.server import TemperServer
from temper.server.state.sessions import SamplingSession, ServedModel, Session
from temper.server.wire import codec
from temper.server.wire.data_bodies import read_forward_backward


@dataclass(frozen=True)
class Created:
    training: TrainingBackend
    """The new model's backend client."""
    answer: pydantic.BaseModel
    """What the creating request's future answers."""


Create = Callable[[str], Created]
"""Creates a model's backend client under the model id it is given."""

router = api_router()


@router.post("/create_model")
async def create_model(
    body: tinker_types.CreateModelRequest, user: CurrentUser, server: Server
) -> Response:
    session = server.session(body.session_id, user=user)
    base = server.base_models.trainable(body.base_model)
    check_optimizer_config(body.optimizer_config, route="create_model")
    lora = body.lora_config or tinker_types.LoraConfig(rank=32)
    full = server.config.fine_tuning == "full"
    if not full:
        check_lora(lora)
    check_user_metadata(body.user_metadata, route="create_model")
    metadata = _metadata(body.user_metadata or {})

    def create(new_id: str) -> Created:
        backend = server.backend
        if full:
            training = backend.create_training_client(base.name, metadata, run_id=new_id)
        else:
            training = backend.create_lora_training_client(
                base.name,
                rank=lora.rank,
                seed=lora.seed,
                train_mlp=lora.train_mlp,
                train_attn=lora.train_attn,
                train_unembed=lora.train_unembed,
                user_metadata=metadata,
                run_id=new_id,
            )
        return Created(training, tinker_types.CreateModelResponse(model_id=new_id))

    return _register_model(
        server,
        session,
        user=user,
        model_seq_id=body.model_seq_id,
        base=base,
        lora_rank=None if full else lora.rank,
        rank_field="create_model: lora_config.rank",
        create=create,
    )


@router.post("/get_info")
async def get_info(
    body: tinker_types.GetInfoRequest, user: CurrentUser, server: Server
) -> Response:
    served = server.model(body.model_id, user=user)
    base = served.base
    return json_response(
        tinker_types.GetInfoResponse(
            model_id=served.model_id,
            model_data=tinker_types.ModelData(
                arch=base.arch, model_name=base.name, tokenizer_id=base.name
            ),
            is_lora=served.is_lora,
            lora_rank=served.lora_rank,
            model_name=base.name,
        )
    )


@router.post("/forward_backward")
async def forward_backward(request: Request, user: CurrentUser, server: Server) -> Response:
    call = await read_forward_backward(request)
    served = server.model(call.model_id, user=user)
    check_training_data(
        call.data,
        loss_fn=call.loss_fn,
        loss_fn_config=call.loss_fn_config,
        limits=served.base.limits,
    )
    data = resolve_provenance(call, store=server.stability, session_id=served.session_id)
    encode, replay = _encode_fwdbwd, "off"
    if server.config.routing_replay == "sampler":
        data = with_sampler_routes(
            data, call.provenance, store=server.stability, session_id=served.session_id
        )
        replay = "sampler" if all(d.routed_experts is not None for d in data) else "off"
        encode = functools.partial(_encode_replayed, replayed=replay == "sampler")

    def run():
        training = server.training(served)
        verb = training.forward if call.forward_only else training.forward_backward
        return verb(data, call.loss_fn, call.loss_fn_config, routing_replay=replay)

    return queue(server, served, run, user=user, encode=encode, seq_id=call.seq_id)


@router.post("/optim_step")
async def optim_step(
    body: tinker_types.OptimStepRequest, user: CurrentUser, server: Server
) -> Response:
    served = server.model(body.model_id, user=user)
    params = codec.adam_params(body.optim_params)
    return queue(
        server,
        served,
        lambda: server.training(served).optim_step(params),
        user=user,
        encode=lambda result: json_answer(tinker_types.OptimStepResponse(metrics=result.metrics)),
        seq_id=body.seq_id,
    )


@router.post("/save_weights")
async def save_weights(
    body: tinker_types.SaveWeightsRequest, user: CurrentUser, server: Server
) -> Response:
    served = server.model(body.model_id, user=user)
    name = checked(body.path or "", field="checkpoint name")
    target = CheckpointPath(served.model_id, "weights", name)
    if server.catalog.exists(target) and not body.overwrite:
        raise BadRequest(f"checkpoint {target} exists already; pass overwrite=True")
    ttl_seconds = check_ttl(body.ttl_seconds)
    check_user_metadata(body.user_metadata, route="save_weights")

    def saved(result) -> Answer:
        server.catalog.expiry.set_ttl(target, ttl_seconds)
        server.catalog.metadata.set(target, body.user_metadata)
        return json_answer(tinker_types.SaveWeightsResponse(path=result.path))

    return queue(
        server,
        served,
        lambda: server.training(served).save_state(name, overwrite=body.overwrite),
        user=user,
        encode=saved,
        seq_id=body.seq_id,
    )


@router.post("/load_weights")
async def load_weights(
    body: tinker_types.LoadWeightsRequest, user: CurrentUser, server: Server
) -> Response:
    path = server.catalog.parse(body.path, kind="weights", user=user)
    run = server.catalog.run_of(path, user=user)
    base = server.base_model(run["base_model"])
    check_optimizer_config(body.optimizer_config, route="load_weights")
    check_user_metadata(body.user_metadata, route="load_weights")
    if body.base_model is not None and server.base_model(body.base_model) is not base:
        raise BadRequest(
            f"load_weights: base_model {body.base_model!r} is not the base model {path} was "
            f"trained on ({base.name!r}); leave base_model out or name that one"
        )
    if body.session_id is not None:
        return _create_from_state(server, body, user=user, run=run)
    if body.model_id is None:
        raise BadRequest("load_weights needs model_id (load in place) or session_id")
    served = server.model(body.model_id, user=user)
    server.check_checkpoint_base(served, run)

    def load():
        training = server.training(served)
        verb = training.load_state_with_optimizer if body.optimizer else training.load_state
        return verb(body.path)

    def loaded(result) -> Answer:
        if body.user_metadata is not None:
            server.catalog.set_user_metadata(served.model_id, _metadata(body.user_metadata))
        return json_answer(
            tinker_types.LoadWeightsResponse(path=result.path, model_id=served.model_id)
        )

    return queue(server, served, load, user=user, encode=loaded, seq_id=body.seq_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    body: tinker_types.SaveWeightsForSamplerRequest, user: CurrentUser, server: Server
) -> Response:
    served = server.model(body.model_id, user=user)
    # Snapshots follow the snapshot retention rules; a TTL and user_metadata apply to named
    # checkpoints (a snapshot is listed nowhere).
    ttl_seconds = check_ttl(body.ttl_seconds)
    check_user_metadata(body.user_metadata, route="save_weights_for_sampler")
    if body.path is None and body.kind == "inflight":
        return _queue_inflight(server, served, user=user, seq_id=body.seq_id)
    if body.path is None:
        return _queue_snapshot(server, served, user=user, seq_id=body.seq_id)
    if body.kind == "inflight":
        raise BadRequest(
            "kind='inflight' is for save_weights_and_get_sampling_client (no path); a named "
            "sampler checkpoint is always a snapshot"
        )
    name = checked(body.path, field="checkpoint name")
    target = CheckpointPath(served.model_id, "sampler_weights", name)
    if server.catalog.exists(target):
        raise BadRequest(f"sampler checkpoint {target} exists already; choose another name")

    def saved(result) -> Answer:
        server.catalog.expiry.set_ttl(target, ttl_seconds)
        server.catalog.metadata.set(target, body.user_metadata)
        return json_answer(tinker_types.SaveWeightsForSamplerResponseInternal(path=result.path))

    return queue(
        server,
        served,
        lambda: server.training(served).save_weights_for_sampler(name),
        user=user,
        encode=saved,
        seq_id=body.seq_id,
    )


def queue(
    server: TemperServer,
    served: ServedModel,
    call: Callable[[], Any],
    *,
    user: User,
    encode: Callable[[Any], Answer],
    seq_id: int | None,
) -> Response:
    """Queue `call` on the model's queue (once per `seq_id`: a retried submission gets the
    first one's future) and answer with its future."""
    key = None if seq_id is None else (served.model_id, seq_id)
    if server.scheduler.known(key) is None:
        server.check_queue_room(user)
    request_id = server.scheduler.submit(
        call,
        encode=encode,
        owner=served.owner,
        scope=served.session_id,
        queue=served.model_id,
        key=key,
    )
    return future_response(request_id, model_id=served.model_id)


def _metadata(user_metadata: dict[str, Any]) -> dict[str, str]:
    """user_metadata as a run stores it: values as text (TrainingRun.user_metadata is str)."""
    return {key: str(value) for key, value in user_metadata.items()}


def _encode_fwdbwd(result) -> Answer:
    return protobuf_answer(codec.encode_forward_backward_output(result))


def _encode_replayed(result, *, replayed: bool) -> Answer:
    """The output of a call on a server that replays routes, saying whether this one did."""
    metrics = {**result.metrics, REPLAYED_METRIC: float(replayed)}
    return _encode_fwdbwd(dataclasses.replace(result, metrics=metrics))


def _create_from_state(
    server: TemperServer, body: tinker_types.LoadWeightsRequest, *, user: User, run: dict
) -> Response:
    """Create-via-load: a new model whose first request loads the checkpoint."""
    session = server.session(body.session_id, user=user)
    if body.model_seq_id is None:
        raise BadRequest("load_weights with session_id needs model_seq_id")
    lora = run.get("lora")

    def create(new_id: str) -> Created:
        backend = server.backend
        create_from = (
            backend.create_training_client_from_state_with_optimizer
            if body.optimizer
            else backend.create_training_client_from_state
        )
        training = create_from(body.path, run_id=new_id)
        if body.user_metadata is not None:  # else the new run keeps the checkpoint run's
            server.catalog.set_user_metadata(new_id, _metadata(body.user_metadata))
        return Created(training, tinker_types.LoadWeightsResponse(path=body.path, model_id=new_id))

    return _register_model(
        server,
        session,
        user=user,
        model_seq_id=body.model_seq_id,
        base=server.base_models.trainable(run["base_model"]),
        lora_rank=None if lora is None else lora["rank"],
        rank_field=f"load_weights: {body.path} has LoRA rank",
        create=create,
    )


def _register_model(
    server: TemperServer,
    session: Session,
    *,
    user: User,
    model_seq_id: int,
    base: BaseModel,
    lora_rank: int | None,
    rank_field: str,
    create: Create,
) -> Response:
    """The one way a model comes to be, from scratch or from a checkpoint: refused if its id
    is taken or the user's limits are reached or its LoRA rank can never fit; else registered
    (counting its memory, 503 if it cannot fit) with `create` queued as its first request. A
    retried submission gets the first one's future."""
    new_id = model_id(session.session_id, model_seq_id)
    key = ("create", new_id)
    known = server.scheduler.known(key)
    if known is not None:
        return future_response(known, model_id=new_id)
    if new_id in server.models:
        raise BadRequest(f"model id {new_id!r} exists already (model_seq_id reused)")
    server.check_room(user, kind="models")
    server.check_queue_room(user)
    served = ServedModel(
        model_id=new_id,
        session_id=session.session_id,
        owner=session.user,
        base=base,
        is_lora=lora_rank is not None,
        lora_rank=lora_rank,
    )
    if lora_rank is not None:
        check_lora_rank_fits(
            base,
            lora_rank,
            budget_bytes=server.memory.budget_bytes,
            shared_base=server.adapter_room.shares_base(served),
            shared_sampler=server.adapter_room.shares_sampler(served),
            field=rank_field,
            sampler=not server.adapter_room.samplers_on_generator_ranks(),
        )
    server.add_model(served)
    request_id = server.scheduler.submit(
        _creation(server, served, create),
        encode=json_answer,
        owner=served.owner,
        scope=served.session_id,
        queue=served.model_id,
        key=key,
    )
    return future_response(request_id, model_id=new_id)


def _creation(
    server: TemperServer, served: ServedModel, create: Create
) -> Callable[[], pydantic.BaseModel]:
    """The model's first request: `create`, after which the run records its owner; a failed
    creation drops the model again."""

    def run() -> pydantic.BaseModel:
        try:
            created = create(served.model_id)
        except Exception:
            server.drop_model(served.model_id)
            raise
        served.training = created.training
        server.catalog.set_owner(served.model_id, served.owner)
        return created.answer

    return run


def _queue_snapshot(
    server: TemperServer, served: ServedModel, *, user: User, seq_id: int | None
) -> Response:
    """save_weights_and_get_sampling_client: a sampling session on the model's weights as
    they are now, within the snapshot rules (state/snapshots.py, state/adapter_room.py)."""
    server.check_room(user, kind="sampling sessions")
    server.check_snapshot_room(served)

    def make_snapshot() -> SamplingBackend:
        server.make_room_for_snapshot(served)
        return server.training(served).save_weights_and_get_sampling_client()

    def snapshot(client: SamplingBackend) -> Answer:
        sampling = SamplingSession(
            sampling_session_id=new_sampling_session_id(),
            client=client,
            base_model=served.base.name,
            model_path=None,
            lineage=served.model_id,
            session_id=served.session_id,
            owner=served.owner,
        )
        server.add_snapshot(served, sampling)
        return json_answer(
            tinker_types.SaveWeightsForSamplerResponseInternal(
                sampling_session_id=sampling.sampling_session_id
            )
        )

    return queue(server, served, make_snapshot, user=user, encode=snapshot, seq_id=seq_id)


def _queue_inflight(
    server: TemperServer, served: ServedModel, *, user: User, seq_id: int | None
) -> Response:
    """save_weights_and_get_sampling_client(kind='inflight'): a sampling session on the
    model's shared in-flight target, moved to its weights as they are now
    (temper/client/inflight.py); no snapshot retention applies (the target is one per model)."""
    server.check_room(user, kind="sampling sessions")
    server.admit_inflight(served)

    def inflight(client: SamplingBackend) -> Answer:
        sampling = SamplingSession(
            sampling_session_id=new_sampling_session_id(),
            client=client,
            base_model=served.base.name,
            model_path=None,
            lineage=f"{served.model_id}:inflight",
            session_id=served.session_id,
            owner=served.owner,
        )
        server.add_sampling_session(served.session_id, sampling)
        return json_answer(
            tinker_types.SaveWeightsForSamplerResponseInternal(
                sampling_session_id=sampling.sampling_session_id
            )
        )

    return queue(
        server,
        served,
        lambda: server.training(served).save_weights_and_get_sampling_client(kind="inflight"),
        user=user,
        encode=inflight,
        seq_id=seq_id,
    )
