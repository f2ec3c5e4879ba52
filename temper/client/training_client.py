"""TrainingClient: the training verbs of one model, run in order on one worker thread.

The same verbs and return types as the `tinker` SDK, run in this process: every call returns
an `APIFuture` (`.result()`, or `await`), `*_async` variants return the future from a
coroutine, and the requests of one training model run in submission order on one worker
thread. Sampling clients made from a training client run on a second worker, so sampling
overlaps training calls (an asynchronous RL loop samples the next batch meanwhile).

Weight sync: `save_weights_and_get_sampling_client()` serves the current policy version, and a
sampling client is a snapshot of that version for as long as it lives. The client's
`WeightSync` (weight_sync.py) owns the versions, the lock and the snapshots: every change of
the weights runs inside its `changing()`, which gives live clients the old weights first
(copy-on-write), and a new sampling client gets its `snapshot()`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from torch import nn

from temper.api.backend import AdapterSlots
from temper.api.futures import APIFuture, Worker
from temper.api.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    OptimStepResponse,
    RoutingReplay,
    SaveWeightsResponse,
)
from temper.checkpoint.dcp import load_train_state, save_train_state
from temper.checkpoint.storage import CheckpointPath, CheckpointStorage, check_name
from temper.client.inflight import TrainerInflight
from temper.client.sampler_weights import recorded_base_model, save_sampler_weights
from temper.client.sampling_client import SamplingClient
from temper.client.shared_base import SharedBase
from temper.client.weight_sync import AdapterFeed, GeneratorFeed, RemoteFeed, WeightSync
from temper.generator.multi_lora import AdapterSampler
from temper.generator.remote import RemoteGenerators
from temper.generator.seam import Generator
from temper.tokenizer import Tokenizer
from temper.trainer.engine import CustomLossFn, TrainerEngine


class Service(Protocol):
    """What a training client uses of the ServiceClient that made it (service_client.py)."""

    storage: CheckpointStorage

    def new_generator(self, *, model: nn.Module, tokenizer: Tokenizer) -> Generator: ...

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelData:
    model_name: str
    arch: str = "qwen3"
    tokenizer_id: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GetInfoResponse:
    model_id: str
    model_data: ModelData
    is_lora: bool
    lora_rank: int | None

    @property
    def model_name(self) -> str:
        return self.model_data.model_name


class TrainingClient:
    def __init__(
        self,
        *,
        service: Service,
        run_id: str,
        base_model: str,
        engine: TrainerEngine,
        tokenizer: Tokenizer,
        shared_base: SharedBase | None = None,
        adapter_sampler: AdapterSampler | None = None,
        remote: RemoteGenerators | None = None,
        sleep_generator: bool = False,
    ) -> None:
        """`adapter_sampler`: the multi-LoRA sampler this LoRA client's snapshots register
        their adapters on (shared with the other clients of its base); `remote`: generator
        ranks of a disaggregated placement its weights are streamed to; neither: merged
        weights in a generator of its own. `sleep_generator`: its generator releases the KV
        cache during forward_backward."""
        self.service = service
        # The frozen base weights this LoRA client shares with the service's other LoRA
        # clients (shared_base.py), held so they live as long as a client on them; None:
        # the trainer's model is the client's own.
        self.shared_base = shared_base
        self.model_id = run_id
        self.base_model = base_model
        self.engine = engine
        self.tokenizer = tokenizer
        self._worker = Worker(f"temper-{run_id}")
        # Sampling clients run here; the thread starts now, because a thread started by the
        # first sample() would take that request alone instead of batching it with the rest.
        self._sampler_worker = Worker(f"temper-{run_id}-sampler")
        self._sampler_worker.submit(lambda: None).result()
        self.adapter_sampler = adapter_sampler
        feed: GeneratorFeed | None = None
        if remote is not None:
            feed = RemoteFeed(trainer=engine, remote=remote, tokenizer=tokenizer)
        elif adapter_sampler is not None:
            feed = AdapterFeed(trainer=engine, multi_lora=adapter_sampler)
        self._remote = remote
        self._inflight: TrainerInflight | None = None
        """The in-flight sampling target (inflight.py), made by the first in-flight save."""
        self._weight_sync = WeightSync(
            trainer=engine,
            new_generator=service.new_generator,
            tokenizer=tokenizer,
            feed=feed,
            sleep_while_training=sleep_generator,
        )

    @property
    def num_sampler_snapshots(self) -> int:
        """Times live sampling clients were given the old weights before a change."""
        return self._weight_sync.num_snapshots

    # -- training ---------------------------------------------------------------------------

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]:
        """`routing_replay="sampler"` (MoE models, a Temper extension): every datum's tokens
        go through the experts its `routed_experts` names, as the sampler routed them."""
        return self._worker.submit(
            self._forward_backward,
            _datum_list(data),
            loss_fn,
            loss_fn_config,
            routing_replay=routing_replay,
        )

    def _forward_backward(self, *args: Any, **kwargs: Any) -> ForwardBackwardOutput:
        self._weight_sync.release_for_training()
        return self.engine.forward_backward(*args, **kwargs)

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._worker.submit(
            self.engine.forward,
            _datum_list(data),
            loss_fn,
            loss_fn_config,
            routing_replay=routing_replay,
        )

    def forward_backward_custom(
        self,
        data: Sequence[Datum],
        loss_fn: CustomLossFn,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]:
        if not callable(loss_fn):
            raise TypeError(
                "forward_backward_custom: loss_fn must be a function (data, logprobs) -> "
                f"(loss, metrics), got {type(loss_fn).__name__}"
            )
        return self._worker.submit(
            self.engine.forward_backward_custom,
            _datum_list(data),
            loss_fn,
            routing_replay=routing_replay,
        )

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self._worker.submit(self._optim_step, adam_params)

    # -- checkpoints --------------------------------------------------------------------------

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        """Weights and optimizer state under `tinker://<model_id>/weights/<name>`."""
        path = CheckpointPath(self.model_id, "weights", check_name(name, field="name"))
        return self._worker.submit(self._save_state, path, overwrite)

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        """Weights from a `save_state` checkpoint; the optimizer starts fresh."""
        return self._worker.submit(self._load_state, self._train_state(path), with_optimizer=False)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self._worker.submit(self._load_state, self._train_state(path), with_optimizer=True)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        """Sampler weights under `tinker://<model_id>/sampler_weights/<name>`."""
        path = CheckpointPath(self.model_id, "sampler_weights", check_name(name, field="name"))
        return self._worker.submit(self._save_sampler_weights, path)

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, *, kind: str = "snapshot"
    ) -> SamplingClient:
        """A sampling client on the current weights (no disk write unless `name` is given).
        `kind`: 'snapshot' (these weights for as long as the client lives) or 'inflight'
        (the training client's shared in-flight target, which later in-flight saves move on:
        inflight.py)."""
        if kind not in ("snapshot", "inflight"):
            raise ValueError(f"kind must be 'snapshot' or 'inflight', got {kind!r}")
        if name is not None:
            self.save_weights_for_sampler(name).result()
        if kind == "inflight":
            return self._worker.submit(self._new_inflight_client).result()
        return self._worker.submit(self._new_sampling_client).result()

    def create_sampling_client(self, model_path: str) -> SamplingClient:
        return self.service.create_sampling_client(model_path=model_path)

    # -- info -----------------------------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        lora = self.engine.lora
        return GetInfoResponse(
            model_id=self.model_id,
            model_data=ModelData(model_name=self.base_model, tokenizer_id=self.base_model),
            is_lora=lora is not None,
            lora_rank=None if lora is None else lora.rank,
        )

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def adapter_slots(self) -> AdapterSlots | None:
        """How full `adapter_sampler` is now (`TrainingBackend`'s hook, for a server's room
        for snapshots); None without one (snapshots sample merged weights of their own)."""
        sampler = self.adapter_sampler
        if sampler is None:
            return None
        return AdapterSlots(held=sampler.num_adapters, limit=sampler.config.max_adapters)

    # -- async variants (Tinker: a coroutine that returns the future) -----------------------

    async def forward_backward_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.forward_backward(*args, **kwargs)

    async def forward_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.forward(*args, **kwargs)

    async def forward_backward_custom_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.forward_backward_custom(*args, **kwargs)

    async def optim_step_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.optim_step(*args, **kwargs)

    async def save_state_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.save_state(*args, **kwargs)

    async def load_state_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.load_state(*args, **kwargs)

    async def load_state_with_optimizer_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.load_state_with_optimizer(*args, **kwargs)

    async def save_weights_for_sampler_async(self, *args: Any, **kwargs: Any) -> APIFuture:
        return self.save_weights_for_sampler(*args, **kwargs)

    async def save_weights_and_get_sampling_client_async(
        self, name: str | None = None
    ) -> SamplingClient:
        return self.save_weights_and_get_sampling_client(name)

    def _train_state(self, path: str) -> CheckpointPath:
        parsed, _ = self.service.storage.existing(path)
        if parsed.kind != "weights":
            raise ValueError(
                f"{path} is a {parsed.kind} checkpoint; load_state takes "
                f"tinker://<run>/weights/<name> (from save_state)"
            )
        return parsed

    # -- run on the worker ------------------------------------------------------------------

    def _save_state(self, path: CheckpointPath, overwrite: bool) -> SaveWeightsResponse:
        engine = self.engine
        save_train_state(
            self.service.storage.directory(path),
            model=engine.model,
            optimizer=engine.optimizer.torch_optimizer,
            metadata={"policy_version": engine.policy_version, "run_id": self.model_id},
            trainable_only=engine.lora is not None,
            overwrite=overwrite,
        )
        return SaveWeightsResponse(path=str(path))

    def _load_state(self, path: CheckpointPath, *, with_optimizer: bool) -> LoadWeightsResponse:
        run = self.service.storage.read_run(path.run_id)
        ours = None if self.engine.lora is None else dataclasses.asdict(self.engine.lora)
        differs = lora_difference(run["lora"], ours)
        if recorded_base_model(run["base_model"]) != self.base_model or differs is not None:
            raise ValueError(
                f"{path} was saved from base model {run['base_model']!r} with "
                f"{training_kind(run['lora'])}, but this client trains {self.base_model!r} with "
                f"{training_kind(ours)}" + (f" ({differs})" if differs else "")
            )
        engine = self.engine
        with self._weight_sync.changing():
            metadata = load_train_state(
                self.service.storage.directory(path),
                model=engine.model,
                optimizer=engine.optimizer.torch_optimizer if with_optimizer else None,
                trainable_only=engine.lora is not None,
            )
            # Only once the load succeeded: a failed one leaves gradients and moments as they were.
            engine.zero_grad()
            if not with_optimizer:
                engine.reset_optimizer()
            engine.policy_version = int(metadata["policy_version"])
        return LoadWeightsResponse(path=str(path))

    def _save_sampler_weights(self, path: CheckpointPath) -> SaveWeightsResponse:
        save_sampler_weights(
            self.service.storage.directory(path),
            model=self.engine.model,
            tokenizer=self.tokenizer,
            base_model=self.base_model,
            lora=self.engine.lora,
        )
        return SaveWeightsResponse(path=str(path))

    def _optim_step(self, params: AdamParams) -> OptimStepResponse:
        with self._weight_sync.changing():
            return self.engine.optim_step(params)

    def _new_inflight_client(self) -> SamplingClient:
        """An in-flight client, the target moved to the current weights first (on the worker,
        so no change slips in between)."""
        if self._remote is not None:
            raise ValueError(
                "kind='inflight' sampling clients are not served on the generator ranks of "
                "an in-process disaggregated placement (`temper serve`'s disaggregated "
                "placement serves them); use kind='snapshot'"
            )
        if self._inflight is None:
            self._inflight = TrainerInflight(
                trainer=self.engine,
                new_generator=self.service.new_generator,
                tokenizer=self.tokenizer,
                adapter_sampler=self.adapter_sampler,
            )
        return SamplingClient(
            snapshot=self._inflight.publish(),
            worker=self._sampler_worker,
            tokenizer=self.tokenizer,
        )

    def _new_sampling_client(self) -> SamplingClient:
        """A client on the current weights (on the worker, so no change slips in between)."""
        return SamplingClient(
            snapshot=self._weight_sync.snapshot(),
            worker=self._sampler_worker,
            tokenizer=self.tokenizer,
        )


def training_kind(lora: Mapping[str, object] | None) -> str:
    """How a run trains, from its run.json's `lora` entry, for error messages."""
    return "full fine-tuning" if lora is None else f"LoRA {lora}"


def lora_difference(
    saved: Mapping[str, object] | None, ours: Mapping[str, object] | None
) -> str | None:
    """How a checkpoint's LoRA settings differ from a client's in what its tensors hold: None
    if they agree (the seed of the adapters' initial values does not count: loading replaces
    them), '' if one is full fine-tuning, else the settings that differ."""
    if saved is None or ours is None:
        return None if saved is ours else ""
    keys = sorted(key for key in saved.keys() | ours.keys() if key != "seed")
    differs = [key for key in keys if saved.get(key) != ours.get(key)]
    return ", ".join(f"{k} {saved.get(k)!r} saved, {ours.get(k)!r} here" for k in differs) or None


def _datum_list(data: Iterable[Datum]) -> list[Datum]:
    """`data` as a list (each item is checked by the engine), refused here, before the call is
    queued, when a datum holds an image chunk (text-only models)."""
    if isinstance(data, Datum | str | Mapping) or not isinstance(data, Iterable):
        raise TypeError(f"data must be a list of Datum, got {type(data).__name__}")
    data = list(data)
    for index, datum in enumerate(data):
        if isinstance(datum, Datum):
            datum.model_input.check_text_only(where=f"datum {index}: model_input")
    return data
