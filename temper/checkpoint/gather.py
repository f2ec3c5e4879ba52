"""Whole tensors from a sharded model, for each rank's sampler copy and for export.

`DTensor.full_tensor()` all-gathers the shards (FSDP over dp, TP over tp) into the exact
values a single-process model would hold: nothing is recomputed, so the result is bitwise the
unsharded tensor. Collective: every rank calls these and every rank gets whole tensors.

`sampler_stream` is what a sampler loads after each optimizer step, one tensor at a time (a
whole dict would be a second copy of the model): the full weights, or, for LoRA, the base
weights with every adapter merged (W + scale * B @ A, formed in fp32 and cast back, the same
arithmetic as `temper.models.lora.merged_state_dict`). `sampler_state_dict` is the same as a
dict of new tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from temper.models.lora import LORA_SUFFIXES, LoraLinear, LoraUnembedding, lora_modules


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (FSDP- or TP-sharded)."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


@torch.no_grad()
def full_state_dict(
    model: nn.Module, *, keep: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """`model.state_dict()` with every DTensor gathered whole (only keys `keep` accepts).

    Always new tensors, never views of the model's (later steps do not change them).
    """
    return {
        key: _gathered(value, copy=True)
        for key, value in model.state_dict().items()
        if keep is None or keep(key)
    }


@torch.no_grad()
def sampler_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights for a sampler: whole, with LoRA adapters merged (new tensors).

    Keys are those of a model built from `temper.models.lora.merged_config(model)`.
    """
    return {key: value.clone() for key, value in sampler_stream(model)}


@torch.no_grad()
def sampler_stream(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """`sampler_state_dict` one tensor at a time, for a sampler to copy as it arrives: never
    more than one whole tensor (and its merge) beside the model. Collective on a sharded
    model: every rank must consume the whole stream, in order.

    A tensor is valid until the next one is drawn (it may be the model's own, unsharded)."""
    merges: dict[str, tuple[str, str, LoraLinear | LoraUnembedding]] = {}
    for name, module in lora_modules(model).items():
        if isinstance(module, LoraUnembedding):
            base_key = "embed.weight" if model.output is None else "output.weight"
            merges["output.weight"] = (name, base_key, module)
        else:
            merges[f"{name}.weight"] = (name, f"{name}.weight", module)
    state = model.state_dict()
    for key, value in state.items():
        if key.endswith(LORA_SUFFIXES) or key in merges:
            continue  # adapted weights come merged, below
        yield key, _gathered(value)
    for key, (name, base_key, module) in merges.items():
        weight = _gathered(state[base_key])
        lora_A = _gathered(state[f"{name}.lora_A"]).float()
        lora_B = _gathered(state[f"{name}.lora_B"]).float()
        yield key, (weight.float() + module.scale * (lora_B @ lora_A)).to(weight.dtype)


def _gathered(value: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """The whole tensor: an all-gather of a DTensor's shards (a new tensor), else the
    (replicated) local one itself, or a copy of it with `copy`."""
    if isinstance(value, DTensor):
        if not all(placement.is_replicate() for placement in value.placements):
            return value.full_tensor()
        value = value.to_local()  # nothing to gather (full_tensor() would return it as is)
    return value.detach().clone() if copy else value.detach()
