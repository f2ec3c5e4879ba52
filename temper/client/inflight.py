"""In-flight sampling clients (`save_weights_and_get_sampling_client(kind="inflight")`).

All in-flight clients of one training client read one mutable weights target: a generator of
its own (`InflightTarget`), which every later in-flight save moves to the trainer's weights of
that moment, for the clients made before and after it. Tinker's contract
(tinker/types/sampling_client_kind.py) and how Temper keeps it:

- A save does not wait for samples in progress: it hands the target a copy of the weights
  (`WeightSwitch.offer`, temper/sampler/weight_switch.py) and returns; the trainer may step at
  once. The target takes the copy before its next call, and also between two decode steps of a
  call in progress (Temper's engines; vLLM between two engine steps): a sequence being
  decoded goes on with the newer weights over the keys and values computed before (the KV
  cache is kept).
- A client samples on the weights saved when it was made or newer: the save that made it
  offered them before the client existed, and every call takes a pending offer first.
- Each client is a prefix-cache namespace of its own: the target's cached prefixes are
  dropped whenever a call comes from another client than the one before (one namespace's
  entries are held at a time). A switch of weights keeps a client's namespace.
- Every sequence reports the policy versions it was decoded with (`weight_versions`).

Where the weights go, by the trainer's placement:
- Temper's engine on a copy of the weights (full fine-tuning; LoRA on a private base, merged):
  switches between decode steps. The engine decodes in this process alone (on CPU, without
  `cpu.processes` helper processes, whose copies of the weights a switch would not reach).
- A LoRA trainer on Temper's shared multi-LoRA sampler: the target is an adapter version of
  its own (`AdapterView`); a save registers the newer adapter version, and the target's call
  in progress moves to it between decode steps (generator/multi_lora.py) while the other
  adapters' rows go on as they were.
- vLLM with merged weights: an engine of its own, which takes a save between two engine steps
  (generator/vllm.py's hook on its step driver, generator/vllm_steps.py), its running
  requests' KV cache kept. vLLM's multi-LoRA sampler: a save is taken before the target's
  next call.
- Generator ranks of a disaggregated placement: each rank that serves the model holds a
  target of its own, built and moved by the same `InflightTarget` from the weights rank 0
  sends it (temper/server/generators/).

`InflightTarget` is the target alone (it is given weights); `TrainerInflight` feeds one from a
trainer in this process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from temper.api.types import SampleResponse
from temper.checkpoint.gather import is_sharded, sampler_state_dict
from temper.generator.multi_lora import AdapterSampler, AdapterView
from temper.generator.seam import Generator
from temper.models.build import materialize
from temper.models.lora import lora_state_dict, merged_config
from temper.sampler.cpu.process_split import ProcessSplitSampler
from temper.sampler.engine import SamplerEngine
from temper.sampler.requests import SampleRequest
from temper.sampler.weight_source import WeightUpdate
from temper.sampler.weight_switch import WeightSwitch
from temper.tokenizer import Tokenizer
from temper.trainer.engine import TrainerEngine

_namespaces = itertools.count(1)


class InflightTarget:
    """One mutable sampling target: a generator that owns its weights, and the switch that
    moves them on (see the module docstring). `publish` runs on whoever saves (a training
    client's worker, a generator rank's link); reads run on the sampling workers."""

    def __init__(self, generator: Generator) -> None:
        """`generator`: built, holding no weights yet (the first `publish` loads them)."""
        self.generator = generator
        self.switch = WeightSwitch()
        if isinstance(generator, SamplerEngine):
            generator.between_steps = self.switch.between_steps
        elif isinstance(generator, AdapterView):
            generator.switch = self.switch
        elif hasattr(generator, "requests_in_flight"):  # vLLM (generator/vllm.py)
            generator.between_steps = self.switch.between_vllm_steps
        self._loaded = False
        self._lock = threading.Lock()  # one call on the target at a time
        self._namespace = 0  # the client whose cached prefixes the target holds
        self.published_version = -1
        """The policy version of the latest save (taken by the target or pending)."""

    def publish(self, weights: WeightUpdate, *, version: int) -> None:
        """Move the target to `weights` (a private copy it may keep): loaded at once by the
        first save, offered to the switch by the later ones (an adapter version is
        registered first, so a full multi-LoRA sampler refuses the save)."""
        generator = self.generator
        if not self._loaded:
            generator.update_weights(weights, version=version)
            self._loaded = True
        else:
            if isinstance(generator, AdapterView):
                assert isinstance(weights, Mapping)
                weights = generator.registered(weights, version=version)
            self.switch.offer(weights, version=version)
        self.published_version = version

    def client(self, *, namespace: int | None = None) -> InflightSnapshot:
        """What one in-flight client reads through (after `publish`); `namespace`: its
        prefix-cache namespace, when its caller numbers them (a new one otherwise)."""
        return InflightSnapshot(self, version=self.published_version, namespace=namespace)

    @contextlib.contextmanager
    def reading(self, namespace: int) -> Iterator[Generator]:
        """The target's generator, newest weights taken, cached prefixes of `namespace`."""
        assert self._loaded, "a target is read only after its first publish"
        with self._lock:
            generator = self.generator
            self.switch.take(generator)
            if namespace != self._namespace:
                _drop_prefixes(generator)
                self._namespace = namespace
            yield generator


