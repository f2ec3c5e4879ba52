"""Disaggregated serving: the trainer ranks train, the generator ranks sample.

Rank 0's `DisaggregatedService` is the server's `ServiceBackend`. Training calls go to a
`ReplicatedService` over the trainer ranks only (replicated.py: every trainer rank runs them,
FSDP/TP over the trainer ranks). Sampling never runs on a trainer rank: every sampling
client is a `RemoteSampling` whose calls rank 0's `GeneratorPool` routes to the generator
ranks (server/generators/).

A snapshot (`save_weights_and_get_sampling_client`) is made by one more replayed call,
`sampler_payload`: every trainer rank gathers the weights a sampler needs (collective over the
trainer ranks) and rank 0 keeps them in host memory for as long as the snapshot lives: a LoRA
model's adapter tensors (a few MiB; the generator ranks register them on the multi-LoRA
sampler of the base) or, for full fine-tuning (or with multi-LoRA sampling off), the whole
merged weights in the generators' dtype. Rank 0 sends them to the least loaded generator
rank at once and again to any other rank that needs them later (the first one died, or is
busier than another). Base-model and sampler-checkpoint samplers travel by name; each
generator rank loads them itself. In-flight clients (`kind="inflight"`) sample a target the
generator ranks hold, which each in-flight save moves on (backends/inflight.py).
"""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from temper.api.futures import APIFuture
from temper.api.prompt_targets import PromptTargets
from temper.api.types import ModelInput, SampleResponse, SamplingParams
from temper.checkpoint.gather import sampler_stream
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient
from temper.models.lora import lora_state_dict, merged_config
from temper.server.backends.inflight import RemoteInflight, RemoteTarget
from temper.server.backends.replicated import (
    STOP,
    Call,
    Replica,
    ReplicatedService,
    ReplicatedTraining,
)
from temper.server.generators.messages import (
    Load,
    LoadAdapter,
    LoadBase,
    LoadCheckpoint,
    LoadWeights,
    Sample,
    Score,
)
from temper.server.generators.pool import GeneratorPool

SAMPLER_PAYLOAD = "sampler_payload"


class PayloadReplica(Replica):
    """A trainer rank's replica that also gathers a model's sampler weights (`sampler_payload`)."""

    def __init__(self, service: ServiceClient, *, ranks: Any, multi_lora: bool) -> None:
        super().__init__(service, ranks=ranks)
        self.multi_lora = multi_lora

    def _run(self, call: Call) -> Any:
        if call.verb == SAMPLER_PAYLOAD:
            return sampler_payload(
                self.clients[call.model_id],
                multi_lora=self.multi_lora,
                keep=self.ranks.is_writer,
                key=call.args[0],
            )
        return super()._run(call)


def follow_trainers(replica: PayloadReplica) -> None:
    """Trainer ranks > 0: run rank 0's calls, in its order, until it sends stop."""
    while True:
        call = replica.ranks.broadcast(None)
        if call.verb == STOP:
            break
        replica.step(call)
    replica.clients.clear()


@torch.no_grad()
def sampler_payload(
    client: TrainingClient, *, multi_lora: bool, keep: bool, key: str
) -> Load | None:
    """What a generator needs to sample `client`'s current weights (collective over the
    trainer ranks: each gathers whole tensors; only the rank that `keep`s holds them)."""
    engine = client.engine
    model = engine.model
    dtype = engine.compute_dtype
    version = engine.policy_version
    if engine.lora is not None and multi_lora:
        tensors = {}
        for name, tensor in lora_state_dict(model).items():
            whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if keep:
                tensors[name] = whole.detach().to(dtype=dtype, device="cpu", copy=True)
        if not keep:
            return None
        return LoadAdapter(
            key=key,
            model_id=client.model_id,
            base_model=client.base_model,
            lora=engine.lora,
            tensors=tensors,
            version=version,
        )
    tensors = {}
    for name, tensor in sampler_stream(model):  # a piece is valid until the next one
        if keep:
            tensors[name] = tensor.detach().to(dtype=dtype, device="cpu", copy=True)
    if not keep:
        return None
    return LoadWeights(
        key=key,
        model_id=client.model_id,
        base_model=client.base_model,
        model_config=merged_config(model),
        tensors=tensors,
        version=version,
    )


