"""Whole tensors from a sharded model, for each rank's sampler copy and for export.

`DTensor.full_tensor()` all-gathers the shards (FSDP over dp, TP over tp) into the exact
values a single-process model would hold: nothing is recomputed, so the result is bitwise the
unsharded tensor. Collective: every rank calls these and every rank gets whole tensors.

`sampler_state_dict` is what a sampler loads after each optimizer step: the full weights, or,
for LoRA, the base weights with every adapter merged (W + scale * B @ A, formed in fp32 and
cast back, the same arithmetic as `temper.models.lora.merged_state_dict`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from temper.models.lora import LORA_SUFFIXES, LoraUnembedding, lora_modules


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
        key: _whole(value) for key, value in model.state_dict().items() if keep is None or keep(key)
    }


def _whole(value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return value.detach().clone()
    if all(placement.is_replicate() for placement in value.placements):
        # Nothing to gather: full_tensor() would return the local tensor itself.
        return value.to_local().detach().clone()
    return value.full_tensor()


@torch.no_grad()
def sampler_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain model's weights for a sampler: whole, with LoRA adapters merged.

    Keys are those of a model built from `temper.models.lora.merged_config(model)`.
    """
    full = full_state_dict(model)
    merged = {key: value for key, value in full.items() if not key.endswith(LORA_SUFFIXES)}
    for name, module in lora_modules(model).items():
        if isinstance(module, LoraUnembedding):
            key = "output.weight"
            base_key = "embed.weight" if model.output is None else "output.weight"
        else:
            key = base_key = f"{name}.weight"
        lora_A = full[f"{name}.lora_A"].float()
        lora_B = full[f"{name}.lora_B"].float()
        weight = full[base_key]
        merged[key] = (weight.float() + module.scale * (lora_B @ lora_A)).to(weight.dtype)
    return merged
