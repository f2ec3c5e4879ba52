"""In-process Tinker-style clients: ServiceClient -> TrainingClient and SamplingClient.

The same verbs and return types as the `tinker` SDK, run in this process: every call returns
an `APIFuture` (`.result()`, or `await`), `*_async` variants return the future from a
coroutine, and the requests of one training model run in submission order on one worker
thread. Sampling clients made from a training client run on a second worker, so sampling
overlaps training calls (an asynchronous RL loop samples the next batch meanwhile).

Weight sync: `save_weights_and_get_sampling_client()` serves the current policy version, and a
sampling client is a snapshot of that version for as long as it lives. With full fine-tuning
the sampler reads the trainer's parameters directly (no copy); with LoRA the adapters are merged
into the sampler's own copy in memory (nothing is written to disk). Copy-on-write keeps older
clients valid: a lock keeps the trainer from changing weights while a sampler reads them, and
just before the weights change every client of the current weights that is still alive gets
them for itself: when the sampler reads the trainer's own tensors, one private copy made before
optim_step / load_state, shared by those clients; when it has its own copy (LoRA merge, a
sharded trainer's gathered weights), that copy, while the trainer's next sync builds a new one.
A loop that drops its sampling client before the next optimizer step never copies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from temper.api.futures import APIFuture, Worker
from temper.api.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    OptimStepResponse,
    SaveWeightsResponse,
)
from temper.checkpoint.dcp import load_train_state, save_train_state
from temper.checkpoint.storage import CheckpointPath, CheckpointStorage, check_name
from temper.client.sampler_weights import (
    SamplerWeights,
    load_sampler_weights,
    resolve_base_model,
    sampler_model,
    sampler_update,
    save_sampler_weights,
)
from temper.client.sampling_client import SamplingClient
from temper.distributed.ranks import Ranks
from temper.models.build import materialize
from temper.models.lora import LoraConfig
from temper.sampler.engine import SamplerEngine
from temper.trainer.engine import CustomLossFn, TrainerEngine

DEFAULT_STORAGE = Path("~/.cache/temper/checkpoints")


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


class ServiceClient:
    """Creates training and sampling clients on this machine.

    `base_model` is a HF model directory, or a named size with random weights and a built-in
    vocabulary: "tiny" (digits), "tiny:letters", "0.6B:words", ...
    """

    def __init__(
        self,
        *,
        storage_dir: str | Path = DEFAULT_STORAGE,
        device: str = "cpu",
        dtype: str = "float32",
        trainer: TrainerEngine.Config | None = None,
        sampler: SamplerEngine.Config | None = None,
    ) -> None:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r}, but this machine has no CUDA device (or torch was built "
                "without CUDA); use device='cpu'"
            )
        self.storage = CheckpointStorage(storage_dir)
        self.device = device
        self.dtype = dtype
        self.trainer_config = trainer or TrainerEngine.Config()
        self.sampler_config = sampler or SamplerEngine.Config()

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
    ) -> TrainingClient:
        """`run_id` names the run (and its `tinker://<run_id>/...` paths); default: random.
        With a sharded trainer every rank gets rank 0's id."""
        lora = lora_config(
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        return self._new_training_client(
            base_model, lora=lora, user_metadata=user_metadata, run_id=run_id
        )

    def create_training_client(
        self,
        base_model: str,
        user_metadata: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
    ) -> TrainingClient:
        """Full fine-tuning (every parameter trains); an addition to Tinker's API."""
        return self._new_training_client(
            base_model, lora=None, user_metadata=user_metadata, run_id=run_id
        )

    def create_training_client_from_state(
        self, path: str, *, run_id: str | None = None
    ) -> TrainingClient:
        """A new training client with the weights of a `save_state` checkpoint (fresh optimizer)."""
        return self._from_state(path, with_optimizer=False, run_id=run_id)

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, run_id: str | None = None
    ) -> TrainingClient:
        return self._from_state(path, with_optimizer=True, run_id=run_id)

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """Sample from sampler weights (`tinker://.../sampler_weights/...`) or a base model."""
        if (model_path is None) == (base_model is None):
            raise ValueError("create_sampling_client takes exactly one of model_path, base_model")
        if model_path is not None:
            weights = load_sampler_weights(
                self.storage, model_path, device=self.device, dtype=self.dtype
            )
        else:
            base = resolve_base_model(base_model, device=self.device, dtype=self.dtype).build()
            weights = SamplerWeights(model=base.model, tokenizer=base.tokenizer, name=base_model)
        engine = self.sampler_config.build(model=weights.model, tokenizer=weights.tokenizer)
        return SamplingClient(
            engine=engine, worker=Worker("temper-sampler"), tokenizer=weights.tokenizer, owner=None
        )

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return self.create_lora_training_client(*args, **kwargs)

    async def create_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return self.create_sampling_client(*args, **kwargs)

    def _new_training_client(
        self,
        base_model: str,
        *,
        lora: LoraConfig | None,
        user_metadata: Mapping[str, str] | None,
        run_id: str | None = None,
    ) -> TrainingClient:
        base = resolve_base_model(base_model, device=self.device, dtype=self.dtype).build()
        engine = self.trainer_config.build(model=base.model, lora=lora)
        run_id = check_name(run_id or f"run-{uuid.uuid4().hex[:12]}", field="run id")
        info = {
            "base_model": base_model,
            "lora": None if lora is None else dataclasses.asdict(lora),
            "user_metadata": dict(user_metadata or {}),
        }
        if engine.sharding is None:
            self._claim_run(run_id, info)
        else:
            # The ranks write one run's checkpoints together, so they need one run id: rank 0's
            # (it writes run.json; the others wait until it is there).
            def write_run() -> str:
                self._claim_run(run_id, info)
                return run_id

            run_id = Ranks.of_default_group().on_writer(write_run)
        return TrainingClient(
            service=self,
            run_id=run_id,
            base_model=base_model,
            engine=engine,
            tokenizer=base.tokenizer,
        )

    def _claim_run(self, run_id: str, info: dict[str, Any]) -> None:
        """Write the run's run.json; an existing run of another base model or LoRA config is
        refused, since its checkpoints would then be read as this client's."""
        try:
            existing = self.storage.read_run(run_id)
        except FileNotFoundError:
            existing = None
        if existing is not None and (existing["base_model"], existing["lora"]) != (
            info["base_model"],
            info["lora"],
        ):
            raise ValueError(
                f"run_id {run_id!r} exists already with base model {existing['base_model']!r} "
                f"and LoRA {existing['lora']}, but this client trains {info['base_model']!r} "
                f"with LoRA {info['lora']}; choose another run_id"
            )
        self.storage.write_run(run_id, info)

    def _from_state(
        self, path: str, *, with_optimizer: bool, run_id: str | None = None
    ) -> TrainingClient:
        parsed, _ = self.storage.existing(path)
        if parsed.kind != "weights":
            raise ValueError(
                f"{path} is a {parsed.kind} checkpoint; training state is under weights/"
            )
        run = self.storage.read_run(parsed.run_id)
        lora = None if run["lora"] is None else LoraConfig(**run["lora"])
        client = self._new_training_client(
            run["base_model"], lora=lora, user_metadata=run.get("user_metadata"), run_id=run_id
        )
        client._load_state(parsed, with_optimizer=with_optimizer)
        return client


