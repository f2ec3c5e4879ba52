"""VllmMultiLora: many LoRA adapters on one vLLM engine, rows of different adapters mixed.

The vLLM twin of `MultiLoraSampler` (multi_lora.py): the same settings
(`MultiLoraSampler.Config`), verbs and capacity errors, so `AdapterView`, `AdapterFeed`, the
service client and the server use either backend. One vLLM engine holds the base weights and
one KV cache; each request carries its adapter's `LoRARequest`, so the calls of different
clients decode in one vLLM batch.

- A version is a vLLM adapter of its own: a fresh name and integer id per registered version,
  never reused. vLLM keys cached prefix blocks by adapter, so a version loaded under a name it
  had seen could be answered from blocks computed with the older tensors.
- vLLM loads adapters from files only: each version is written as a PEFT directory
  (checkpoint/peft.py), whole or not at all, and vLLM's `add_lora` loads it on every worker of
  the engine (each engine of a tensor-parallel group).
- `register` loads the version before returning it: tensors that do not fit the base (names,
  shapes), a rank over `VllmGenerator.Config.max_lora_rank`, or a load vLLM refuses raise a
  ValueError there, and nothing changes (an `AdapterView` keeps serving its previous version).
- Capacity as in Temper's engine: at most `max_adapters` live versions, one more is an
  `AdapterCapacityError` naming the setting. vLLM keeps at most `max_cpu_loras` adapters
  loaded and evicts the least recently used beyond; it is set to `max_adapters` and a version
  nobody holds is removed from vLLM (and its directory deleted) before the next call, so vLLM
  has no reason to evict a live one. Were one removed anyway, vLLM reloads it from its
  directory, which lives as long as the version, when a request needs it.
- `max_resident_adapters` is vLLM's `max_loras`: vLLM's scheduler admits requests of at most
  that many adapters into one step, and the others wait for a later one.
- Calls join the batch vLLM is decoding at its next step, each request with its adapter's
  `LoRARequest` (vllm_steps.py), and return as soon as their own requests finish; a call that
  finds the engine idle waits `batch_window_s` for calls of other clients to start with. A
  call vLLM refuses fails alone.

Not provided: `store_device` (vLLM keeps loaded adapters in host memory itself) and MoE
expert adapters (refused at `register` if vLLM cannot load them).
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from temper.api.types import SampleResponse
from temper.checkpoint.peft import save_peft_adapter_tensors
from temper.generator.multi_lora import MultiLoraSampler, check_capacity
from temper.generator.vllm import VllmGenerator
from temper.generator.vllm_arguments import LoraSlots
from temper.models.lora import LoraConfig, apply_lora, lora_state_dict
from temper.models.registry import family_of_model
from temper.sampler.requests import SampleRequest
from temper.tokenizer import Tokenizer


@dataclass(frozen=True, eq=False)
class VllmAdapter:
    """One adapter version loaded in vLLM: its request (name, id, directory), never reused."""

    config: LoraConfig
    version: int
    nbytes: int
    request: Any
    """vLLM's `LoRARequest` of this version."""


