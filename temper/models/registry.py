"""Model families Temper implements, keyed by their HF `model_type`.

A family bundles the model class, its named sizes, its HF state-dict adapter and its
parallelize plan, so that checkpoint and trainer code can load and shard any supported
architecture without knowing which one it is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from torch import nn

from temper.models.llama import state_dict_adapter as llama_adapter
from temper.models.llama.model import Llama
from temper.models.llama.parallelize import parallelize_llama
from temper.models.llama.sizes import LLAMA_SIZES
from temper.models.qwen3 import state_dict_adapter as qwen3_adapter
from temper.models.qwen3.model import Qwen3
from temper.models.qwen3.parallelize import parallelize_qwen3
from temper.models.qwen3.sizes import QWEN3_SIZES


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


MODEL_FAMILIES: Mapping[str, ModelFamily] = MappingProxyType(
    {
        "qwen3": ModelFamily(
            name=qwen3_adapter.HF_MODEL_TYPE,
            hf_architecture=qwen3_adapter.HF_ARCHITECTURE,
            model_cls=Qwen3,
            sizes=QWEN3_SIZES,
            config_from_hf=qwen3_adapter.config_from_hf,
            config_to_hf=qwen3_adapter.config_to_hf,
            key_to_hf=qwen3_adapter.key_to_hf,
            key_from_hf=qwen3_adapter.key_from_hf,
            parallelize=parallelize_qwen3,
        ),
        "llama": ModelFamily(
            name=llama_adapter.HF_MODEL_TYPE,
            hf_architecture=llama_adapter.HF_ARCHITECTURE,
            model_cls=Llama,
            sizes=LLAMA_SIZES,
            config_from_hf=llama_adapter.config_from_hf,
            config_to_hf=llama_adapter.config_to_hf,
            key_to_hf=llama_adapter.key_to_hf,
            key_from_hf=llama_adapter.key_from_hf,
            parallelize=parallelize_llama,
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


def family_of_model(model: nn.Module) -> ModelFamily:
    for candidate in MODEL_FAMILIES.values():
        if isinstance(model, candidate.model_cls):
            return candidate
    raise TypeError(
        f"{type(model).__name__} is not a Temper model family; supported: {_supported()}"
    )
