"""Model families Temper implements, keyed by their HF `model_type`.

A family bundles the model class, its named sizes, its HF state-dict adapter and its
parallelize plan, so that checkpoint and trainer code can load and shard any supported
architecture without knowing which one it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any

import torch
from torch import nn

from temper.models.llama import state_dict_adapter as llama_adapter
from temper.models.llama.model import Llama
from temper.models.llama.parallelize import parallelize_llama
from temper.models.llama.sizes import LLAMA_SIZES
from temper.models.qwen3 import state_dict_adapter as qwen3_adapter
from temper.models.qwen3.model import Qwen3
from temper.models.qwen3.parallelize import parallelize_qwen3
from temper.models.qwen3.sizes import QWEN3_SIZES
from temper.models.qwen3_5 import state_dict_adapter as qwen3_5_adapter
from temper.models.qwen3_5.model import Qwen3_5
from temper.models.qwen3_5.parallelize import parallelize_qwen3_5
from temper.models.qwen3_5.sizes import QWEN3_5_SIZES
from temper.models.qwen3_5_moe import state_dict_adapter as qwen3_5_moe_adapter
from temper.models.qwen3_5_moe.model import Qwen3_5Moe
from temper.models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe
from temper.models.qwen3_5_moe.sizes import QWEN3_5_MOE_SIZES
from temper.models.qwen3_moe import state_dict_adapter as qwen3_moe_adapter
from temper.models.qwen3_moe.model import Qwen3Moe
from temper.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from temper.models.qwen3_moe.sizes import QWEN3_MOE_SIZES


@dataclass(frozen=True)
class WeightSlot:
    """Where one HF tensor goes in our state dict: a whole tensor, or one expert's row of a
    stacked expert tensor (HF stores each expert's projections separately)."""

    key: str
    expert: int | None = None


def _no_stacked_keys(key: str, expert: int) -> str | None:
    del key, expert
    return None


def _no_expert_keys(hf_key: str) -> tuple[str, int] | None:
    del hf_key
    return None


@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    name: str
    """HF `model_type`, e.g. 'qwen3'."""
    hf_architecture: str
    model_cls: type[nn.Module]
    sizes: Mapping[str, Any]
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    config_to_hf: Callable[..., dict[str, Any]]
    key_to_hf: Callable[[str], str]
    key_from_hf: Callable[[str], str | None]
    parallelize: Callable[..., nn.Module]
    """Applies TP, activation checkpointing, compile and FSDP2 to a model of this family."""
    expert_key_to_hf: Callable[[str, int], str | None] = _no_stacked_keys
    """(our stacked expert key, expert) -> that expert's HF key; None for other keys."""
    expert_key_from_hf: Callable[[str], tuple[str, int] | None] = _no_expert_keys
    """HF per-expert key -> (our stacked key, expert); None for other keys."""

    def slot_from_hf(self, hf_key: str) -> WeightSlot | None:
        """Where a HF tensor goes, or None for one this family does not use."""
        expert = self.expert_key_from_hf(hf_key)
        if expert is not None:
            return WeightSlot(*expert)
        key = self.key_from_hf(hf_key)
        return None if key is None else WeightSlot(key)

    def hf_slots(self, key: str, shape: tuple[int, ...]) -> dict[WeightSlot, str]:
        """The HF tensors one of our tensors (of `shape`) is stored as: slot -> HF key."""
        if self.expert_key_to_hf(key, 0) is None:
            return {WeightSlot(key): self.key_to_hf(key)}
        return {WeightSlot(key, e): self.expert_key_to_hf(key, e) for e in range(shape[0])}

    def tensors_to_hf(self, key: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, tensor) pairs of one of our tensors: itself, or one per expert row."""
        for slot, hf_key in self.hf_slots(key, tuple(tensor.shape)).items():
            yield hf_key, tensor if slot.expert is None else tensor[slot.expert]


def _from_adapter(
    adapter: ModuleType,
    *,
    model_cls: type[nn.Module],
    sizes: Mapping[str, Any],
    parallelize: Callable[..., nn.Module],
    experts: bool = False,
) -> ModelFamily:
    """A family whose HF names and config live in `adapter` (its state_dict_adapter module);
    `experts`: the adapter also maps stacked expert tensors to one HF tensor per expert."""
    expert_keys = (
        {
            "expert_key_to_hf": adapter.expert_key_to_hf,
            "expert_key_from_hf": adapter.expert_key_from_hf,
        }
        if experts
        else {}
    )
    return ModelFamily(
        name=adapter.HF_MODEL_TYPE,
        hf_architecture=adapter.HF_ARCHITECTURE,
        model_cls=model_cls,
        sizes=sizes,
        config_from_hf=adapter.config_from_hf,
        config_to_hf=adapter.config_to_hf,
        key_to_hf=adapter.key_to_hf,
        key_from_hf=adapter.key_from_hf,
        parallelize=parallelize,
        **expert_keys,
    )


MODEL_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "qwen3": _from_adapter(
            qwen3_adapter, model_cls=Qwen3, sizes=QWEN3_SIZES, parallelize=parallelize_qwen3
        ),
        "llama": _from_adapter(
            llama_adapter, model_cls=Llama, sizes=LLAMA_SIZES, parallelize=parallelize_llama
        ),
        "qwen3_moe": _from_adapter(
            qwen3_moe_adapter,
            model_cls=Qwen3Moe,
            sizes=QWEN3_MOE_SIZES,
            parallelize=parallelize_qwen3_moe,
            experts=True,
        ),
        "qwen3_5": _from_adapter(
            qwen3_5_adapter,
            model_cls=Qwen3_5,
            sizes=QWEN3_5_SIZES,
            parallelize=parallelize_qwen3_5,
        ),
        "qwen3_5_moe": _from_adapter(
            qwen3_5_moe_adapter,
            model_cls=Qwen3_5Moe,
            sizes=QWEN3_5_MOE_SIZES,
            parallelize=parallelize_qwen3_5_moe,
            experts=True,
        ),
    }
)


def _supported() -> str:
    return ", ".join(
        f"{f.hf_architecture} (model_type {f.name!r})" for f in MODEL_FAMILIES.values()
    )


def family(name: str) -> ModelFamily:
    if name not in MODEL_FAMILIES:
        raise ValueError(f"unknown model family {name!r}; supported: {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[name]


def family_for_hf_config(hf_config: Mapping[str, Any]) -> ModelFamily:
    """The family of a HF config.json dict, or an error naming it and listing supported ones."""
    model_type = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    for candidate in MODEL_FAMILIES.values():
        if model_type == candidate.name or candidate.hf_architecture in architectures:
            return candidate
    found = architectures[0] if architectures else model_type
    raise ValueError(
        f"config.json describes architecture {found!r} (model_type {model_type!r}), which Temper "
        f"does not support; supported architectures: {_supported()}"
    )


def family_of_config(config: Any) -> ModelFamily:
    """The family of a model config (`Qwen3_5.Config`: its model class's `Config`)."""
    for candidate in MODEL_FAMILIES.values():
        if type(config) is candidate.model_cls.Config:
            return candidate
    raise TypeError(
        f"{type(config).__qualname__} is not a Temper model config; supported: {_supported()}"
    )


def family_of_model(model: nn.Module) -> ModelFamily:
    for candidate in MODEL_FAMILIES.values():
        if isinstance(model, candidate.model_cls):
            return candidate
    raise TypeError(
        f"{type(model).__name__} is not a Temper model family; supported: {_supported()}"
    )