class TrainingClient:
    def __init__(
        self,
        *,
        service: ServiceClient,
        run_id: str,
        base_model: str,
        engine: TrainerEngine,
        tokenizer: Any,
    ) -> None:
        self.service = service
        self.model_id = run_id
        self.base_model = base_model
        self.engine = engine
        self.tokenizer = tokenizer
        self._worker = Worker(f"temper-{run_id}")
        self._sampler: SamplerEngine | None = None
        # Sampling clients run here; the thread starts now, because a thread started by the
        # first sample() would take that request alone instead of batching it with the rest.
        self._sampler_worker = Worker(f"temper-{run_id}-sampler")
        self._sampler_worker.submit(lambda: None).result()
        # Held while the trainer changes weights and while a sampler reads shared weights.
        self._weights_lock = threading.Lock()
        self._weights_generation = 0  # bumped by every change of the weights
        self._synced_generation = -1  # the generation self._sampler holds
        self._sharing: weakref.WeakSet[SamplingClient] = weakref.WeakSet()
        self.num_sampler_snapshots = 0
        """Times live sampling clients were given the old weights before a change."""

    # -- training ---------------------------------------------------------------------------

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._worker.submit(
            self.engine.forward_backward, _datum_list(data), loss_fn, loss_fn_config
        )

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        return self._worker.submit(self.engine.forward, _datum_list(data), loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, data: Sequence[Datum], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        if not callable(loss_fn):
            raise TypeError(
                "forward_backward_custom: loss_fn must be a function (data, logprobs) -> "
                f"(loss, metrics), got {type(loss_fn).__name__}"
            )
        return self._worker.submit(self.engine.forward_backward_custom, _datum_list(data), loss_fn)

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

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """A sampling client on the current weights (no disk write unless `name` is given)."""
        if name is not None:
            self.save_weights_for_sampler(name).result()
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

    def get_tokenizer(self) -> Any:
        return self.tokenizer

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
        if run["base_model"] != self.base_model or run["lora"] != ours:
            raise ValueError(
                f"{path} was saved from base model {run['base_model']!r} with LoRA {run['lora']}, "
                f"but this client trains {self.base_model!r} with LoRA {ours}"
            )
        engine = self.engine
        with self._changing_weights():
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
        with self._changing_weights():
            return self.engine.optim_step(params)

    @contextlib.contextmanager
    def _changing_weights(self) -> Iterator[None]:
        """Around every change of the trainer's weights (on the worker)."""
        with self._weights_lock:
            if self._sampler is not None and self._sampler.model is self.engine.model:
                # The sampler reads these very tensors: live clients copy them first.
                self._detach_sharing(self._snapshot_engine)
            try:
                yield
            finally:
                self._weights_generation += 1

    def _new_sampling_client(self) -> SamplingClient:
        """A client on the current weights (on the worker, so no change slips in between)."""
        with self._weights_lock:
            engine, version = self.engine, self.engine.policy_version
            if self._sampler is None or self._synced_generation != self._weights_generation:
                if self._sampler is not None and self._sampler.model is not engine.model:
                    # The update below rewrites the sampler's own copy (LoRA merge, gathered
                    # shards, another dtype): live clients keep the old copy.
                    old_sampler = self._sampler
                    if self._detach_sharing(lambda: old_sampler):
                        self._sampler = None
                if self._sampler is None:
                    self._sampler = self.service.sampler_config.build(
                        model=sampler_model(engine.model, lora=engine.lora),
                        tokenizer=self.tokenizer,
                    )
                self._sampler.update_weights(
                    sampler_update(engine.model, lora=engine.lora), version=version
                )
                self._synced_generation = self._weights_generation
            client = SamplingClient(
                engine=self._sampler,
                worker=self._sampler_worker,
                tokenizer=self.tokenizer,
                owner=(self, version),
            )
            self._sharing.add(client)
            return client

    def _detach_sharing(self, make_engine: Callable[[], SamplerEngine]) -> bool:
        """Give the live clients that share the trainer's sampler an engine of their own
        (`make_engine()`, called only if there are any); returns whether there were."""
        live = list(self._sharing)
        self._sharing.clear()
        if not live:
            return False
        engine = make_engine()
        for client in live:
            client._detach(engine)
        self.num_sampler_snapshots += 1
        return True

    def _snapshot_engine(self) -> SamplerEngine:
        """A sampler on a private copy of the trainer's current (plain, unsharded) weights."""
        model = self.engine.model
        parameter = next(model.parameters())
        copy = materialize(
            model.config, device=parameter.device, dtype=parameter.dtype, init="empty"
        )
        engine = self.service.sampler_config.build(model=copy, tokenizer=self.tokenizer)
        engine.update_weights(model.state_dict(), version=self.engine.policy_version)
        return engine


def lora_config(
    *, rank: int, seed: int | None, train_mlp: bool, train_attn: bool, train_unembed: bool
) -> LoraConfig:
    """The LoRA config of Tinker's create_lora_training_client arguments (seed None: 0)."""
    return LoraConfig(
        rank=rank,
        seed=0 if seed is None else seed,
        train_mlp=train_mlp,
        train_attn=train_attn,
        train_unembed=train_unembed,
    )


def _datum_list(data: Iterable[Datum]) -> list[Datum]:
    """`data` as a list (each item is checked by the engine)."""
    if isinstance(data, Datum | str | Mapping) or not isinstance(data, Iterable):
        raise TypeError(f"data must be a list of Datum, got {type(data).__name__}")
    return list(data)
