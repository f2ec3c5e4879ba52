"""Export LoRA adapters as a PEFT adapter directory (adapter_config.json + safetensors).

`peft.PeftModel.from_pretrained(hf_model, out_dir)` loads the result onto the HF base model
and computes the same logits as the Temper model. Key names come from the model family's HF
adapter (`blocks.0.attention.wq` -> `model.layers.0.self_attn.q_proj`), so this file knows
only PEFT's conventions: the `base_model.model.` prefix, `.lora_A.weight`/`.lora_B.weight`
suffixes (no adapter name), and `lora_alpha / r` as the scale.

The unembedding adapter is saved as PEFT's `lm_head` LoRA. On a tied model PEFT, like Temper,
wraps `lm_head` only and shares its base weight with the embedding, so the two agree. Unlike
`PeftModel.save_pretrained` we do not also write the base `lm_head` weight (PEFT does so for
targeted embedding layers in case the vocabulary was resized, which Temper never does): the
adapter stays small and loads onto the unchanged base model.

A model read from a multimodal checkpoint (`Qwen3_5ForConditionalGeneration`) names its
modules as that checkpoint does (`model.language_model.layers.0.self_attn.q_proj`), so the
adapter loads onto that base; it holds no tensor of the other parts (the vision tower).

Expert adapters are saved per expert under the released per-expert module names
(`model.layers.0.mlp.experts.3.gate_proj.lora_A.weight`, target modules `gate_proj`, `up_proj`,
`down_proj`), the format PEFT writes for a model whose experts are linears. transformers 5
holds experts as fused stacked parameters (`gate_up_proj` [E, 2F, D], `down_proj`); PEFT (0.21)
converts such an adapter on load: the three names become `target_parameters` on the fused
weights, and gate's and up's pairs are joined (A stacked, B block-diagonal, rank and alpha
doubled), which is exact. That conversion takes every `gate_proj`/`up_proj`/`down_proj`
target for an expert, so a model that also has dense MLP layers (`mlp_only_layers`) lists
those layers' weights again in `target_parameters` (`mlp.gate_proj.weight`: PEFT then adapts
them as parameters, the same W + scale * B @ A). That entry is written only for such models:
transformers 4, whose experts are linears, would see the dense layers targeted twice. Model
types PEFT does not convert (Qwen3.5-MoE) get their expert adapters written on the fused
parameters themselves (peft_fused_experts.py); a shared expert's linears are plain targets.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from temper.checkpoint.atomic import check_free, staged_directory
from temper.checkpoint.composite import stored_key
from temper.checkpoint.peft_fused_experts import (
    fused_config_entries,
    fused_expert_adapters,
    fused_experts,
    is_expert_adapter,
)
from temper.models.common.decoder import Decoder
from temper.models.common.hf_composite import HfComposite
from temper.models.lora import (
    UNEMBEDDING_ADAPTER,
    LoraConfig,
    lora_modules,
    lora_state_dict,
)
from temper.models.lora_experts import ADAPTER_SUFFIX
from temper.models.registry import ModelFamily, family_of_model

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# PEFT matches target_modules against the last component of a module's name; list them in
# model order so the file reads like the architecture.
_HF_TARGET_ORDER = (
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)


@dataclass(frozen=True)
class _HfAdapter:
    """One adapted HF module: a linear, one expert's projection, or a fused expert
    parameter (peft_fused_experts.py)."""

    name: str
    """Its HF module path, e.g. 'model.layers.0.self_attn.q_proj', 'lm_head',
    'model.layers.0.mlp.experts.3.gate_proj'."""
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    expert: bool
    fused: bool = False
    """A `target_parameters` adapter (not a `target_modules` one)."""


def _hf_adapters(model: Decoder) -> Iterator[_HfAdapter]:
    """Every adapter of `model` under its HF module name, expert adapters one per expert."""
    composite = model.config.hf_composite
    return _hf_adapters_of(family_of_model(model), lora_state_dict(model), composite=composite)


def _adapted_key(module_name: str) -> tuple[str, bool]:
    """The weight an adapter module (a `lora_state_dict` name less its factor) changes, and
    whether it holds one pair per expert (see `temper.models.lora.adapted_key`)."""
    if module_name == UNEMBEDDING_ADAPTER:
        return "output.weight", False
    if module_name.endswith(ADAPTER_SUFFIX):
        return module_name.removesuffix(ADAPTER_SUFFIX), True
    return f"{module_name}.weight", False


def _hf_adapters_of(
    family: ModelFamily, tensors: Mapping[str, torch.Tensor], *, composite: HfComposite | None
) -> Iterator[_HfAdapter]:
    """The adapters in `tensors` (`lora_state_dict` names) under their HF module names (in a
    multimodal checkpoint's layout for a model read from one: `composite`)."""
    fused = fused_experts(family)
    for name in tensors:
        if not name.endswith(".lora_A") or (fused and is_expert_adapter(name)):
            continue
        module_name = name.removesuffix(".lora_A")
        lora_A, lora_B = tensors[name].detach(), tensors[f"{module_name}.lora_B"].detach()
        key, expert = _adapted_key(module_name)
        for slot, hf_key in family.hf_slots(key, tuple(lora_A.shape)).items():
            pair = (lora_A[slot.expert], lora_B[slot.expert]) if expert else (lora_A, lora_B)
            name = stored_key(composite, hf_key).removesuffix(".weight")
            yield _HfAdapter(name, *pair, expert=expert)
    if fused:
        for adapter in fused_expert_adapters(family, tensors):
            module = stored_key(composite, f"{adapter.module}.weight").removesuffix(".weight")
            yield _HfAdapter(module, adapter.lora_A, adapter.lora_B, True, fused=True)


def _dense_twins(adapters: list[_HfAdapter]) -> list[str]:
    """`target_parameters` for linears that share a target name with an expert projection
    (a MoE model's dense MLP layers): 'mlp.gate_proj.weight' and so on, in model order."""
    expert_targets = {a.name.rsplit(".", 1)[-1] for a in adapters if a.expert}
    twins = {
        ".".join(a.name.split(".")[-2:])
        for a in adapters
        if not a.expert and a.name.rsplit(".", 1)[-1] in expert_targets
    }
    order = sorted(twins, key=lambda twin: _HF_TARGET_ORDER.index(twin.rsplit(".", 1)[-1]))
    return [f"{twin}.weight" for twin in order]


def peft_adapter_config(model: Decoder, *, base_model_name_or_path: str) -> dict:
    """The adapter_config.json dict describing `model`'s LoRA adapters."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (call apply_lora)")
    shapes = {(module.rank, module.alpha) for module in modules.values()}
    assert len(shapes) == 1, f"LoRA modules disagree on (rank, alpha): {shapes}"
    ((rank, alpha),) = shapes
    return _adapter_config(
        list(_hf_adapters(model)), rank=rank, alpha=alpha, base=base_model_name_or_path
    )


def _adapter_config(adapters: list[_HfAdapter], *, rank: int, alpha: float, base: str) -> dict:
    targets = {adapter.name.rsplit(".", 1)[-1] for adapter in adapters if not adapter.fused}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": [name for name in _HF_TARGET_ORDER if name in targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    twins = _dense_twins(adapters)
    if twins:
        config["target_parameters"] = twins
    if any(adapter.fused for adapter in adapters):
        config |= fused_config_entries(rank=rank, alpha=alpha)
    return config


def peft_adapter_tensors(model: Decoder) -> dict[str, torch.Tensor]:
    """LoRA tensors under PEFT's key names, on the CPU and contiguous."""
    return _peft_tensors(_hf_adapters(model))


def _peft_tensors(adapters: Iterator[_HfAdapter]) -> dict[str, torch.Tensor]:
    tensors = {}
    for adapter in adapters:
        for factor in ("lora_A", "lora_B"):
            key = f"{_PEFT_PREFIX}{adapter.name}.{factor}.weight"
            tensors[key] = getattr(adapter, factor).to("cpu").contiguous()
    return tensors


def save_peft_adapter(
    model: Decoder,
    out_dir: str | Path,
    *,
    base_model_name_or_path: str,
    overwrite: bool = False,
) -> Path:
    """Write `model`'s LoRA adapters as a PEFT adapter directory; returns its path.

    `base_model_name_or_path` is recorded for `PeftModel`/`AutoPeftModel` to find the base.
    The directory is written under a temporary name and renamed into place.
    """
    out_dir = check_free(out_dir, overwrite=overwrite)
    adapter_config = peft_adapter_config(model, base_model_name_or_path=base_model_name_or_path)
    tensors = peft_adapter_tensors(model)
    with staged_directory(out_dir) as staging:
        _write(staging, tensors=tensors, config=adapter_config)
    return out_dir


def save_peft_adapter_tensors(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    family: ModelFamily,
    lora: LoraConfig,
    base_model_name_or_path: str,
    composite: HfComposite | None = None,
) -> Path:
    """Write adapter tensors (`lora_state_dict` names, of a `family` model adapted by `lora`)
    as a PEFT adapter directory, whole or not at all; the directory must not exist.

    The same files `save_peft_adapter` writes for a model holding these tensors (a model read
    from the multimodal checkpoint `composite`: its module names)."""
    adapters = list(_hf_adapters_of(family, tensors, composite=composite))
    if not adapters:
        raise ValueError(
            "save_peft_adapter_tensors: no adapter tensors given (names ending in .lora_A)"
        )
    config = _adapter_config(
        adapters, rank=lora.rank, alpha=lora.alpha, base=base_model_name_or_path
    )
    out_dir = check_free(out_dir, overwrite=False)
    with staged_directory(out_dir) as staging:
        _write(staging, tensors=_peft_tensors(iter(adapters)), config=config)
    return out_dir


def _write(directory: Path, *, tensors: dict[str, torch.Tensor], config: dict) -> None:
    save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