class VllmMultiLora:
    """Many LoRA adapters on one vLLM engine (see the module docstring)."""

    def __init__(
        self,
        config: MultiLoraSampler.Config,
        *,
        model: nn.Module,
        tokenizer: Tokenizer | None,
        vllm: VllmGenerator.Config,
    ) -> None:
        """`model`: the shared base (only read, to start the engine); `vllm`: the engine's
        settings (its max_lora_rank bounds the adapters' rank)."""
        if config.store_device != "cpu":
            warnings.warn(
                f"MultiLoraSampler.Config.store_device={config.store_device!r} is ignored by "
                "generator backend 'vllm', which keeps loaded adapters in host memory",
                stacklevel=2,
            )
        self.config = config
        self.max_lora_rank = vllm.max_lora_rank
        self._family = family_of_model(model)
        self._base_config = model.config
        slots = LoraSlots(
            # vLLM takes no more slots than adapters it may hold.
            max_loras=min(config.max_resident_adapters, config.max_adapters),
            max_cpu_loras=config.max_adapters,
            max_lora_rank=vllm.max_lora_rank,
        )
        self.engine = VllmGenerator(
            vllm, model=model, tokenizer=tokenizer, lora=slots, join_window_s=config.batch_window_s
        )
        self._directory = tempfile.TemporaryDirectory(prefix="temper-vllm-lora-")
        self._live: weakref.WeakSet[VllmAdapter] = weakref.WeakSet()
        self._registry_lock = threading.Lock()
        self._load_lock = threading.Lock()  # one adapter load or removal at a time
        self._dropped: list[Any] = []  # requests of versions nobody holds (list.append: atomic)
        self._next_id = 1  # vLLM's adapter ids start at 1
        self._shapes: dict[LoraConfig, dict[str, tuple[int, ...]]] = {}
        self.num_loads = 0
        """Adapter versions loaded into vLLM so far."""

    @property
    def num_batches(self) -> int:
        """Times vLLM's engine started decoding from idle (calls that join its running batch
        do not count)."""
        return self.engine.num_batches

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def num_adapters(self) -> int:
        with self._registry_lock:
            return len(self._live)

    def register(
        self, *, config: LoraConfig, tensors: Mapping[str, torch.Tensor], version: int
    ) -> VllmAdapter:
        """A new adapter version, written and loaded into vLLM (see the module docstring)."""
        self._check_tensors(config, tensors)
        with self._load_lock:
            self._forget_dropped()
            with self._registry_lock:
                check_capacity(held=len(self._live), config=self.config)
                lora_id, self._next_id = self._next_id, self._next_id + 1
            request = self._write(config, tensors, lora_id=lora_id)
            try:
                self.engine.add_adapter(request)
            except Exception as error:
                shutil.rmtree(request.lora_path, ignore_errors=True)
                raise ValueError(
                    f"vLLM could not load LoRA adapter version {version} ({error}); the "
                    "previous version keeps serving"
                ) from error
            self.num_loads += 1
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            adapter = VllmAdapter(config=config, version=version, nbytes=nbytes, request=request)
            with self._registry_lock:
                self._live.add(adapter)
            weakref.finalize(adapter, self._dropped.append, request)
            return adapter

    def _check_tensors(self, config: LoraConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        """The names and shapes `apply_lora(config)` gives the base, and a rank vLLM takes;
        vLLM itself would find a wrong shape only while decoding."""
        if config.rank > self.max_lora_rank:
            raise ValueError(
                f"LoRA rank {config.rank} exceeds the vLLM engine's max_lora_rank "
                f"{self.max_lora_rank} (VllmGenerator.Config.max_lora_rank; "
                "--generator.vllm.max-lora-rank), which must be set when the engine starts"
            )
        expected = self._expected_shapes(config)
        given = {name: tuple(tensor.shape) for name, tensor in tensors.items()}
        if given != expected:
            wrong = sorted(
                f"{name}: {given.get(name)} (expected {expected.get(name)})"
                for name in given.keys() | expected.keys()
                if given.get(name) != expected.get(name)
            )
            raise ValueError(
                f"adapter tensors do not match a rank-{config.rank} LoRA of the base model: "
                f"{', '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}"
            )
        for name, tensor in tensors.items():
            if not torch.isfinite(tensor).all():
                raise ValueError(f"adapter tensor {name!r} holds NaN or infinite values")

    def _expected_shapes(self, config: LoraConfig) -> dict[str, tuple[int, ...]]:
        # Shapes depend on the rank and the targets only: one entry per such choice.
        key = dataclasses.replace(config, seed=0, alpha=1.0)
        if key not in self._shapes:
            with torch.device("meta"):
                skeleton = self._base_config.build()
            apply_lora(skeleton, key)
            self._shapes[key] = {
                name: tuple(t.shape) for name, t in lora_state_dict(skeleton).items()
            }
        return self._shapes[key]

    def _write(
        self, config: LoraConfig, tensors: Mapping[str, torch.Tensor], *, lora_id: int
    ) -> Any:
        from vllm.lora.request import LoRARequest

        name = f"temper-adapter-{lora_id}"
        directory = Path(self._directory.name) / name
        save_peft_adapter_tensors(
            tensors, directory, family=self._family, lora=config, base_model_name_or_path="base"
        )
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(directory))

    def _forget_dropped(self) -> None:
        """Remove the versions nobody holds from vLLM and disk (under the load lock)."""
        while self._dropped:
            request = self._dropped.pop()
            self.engine.remove_adapter(request.lora_int_id)
            shutil.rmtree(request.lora_path, ignore_errors=True)

    def _forget_dropped_now(self) -> None:
        if self._dropped:
            with self._load_lock:
                self._forget_dropped()

    def generate(
        self, requests: Sequence[SampleRequest], *, adapter: VllmAdapter
    ) -> list[SampleResponse]:
        """`requests` sampled with `adapter`, in vLLM's running batch with other calls."""
        self._forget_dropped_now()
        return self.engine.generate(requests, adapters=[adapter.request] * len(requests))

    def score(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        adapter: VllmAdapter,
        temperature: float = 1.0,
    ) -> list[torch.Tensor]:
        self._forget_dropped_now()
        return self.engine.score(sequences, temperature=temperature, adapter=adapter.request)

    def describe(self) -> str:
        return (
            f"multi-LoRA vLLM engine: {self.num_adapters} adapters, at most "
            f"{self.config.max_resident_adapters} per batch, rank <= {self.max_lora_rank}; "
            f"{self.engine.describe()}"
        )

    def close(self) -> None:
        """Shut the engine down and remove the adapters' directories."""
        self.engine.close()
        self._directory.cleanup()
