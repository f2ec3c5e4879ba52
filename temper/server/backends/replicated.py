"""Serving on several ranks: rank 0's backend replays every training call on every rank.

`temper serve --nproc N` (or torchrun) runs one process per rank, and each builds the same
`ServiceClient` with a sharded trainer. Rank 0 runs the HTTP server on a `ReplicatedService`;
ranks > 0 run `follow`. Every call that touches a trainer (creating a model, forward_backward,
forward, optim_step, save/load state, save_weights_for_sampler, a sampler snapshot, dropping
a model) goes through one thread on rank 0, which broadcasts it as a `Call` on a gloo group
of its own; then every rank runs it on its own copy, and rank 0 gathers every rank's outcome.
One thread for all models keeps the trainers' collectives from ever interleaving, and every
rank sees the calls in the order rank 0 took them (the server's per-model queues submit in
each model's order). The models may be on different base models (every rank builds its shard of
its base model); a dropped model is released on every rank, and rank 0 logs which ranks held it.

Data parallel: each rank trains on its data-parallel share of a call's datums (contiguous,
as even as possible; tensor-parallel ranks of one group share one). Losses are sums and the
sharded trainer sums gradients and `loss:sum` over ranks, so the result is the one-process
result on the whole batch up to summation order; rank 0 puts the per-datum outputs back in
the caller's order. A call that fails on any rank fails on rank 0 with that rank's error (the
trainer agrees on bad datums before any collective, so no rank is left waiting).

Sampling is not replayed: sampler snapshots hold whole weights (gathered on every rank when
the snapshot is made), and sampling clients run on rank 0 alone. Custom losses need no verb
here: the Tinker SDK computes them on the client and sends forward + forward_backward.
"""

from __future__ import annotations

import datetime
import logging
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

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
from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient
from temper.distributed.ranks import Ranks, picklable_error

log = logging.getLogger("temper.server")
IDLE_TIMEOUT = datetime.timedelta(days=365)
"""How long ranks > 0 wait for rank 0's next call (a server may sit idle for days); a rank
that dies still ends the wait at once (gloo reports the closed connection)."""

CREATE_VERBS = (
    "create_lora_training_client",
    "create_training_client",
    "create_training_client_from_state",
    "create_training_client_from_state_with_optimizer",
)
DATA_VERBS = ("forward_backward", "forward")
STOP = "stop"
RELEASE = "release"


@dataclass(frozen=True)
class Call:
    """One backend call as rank 0 broadcasts it."""

    verb: str
    model_id: str | None = None
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class _Report:
    """One rank's outcome of a call, gathered on rank 0."""

    error: BaseException | None
    part: tuple[int, ForwardBackwardOutput] | None = None
    """(data-parallel rank, outputs of its datums) for forward/forward_backward."""
    released: bool = False
    """For a release: this rank held the model and dropped it."""


def replay_ranks() -> Ranks:
    """This job's ranks with a gloo group for the calls (collective: every rank calls it)."""
    return Ranks(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        group=dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT),
    )


class Replica:
    """One rank's copy of the served training models; runs calls on them."""

    def __init__(self, service: ServiceClient, *, ranks: Ranks) -> None:
        self.service = service
        self.ranks = ranks
        self.clients: dict[str, TrainingClient] = {}

    def step(self, call: Call) -> tuple[Any, list[_Report]]:
        """Run `call` here; returns this rank's result and every rank's report, by rank.

        A model some rank failed to create is dropped on every rank."""
        result, error = None, None
        try:
            result = self._run(call)
        except Exception as caught:
            error = caught
        part = None
        if error is None and call.verb in DATA_VERBS:
            part = (self.clients[call.model_id].engine.sharding.dp_rank, result)
        report = _Report(
            error=picklable_error(error),
            part=part,
            released=call.verb == RELEASE and result is True,
        )
        reports = self.ranks.all_gather(report)
        if call.verb in CREATE_VERBS and any(report.error is not None for report in reports):
            if error is None:
                self.clients.pop(result.model_id)
            result = None
        return result, reports

    def _run(self, call: Call) -> Any:
        if call.verb in CREATE_VERBS:
            client = getattr(self.service, call.verb)(*call.args, **call.kwargs)
            self.clients[client.model_id] = client
            return client
        if call.verb == RELEASE:
            return self.clients.pop(call.model_id, None) is not None
        client = self.clients[call.model_id]
        args = call.args
        if call.verb in DATA_VERBS:
            sharding = client.engine.sharding
            share = _share(len(args[0]), part=sharding.dp_rank, parts=sharding.dp_mesh.size())
            args = (args[0][share], *args[1:])
        result = getattr(client, call.verb)(*args, **call.kwargs)
        return result.result() if isinstance(result, APIFuture) else result


def follow(service: ServiceClient, *, ranks: Ranks) -> None:
    """Ranks > 0: run rank 0's calls, in its order, until it sends stop."""
    replica = Replica(service, ranks=ranks)
    while True:
        call = ranks.broadcast(None)
        if call.verb == STOP:
            break
        replica.step(call)
    replica.clients.clear()


