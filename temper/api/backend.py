"""The seam between a front end (the HTTP server) and whatever runs the Tinker verbs.

Three small Protocols mirror the Tinker API one for one. The in-process clients of
`temper.client` satisfy them (a test pins that), and `temper.server` calls nothing else on
them, so another backend (a pool of GPU workers, a remote trainer) can sit behind the same
server by implementing these verbs.

Every verb returns an `APIFuture` except the ones Tinker also makes synchronous: creating
clients, `save_weights_and_get_sampling_client`, `get_info` and `get_tokenizer`.

Beyond the verbs, a server uses two hooks, each with a trivial answer for a backend that has
nothing to offer there: `SamplingBackend.batch` (samples started inside one block decode as
one batch; `contextlib.nullcontext()` where the backend batches on its own or not at all) and
`TrainingBackend.adapter_slots` (how full the shared multi-LoRA sampler that a LoRA model's
sampling snapshots register their adapters on is; None where each snapshot holds a sampler of
its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from temper.api.futures import APIFuture
from temper.api.prompt_targets import PromptTargets
from temper.api.types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LoadWeightsResponse,
    ModelInput,
    OptimStepResponse,
    RoutingReplay,
    SampleResponse,
    SamplingParams,
    SaveWeightsResponse,
)


@dataclass(frozen=True, kw_only=True)
class AdapterSlots:
    """The multi-LoRA sampler a LoRA model's sampling snapshots register their adapters on
    (one per base model, shared with the other LoRA models on it), as it is now."""

    held: int
    """Adapter versions registered on it (live snapshots of every LoRA model on the base)."""
    limit: int
    """Most it holds at once (`--multi-lora.max-adapters`)."""


@runtime_checkable
class SamplingBackend(Protocol):
    def sample(
        self,
        prompt: ModelInput,
        num_samples: int = 1,
        sampling_params: SamplingParams | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: PromptTargets | None = None,
    ) -> APIFuture[SampleResponse]: ...

    def compute_logprobs(self, prompt: ModelInput) -> APIFuture[list[float | None]]: ...

    @property
    def version(self) -> int:
        """The policy version of the weights it samples from."""
        ...

    def batch(self) -> AbstractContextManager[None]:
        """`sample` calls made inside the block decode as one batch (hook: a backend without
        batching returns `contextlib.nullcontext()`)."""
        ...


@runtime_checkable
class TrainingBackend(Protocol):
    model_id: str

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
        *,
        routing_replay: RoutingReplay = "off",
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(self, adam_params: AdamParams) -> APIFuture[OptimStepResponse]: ...

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]: ...

    def load_state(self, path: str) -> APIFuture[LoadWeightsResponse]: ...

    def load_state_with_optimizer(self, path: str) -> APIFuture[LoadWeightsResponse]: ...

    def save_weights_for_sampler(self, name: str) -> APIFuture[SaveWeightsResponse]: ...

    def save_weights_and_get_sampling_client(
        self, name: str | None = None, *, kind: str = "snapshot"
    ) -> SamplingBackend:
        """`kind`: 'snapshot' or 'inflight' (Tinker's `SamplingClientKind`)."""
        ...

    def get_info(self) -> Any: ...

    def get_tokenizer(self) -> Any: ...

    def adapter_slots(self) -> AdapterSlots | None:
        """The shared multi-LoRA sampler its sampling snapshots' adapters take room on, as it
        is now (hook: None where each snapshot holds a sampler of its own)."""
        ...


@runtime_checkable
class ServiceBackend(Protocol):
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
    ) -> TrainingBackend: ...

    def create_training_client(
        self,
        base_model: str,
        user_metadata: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
    ) -> TrainingBackend: ...

    def create_training_client_from_state(
        self, path: str, *, run_id: str | None = None
    ) -> TrainingBackend: ...

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, run_id: str | None = None
    ) -> TrainingBackend: ...

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingBackend: ...