class RemoteSampling:
    """Rank 0's `SamplingBackend` for one sampler held by the generator ranks."""

    def __init__(self, pool: GeneratorPool, *, load: Load, version: int) -> None:
        self._pool = pool
        self._load = load
        self._version = version
        weakref.finalize(self, pool.drop, load.key)

    @property
    def version(self) -> int:
        return self._version

    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: PromptTargets | None = None,
    ) -> APIFuture[SampleResponse]:
        options = dict(locals())  # the SamplingBackend.sample arguments, by name
        del options["self"], options["prompt"]
        op = Sample(self._load.key, prompt=prompt, options=options)
        return APIFuture(self._pool.call(self._load, op, sequences=op.num_sequences))

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]:
        return APIFuture(self._pool.call(self._load, Score(self._load.key, prompt=prompt)))

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Nothing to hold: calls that reach a generator rank together decode together."""
        yield


class DisaggregatedService:
    """Rank 0's `ServiceBackend` (see the module docstring)."""

    def __init__(self, replicated: ReplicatedService, *, pool: GeneratorPool) -> None:
        self.replicated = replicated
        self.pool = pool

    def create_lora_training_client(self, *args: Any, **kwargs: Any) -> DisaggregatedTraining:
        return DisaggregatedTraining(
            self, self.replicated.create_lora_training_client(*args, **kwargs)
        )

    def create_training_client(self, *args: Any, **kwargs: Any) -> DisaggregatedTraining:
        return DisaggregatedTraining(self, self.replicated.create_training_client(*args, **kwargs))

    def create_training_client_from_state(
        self, path: str, *, run_id: str | None = None
    ) -> DisaggregatedTraining:
        training = self.replicated.create_training_client_from_state(path, run_id=run_id)
        return DisaggregatedTraining(self, training)

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, run_id: str | None = None
    ) -> DisaggregatedTraining:
        replicated = self.replicated
        training = replicated.create_training_client_from_state_with_optimizer(path, run_id=run_id)
        return DisaggregatedTraining(self, training)

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> RemoteSampling:
        """A sampler on a checkpoint or a base model, placed on a generator rank now (so a bad
        path fails here, and one that fits no generator rank's budget is the 503)."""
        if (model_path is None) == (base_model is None):
            raise ValueError("create_sampling_client takes exactly one of model_path, base_model")
        if model_path is not None:
            storage = self.replicated.replica.service.storage
            parsed, _ = storage.existing(model_path)
            if parsed.kind != "sampler_weights":
                raise ValueError(
                    f"{model_path} is a {parsed.kind} checkpoint; a sampling client loads "
                    "tinker://<run>/sampler_weights/<name> (from save_weights_for_sampler)"
                )
            base = storage.read_run(parsed.run_id)["base_model"]
            load: Load = LoadCheckpoint(
                key=_key("checkpoint"), model_path=model_path, base_model=base
            )
        else:
            load = LoadBase(key=_key("base"), base_model=base_model)
        self.pool.place(load)
        return RemoteSampling(self.pool, load=load, version=0)

    def snapshot(self, training: ReplicatedTraining) -> RemoteSampling:
        """A sampling client on `training`'s current weights (module docstring)."""
        call = Call(SAMPLER_PAYLOAD, training.model_id, (_key(training.model_id),))
        load = self.replicated.submit(call).result()
        self.pool.place(load)
        return RemoteSampling(self.pool, load=load, version=load.version)

    def inflight(self, training: DisaggregatedTraining) -> RemoteInflight:
        """An in-flight client on `training`'s target, moved to its current weights."""
        if training.inflight is None:
            training.inflight = RemoteTarget(self.pool, key=_key(f"{training.model_id}:inflight"))
        target = training.inflight
        call = Call(SAMPLER_PAYLOAD, training.model_id, (target.key,))
        return target.publish(self.replicated.submit(call).result())

    def health(self, trainer_pids: list[int]) -> list[dict[str, Any]]:
        trainers = [
            {"rank": rank, "role": "trainer", "pid": pid, "alive": True}
            for rank, pid in enumerate(trainer_pids)
        ]
        return trainers + self.pool.health()

    def stop(self) -> None:
        self.replicated.stop()
        self.pool.close()


class DisaggregatedTraining:
    """Rank 0's `TrainingBackend` for one model: training replays on the trainer ranks,
    snapshots sample on the generator ranks."""

    def __init__(self, service: DisaggregatedService, replicated: ReplicatedTraining) -> None:
        self.model_id = replicated.model_id
        self.replicated = replicated
        self._service = service
        self.inflight: RemoteTarget | None = None
        """The model's in-flight target, made by its first in-flight save."""

    def __getattr__(self, name: str) -> Any:
        # forward_backward, forward, optim_step, save/load state, save_weights_for_sampler,
        # get_info, get_tokenizer: as replicated.py runs them.
        return getattr(self.replicated, name)

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, *, kind: str = "snapshot"
    ) -> RemoteSampling | RemoteInflight:
        if name is not None:
            self.replicated.save_weights_for_sampler(name).result()
        if kind == "inflight":
            return self._service.inflight(self)
        return self._service.snapshot(self.replicated)

    def adapter_slots(self) -> None:
        """None: each snapshot's adapter or weights count in the snapshot budget (rank 0
        holds a copy of each in host memory)."""
        return None


def _key(prefix: str) -> str:
    return f"{prefix}:{uuid.uuid4().hex[:12]}"