def engine_of_its_own(generator: Generator) -> Generator:
    """`generator` as an in-flight target decodes: a process split's engine alone (its helper
    processes hold copies of the weights a switch would not reach)."""
    if isinstance(generator, ProcessSplitSampler):
        generator.close()
        return generator.engine
    return generator


class TrainerInflight:
    """A training client's in-flight target, fed from its trainer in this process. `publish`
    runs on the training client's worker."""

    def __init__(
        self,
        *,
        trainer: TrainerEngine,
        new_generator: Any,
        tokenizer: Tokenizer,
        adapter_sampler: AdapterSampler | None,
    ) -> None:
        self._trainer = trainer
        self._new_generator = new_generator
        self._tokenizer = tokenizer
        self._adapter_sampler = adapter_sampler
        self.target: InflightTarget | None = None

    def publish(self) -> InflightSnapshot:
        """Move the target to the trainer's current weights; a new client on it."""
        if self.target is None:
            self.target = InflightTarget(self._build())
        version = self._trainer.policy_version
        self.target.publish(self._weights(), version=version)
        return self.target.client()

    def _build(self) -> Generator:
        trainer = self._trainer
        if self._adapter_sampler is not None:
            assert trainer.lora is not None
            return AdapterView(self._adapter_sampler, config=trainer.lora)
        model = trainer.model
        if is_sharded(model):
            raise ValueError(
                "kind='inflight' sampling clients are not served for a sharded trainer "
                "(several ranks); use kind='snapshot'"
            )
        parameter = next(model.parameters())
        copy = materialize(
            merged_config(model), device=parameter.device, dtype=trainer.compute_dtype, init="empty"
        )
        return engine_of_its_own(self._new_generator(model=copy, tokenizer=self._tokenizer))

    def _weights(self) -> dict[str, torch.Tensor]:
        """A private copy of the trainer's sampler weights, in the generator's dtype."""
        trainer = self._trainer
        dtype = trainer.compute_dtype
        with torch.no_grad():
            if self._adapter_sampler is not None:
                tensors = lora_state_dict(trainer.model)
            elif trainer.lora is None:
                tensors = trainer.model.state_dict()
            else:
                tensors = sampler_state_dict(trainer.model)  # merged
            return {name: t.detach().to(dtype, copy=True) for name, t in tensors.items()}


class InflightSnapshot:
    """One in-flight client's view of its target: what `SamplingClient` reads through (the
    same calls as weight_sync.py's `Snapshot`). `version` is the policy version saved when
    the client was made: every sample runs on it or newer."""

    def __init__(self, target: InflightTarget, *, version: int, namespace: int | None) -> None:
        self.target = target
        self.version = version
        self.namespace = next(_namespaces) if namespace is None else namespace

    @property
    def generator(self) -> Generator:
        return self.target.generator

    def check_usable(self) -> None:
        """Always usable: the target follows the newest save."""

    def submitted(self, request: object) -> None:
        """Nothing to track: a save never waits for an in-flight client's requests."""

    @contextlib.contextmanager
    def reading(self, *, requests: Sequence[object] = ()) -> Iterator[Generator]:
        with self.target.reading(self.namespace) as generator:
            yield _Stamping(generator, self.target.switch)


class _Stamping:
    """A target's generator whose samples report the versions each sequence spanned."""

    def __init__(self, generator: Generator, switch: WeightSwitch) -> None:
        self._generator, self._switch = generator, switch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        self._switch.begin_call(version=self._generator.version)
        return self._switch.stamped(self._generator.generate(requests))


def _drop_prefixes(generator: Generator) -> None:
    """Forget the cached prefixes `generator` holds for its weights (another namespace)."""
    if isinstance(generator, SamplerEngine):
        generator.prefix_cache.clear()
    elif isinstance(generator, AdapterView):
        forget = getattr(generator.sampler, "forget_adapter_prefixes", None)
        if forget is not None and generator.adapter is not None:
            forget(generator.adapter)
    else:
        reset = getattr(generator, "reset_prefix_cache", None)
        if reset is not None:
            reset()
