"""SharedBases: one frozen copy of each base model's weights, shared by its LoRA clients.

A LoRA training client trains only its adapters, so the base weights it runs are never
written: every LoRA client of one `ServiceClient` on the same base model (and device, dtype)
reads one copy of them. Each client still gets a module tree of its own (`apply_lora` swaps
its linears for `LoraLinear`s, so the trees cannot be shared), whose parameters are new
`nn.Parameter` objects on the shared tensors' storage, frozen (requires_grad False), and whose
buffers are the shared ones. A client therefore owns only its adapters, their gradients and
its optimizer state.

Nothing may write the shared tensors in place. What reads them: the trainer's forward and
backward (gradients go to the adapters only), `merged_state_dict` (new tensors), a
generator's `update_weights` with merged tensors (copies into the generator's own model), and
checkpoints with `trainable_only` (the base is neither saved nor loaded). A sharded trainer
(FSDP/TP replaces parameters by shards) and full fine-tuning build a private copy instead
(service_client.py). `SharedBase.check_unchanged` asserts the guard the tests rely on: every
shared tensor's storage, version counter (bumped by any in-place write) and values.

Their sampling snapshots share one sampler too: `sampler()` builds the base's multi-LoRA
sampler (generator/multi_lora.py) on a tree of its own over the same tensors, one KV cache for
all of them.

The base lives while a client holds its `SharedBase`: the registry keeps it weakly, so
dropping the last client on a base frees it.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable

import torch
from torch import nn

from temper.checkpoint.model_source import ModelSource
from temper.generator.multi_lora import AdapterSampler
from temper.tokenizer import Tokenizer


class SharedBase:
    """One base model's frozen weights and tokenizer; `model()` gives a client its tree."""

    def __init__(self, *, model: nn.Module, tokenizer: Tokenizer) -> None:
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self._template = model
        self.tokenizer = tokenizer
        self._sampler: AdapterSampler | None = None
        self._sampler_lock = threading.Lock()

    def sampler(self, make: Callable[[nn.Module], AdapterSampler]) -> AdapterSampler:
        """The multi-LoRA sampler every LoRA client of this base samples through, built by
        `make(model)` on first use (`model`: a plain tree on the shared tensors)."""
        with self._sampler_lock:
            if self._sampler is None:
                self._sampler = make(self.model())
            return self._sampler

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The shared parameters and buffers by name."""
        return dict(self._template.state_dict(keep_vars=True))

    def model(self) -> nn.Module:
        """A new module tree on the shared tensors: frozen parameters of its own (so no
        client's flags or `.grad` reach another's) viewing the same storage."""
        memo: dict[int, object] = {}
        for parameter in self._template.parameters():
            memo[id(parameter)] = nn.Parameter(parameter.detach(), requires_grad=False)
        for buffer in self._template.buffers():
            memo[id(buffer)] = buffer
        return copy.deepcopy(self._template, memo)

    def fingerprint(self) -> dict[str, tuple[int, int, torch.Tensor]]:
        """(data_ptr, version counter, value copy) of every shared tensor, for tests."""
        return {
            name: (tensor.data_ptr(), tensor._version, tensor.detach().clone())
            for name, tensor in self.tensors.items()
        }

    def check_unchanged(self, fingerprint: dict[str, tuple[int, int, torch.Tensor]]) -> None:
        """Raise AssertionError naming the first shared tensor written since `fingerprint`."""
        for name, tensor in self.tensors.items():
            data_ptr, version, value = fingerprint[name]
            if tensor.data_ptr() != data_ptr or tensor._version != version:
                raise AssertionError(f"shared base tensor {name} was replaced or written")
            if not torch.equal(tensor.detach(), value):
                raise AssertionError(f"shared base tensor {name} changed its values")


class SharedBases:
    """The shared bases of one ServiceClient, by model source (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bases: weakref.WeakValueDictionary[str, SharedBase] = weakref.WeakValueDictionary()

    def get(self, source: ModelSource.Config) -> SharedBase:
        """The shared base of `source`, built on first use (and after its last user left)."""
        key = repr(source)
        with self._lock:
            base = self._bases.get(key)
            if base is None:
                built = source.build()
                base = SharedBase(model=built.model, tokenizer=built.tokenizer)
                self._bases[key] = base
            return base

    def __len__(self) -> int:
        return len(self._bases)
