"""Training routes: create_model, get_info, forward_backward, optim_step, save/load weights.

Each route validates, queues one backend call on the model's queue and answers with a future.
The model id is `<session>:train:<model_seq_id>` (the SDK derives the same id itself when it
creates a model from a checkpoint) and doubles as the run id on disk.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from tinker import types as tinker_types

from temper.checkpoint.storage import CheckpointPath
from temper.server import adapter_room, wire
from temper.server.catalog import checked, model_id, new_sampling_session_id
from temper.server.data_bodies import read_forward_backward
from temper.server.errors import BadRequest
from temper.server.expiry import check_ttl
from temper.server.json_bodies import JsonBodyRoute
from temper.server.responses import future_response, json_answer, json_response, protobuf_answer
from temper.server.scheduler import Answer
from temper.server.security import CurrentUser
from temper.server.server import SamplingSession, ServedModel, TemperServer
from temper.server.users import User
from temper.server.validation import (
    check_lora,
    check_lora_rank_fits,
    check_training_data,
    check_user_metadata,
    resolve_provenance,
)


def training_router(server: TemperServer) -> APIRouter:
    router = APIRouter(prefix="/api/v1", route_class=JsonBodyRoute)
    scheduler = server.scheduler

    def queue(served: ServedModel, call, *, user: User, encode, seq_id: int | None) -> str:
        key = None if seq_id is None else (served.model_id, seq_id)
        if scheduler.known(key) is None:
            server.check_queue_room(user)
        return scheduler.submit(
            call,
            encode=encode,
            owner=served.owner,
            scope=served.session_id,
            queue=served.model_id,
            key=key,
        )

    @router.post("/create_model")
    async def create_model(body: tinker_types.CreateModelRequest, user: CurrentUser) -> Response:
        session = server.session(body.session_id, user=user)
        base = server.base_models.trainable(body.base_model)
        if body.optimizer_config.type != "adamw":
            raise BadRequest(
                f"optimizer {body.optimizer_config.type!r} is not supported; use adamw"
            )
        new_id = model_id(body.session_id, body.model_seq_id)
        lora = body.lora_config or tinker_types.LoraConfig(rank=32)
        full = server.config.fine_tuning == "full"
        if not full:
            check_lora(lora)
        check_user_metadata(body.user_metadata, route="create_model")
        metadata = {key: str(value) for key, value in (body.user_metadata or {}).items()}

        def create() -> tinker_types.CreateModelResponse:
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
            served.training = training
            return tinker_types.CreateModelResponse(model_id=new_id)

        key = ("create", new_id)
        if scheduler.known(key) is not None:
            return future_response(scheduler.known(key), model_id=new_id)
        if new_id in server.models:
            raise BadRequest(f"model id {new_id!r} exists already (model_seq_id reused)")
        server.check_room(user, kind="models")
        server.check_queue_room(user)
        served = ServedModel(
            model_id=new_id,
            session_id=body.session_id,
            owner=session.user,
            base=base,
            is_lora=not full,
            lora_rank=None if full else lora.rank,
        )
        _check_rank_fits(server, served, field="create_model: lora_config.rank")
        return _queue_creation(server, served, create, key=key)

    @router.post("/get_info")
    async def get_info(body: tinker_types.GetInfoRequest, user: CurrentUser) -> Response:
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
    async def forward_backward(request: Request, user: CurrentUser) -> Response:
        call = await read_forward_backward(request)
        served = server.model(call.model_id, user=user)
        check_training_data(
            call.data,
            loss_fn=call.loss_fn,
            loss_fn_config=call.loss_fn_config,
            limits=served.base.limits,
        )
        data = resolve_provenance(call, store=server.stability, session_id=served.session_id)

        def run():
            training = server.training(served)
            verb = training.forward if call.forward_only else training.forward_backward
            return verb(data, call.loss_fn, call.loss_fn_config)

        request_id = queue(served, run, user=user, encode=_encode_fwdbwd, seq_id=call.seq_id)
        return future_response(request_id, model_id=served.model_id)

    @router.post("/optim_step")
    async def optim_step(body: tinker_types.OptimStepRequest, user: CurrentUser) -> Response:
        served = server.model(body.model_id, user=user)
        params = wire.adam_params(body.optim_params)
        request_id = queue(
            served,
            lambda: server.training(served).optim_step(params),
            user=user,
            encode=lambda result: json_answer(
                tinker_types.OptimStepResponse(metrics=result.metrics)
            ),
            seq_id=body.seq_id,
        )
        return future_response(request_id, model_id=served.model_id)

    @router.post("/save_weights")
    async def save_weights(body: tinker_types.SaveWeightsRequest, user: CurrentUser) -> Response:
        served = server.model(body.model_id, user=user)
        name = checked(body.path or "", field="checkpoint name")
        target = CheckpointPath(served.model_id, "weights", name)
        if server.catalog.exists(target) and not body.overwrite:
            raise BadRequest(f"checkpoint {target} exists already; pass overwrite=True")
        ttl_seconds = check_ttl(body.ttl_seconds)

        def saved(result) -> Answer:
            server.catalog.expiry.set_ttl(target, ttl_seconds)
            return json_answer(tinker_types.SaveWeightsResponse(path=result.path))

        request_id = queue(
            served,
            lambda: server.training(served).save_state(name, overwrite=body.overwrite),
            user=user,
            encode=saved,
            seq_id=body.seq_id,
        )
        return future_response(request_id, model_id=served.model_id)

    @router.post("/load_weights")
    async def load_weights(body: tinker_types.LoadWeightsRequest, user: CurrentUser) -> Response:
        path = server.catalog.parse(body.path, kind="weights", user=user)
        run = server.catalog.run(path.run_id, user=user)
        server.base_model(run["base_model"])
        if body.session_id is not None:
            return _create_from_state(server, body, user=user, path_run=run)
        if body.model_id is None:
            raise BadRequest("load_weights needs model_id (load in place) or session_id")
        served = server.model(body.model_id, user=user)
        server.check_checkpoint_base(served, run)

        def load():
            training = server.training(served)
            verb = training.load_state_with_optimizer if body.optimizer else training.load_state
            return verb(body.path)

        request_id = queue(
            served,
            load,
            user=user,
            encode=lambda result: json_answer(
                tinker_types.LoadWeightsResponse(path=result.path, model_id=served.model_id)
            ),
            seq_id=body.seq_id,
        )
        return future_response(request_id, model_id=served.model_id)

    @router.post("/save_weights_for_sampler")
    async def save_weights_for_sampler(
        body: tinker_types.SaveWeightsForSamplerRequest, user: CurrentUser
    ) -> Response:
        served = server.model(body.model_id, user=user)
        # Snapshots follow the snapshot retention rules; a TTL applies to named checkpoints.
        ttl_seconds = check_ttl(body.ttl_seconds)
        if body.path is not None:
            name = checked(body.path, field="checkpoint name")
            target = CheckpointPath(served.model_id, "sampler_weights", name)
            if server.catalog.exists(target):
                raise BadRequest(f"sampler checkpoint {target} exists already; choose another name")

            def saved(result) -> Answer:
                server.catalog.expiry.set_ttl(target, ttl_seconds)
                return json_answer(
                    tinker_types.SaveWeightsForSamplerResponseInternal(path=result.path)
                )

            request_id = queue(
                served,
                lambda: server.training(served).save_weights_for_sampler(name),
                user=user,
                encode=saved,
                seq_id=body.seq_id,
            )
            return future_response(request_id, model_id=served.model_id)

        def snapshot(client) -> object:
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

        def make_snapshot():
            server.make_room_for_snapshot(served)
            return server.training(served).save_weights_and_get_sampling_client()

        server.check_room(user, kind="sampling sessions")
        adapter_room.check_room(server, served)
        request_id = queue(
            served,
            make_snapshot,
            user=user,
            encode=snapshot,
            seq_id=body.seq_id,
        )
        return future_response(request_id, model_id=served.model_id)

    return router


def _encode_fwdbwd(result):
    return protobuf_answer(wire.encode_forward_backward_output(result))


def _create_from_state(
    server: TemperServer, body: tinker_types.LoadWeightsRequest, *, user: User, path_run: dict
) -> Response:
    """Create-via-load: a new model whose first request loads the checkpoint."""
    session = server.session(body.session_id, user=user)
    if body.model_seq_id is None:
        raise BadRequest("load_weights with session_id needs model_seq_id")
    new_id = model_id(body.session_id, body.model_seq_id)
    key = ("create", new_id)
    if server.scheduler.known(key) is not None:
        return future_response(server.scheduler.known(key), model_id=new_id)
    if new_id in server.models:
        raise BadRequest(f"model id {new_id!r} exists already (model_seq_id reused)")
    server.check_room(user, kind="models")
    server.check_queue_room(user)
    lora = path_run.get("lora")
    served = ServedModel(
        model_id=new_id,
        session_id=body.session_id,
        owner=session.user,
        base=server.base_models.trainable(path_run["base_model"]),
        is_lora=lora is not None,
        lora_rank=None if lora is None else lora["rank"],
    )
    _check_rank_fits(server, served, field=f"load_weights: {body.path} has LoRA rank")

    def create() -> tinker_types.LoadWeightsResponse:
        backend = server.backend
        create_from = (
            backend.create_training_client_from_state_with_optimizer
            if body.optimizer
            else backend.create_training_client_from_state
        )
        served.training = create_from(body.path, run_id=new_id)
        return tinker_types.LoadWeightsResponse(path=body.path, model_id=new_id)

    return _queue_creation(server, served, create, key=key)


def _check_rank_fits(server: TemperServer, served: ServedModel, *, field: str) -> None:
    """400 for a LoRA model whose rank the model memory budget can never hold."""
    if served.lora_rank is None:
        return
    check_lora_rank_fits(
        served.base,
        served.lora_rank,
        budget_bytes=server.memory.budget_bytes,
        shared_base=adapter_room.shares_base(server.config, served),
        shared_sampler=adapter_room.shares_sampler(server.config, served),
        field=field,
    )


def _queue_creation(server: TemperServer, served: ServedModel, create, *, key) -> Response:
    """Register `served` (counting its memory) and queue `create` as its first request; the
    run records its owner once created, and a failed creation drops the model again."""
    server.add_model(served)

    def run():
        try:
            result = create()
        except Exception:
            server.drop_model(served.model_id)
            raise
        server.catalog.set_owner(served.model_id, served.owner)
        return result

    request_id = server.scheduler.submit(
        run,
        encode=json_answer,
        owner=served.owner,
        scope=served.session_id,
        queue=served.model_id,
        key=key,
    )
    return future_response(request_id, model_id=served.model_id)