class ReplicatedService:
    """Rank 0's `ServiceBackend`: every trainer call runs on every rank (see module doc)."""

    def __init__(self, service: ServiceClient, *, ranks: Ranks) -> None:
        self.replica = Replica(service, ranks=ranks)
        self.ranks = ranks
        self._worker = Worker("temper-replay")
        self._stopped = False

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
    ) -> ReplicatedTraining:
        kwargs = dict(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn)
        kwargs.update(train_unembed=train_unembed, user_metadata=user_metadata, run_id=run_id)
        return self._create(Call("create_lora_training_client", args=(base_model,), kwargs=kwargs))

    def create_training_client(
        self,
        base_model: str,
        user_metadata: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
    ) -> ReplicatedTraining:
        kwargs = {"user_metadata": user_metadata, "run_id": run_id}
        return self._create(Call("create_training_client", args=(base_model,), kwargs=kwargs))

    def create_training_client_from_state(
        self, path: str, *, run_id: str | None = None
    ) -> ReplicatedTraining:
        verb = "create_training_client_from_state"
        return self._create(Call(verb, args=(path,), kwargs={"run_id": run_id}))

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, run_id: str | None = None
    ) -> ReplicatedTraining:
        verb = "create_training_client_from_state_with_optimizer"
        return self._create(Call(verb, args=(path,), kwargs={"run_id": run_id}))

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """On rank 0 only: a sampler on saved weights or the base model needs no other rank."""
        return self.replica.service.create_sampling_client(
            model_path=model_path, base_model=base_model
        )

    def submit(self, call: Call) -> APIFuture:
        """Run `call` on every rank (after every call submitted before it)."""
        return self._worker.submit(self._run, call)

    def release(self, model_id: str) -> None:
        """Drop a model on every rank (when rank 0's handle on it is garbage)."""
        if not self._stopped:
            self.submit(Call(RELEASE, model_id))

    def stop(self) -> None:
        """Tell ranks > 0 to leave `follow` (after the calls queued so far) and drop the models."""
        if self._stopped:
            return
        self._stopped = True
        self._worker.submit(self.ranks.broadcast, Call(STOP)).result()
        self._worker.close()
        self.replica.clients.clear()

    def _create(self, call: Call) -> ReplicatedTraining:
        return ReplicatedTraining(self, self.submit(call).result())

    def _run(self, call: Call) -> Any:
        self.ranks.broadcast(call)
        result, reports = self.replica.step(call)
        for rank, report in enumerate(reports):
            if report.error is not None:
                raise report.error if rank == 0 else _on_rank(report.error, rank)
        if call.verb == RELEASE:
            released = [rank for rank, report in enumerate(reports) if report.released]
            log.info("model %s released on ranks %s", call.model_id, released)
        if call.verb not in DATA_VERBS:
            return result
        parts: dict[int, ForwardBackwardOutput] = {}
        for report in reports:  # tensor-parallel ranks of one data share report the same
            parts.setdefault(*report.part)
        outputs = [output for dp_rank in sorted(parts) for output in parts[dp_rank].loss_fn_outputs]
        return ForwardBackwardOutput(loss_fn_outputs=outputs, metrics=result.metrics)


class ReplicatedTraining:
    """Rank 0's `TrainingBackend` for one model: its calls run on every rank."""

    def __init__(self, service: ReplicatedService, local: TrainingClient) -> None:
        self.model_id = local.model_id
        self.local = local
        self._service = service
        weakref.finalize(self, service.release, local.model_id)

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]:
        replay = {"routing_replay": routing_replay}
        return self._call("forward_backward", list(data), loss_fn, loss_fn_config, **replay)

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]:
        replay = {"routing_replay": routing_replay}
        return self._call("forward", list(data), loss_fn, loss_fn_config, **replay)

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]:
        return self._call("optim_step", adam_params)

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        return self._call("save_state", name, overwrite)

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self._call("load_state", path)

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]:
        return self._call("load_state_with_optimizer", path)

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]:
        return self._call("save_weights_for_sampler", name)

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, *, kind: str = "snapshot"
    ) -> SamplingClient:
        """Every rank gathers whole weights (collective); rank 0's sampler serves them."""
        if kind == "inflight":
            raise ValueError(
                "kind='inflight' sampling clients are not served for a trainer sharded over "
                "colocated ranks (--nproc without --placement.mode disaggregated); use "
                "kind='snapshot', or the disaggregated placement"
            )
        return self._call("save_weights_and_get_sampling_client", name).result()

    def get_info(self) -> Any:
        return self.local.get_info()

    def get_tokenizer(self) -> Any:
        return self.local.get_tokenizer()

    def adapter_slots(self) -> AdapterSlots | None:
        """Rank 0's: snapshots sample on rank 0 alone."""
        return self.local.adapter_slots()

    def _call(self, verb: str, *args: Any, **kwargs: Any) -> APIFuture:
        return self._service.submit(Call(verb, self.model_id, args, kwargs))


def _share(count: int, *, part: int, parts: int) -> slice:
    """Part `part` of `count` items in `parts` contiguous, as even as possible (may be empty)."""
    base, extra = divmod(count, parts)
    start = part * base + min(part, extra)
    return slice(start, start + base + (1 if part < extra else 0))


def _on_rank(error: BaseException, rank: int) -> BaseException:
    """Another rank's error, as the same type where it can be rebuilt from a message."""
    message = f"rank {rank}: {error}"
    try:
        return type(error)(message)
    except Exception:
        return RuntimeError(f"rank {rank}: {type(error).__name__}: {error}")
