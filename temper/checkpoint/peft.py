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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from temper.checkpoint.atomic import check_free, staged_directory
from temper.models.common.decoder import Decoder
from temper.models.lora import LoraUnembedding, lora_modules
from temper.models.registry import family_of_model

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# PEFT matches target_modules against the last component of a module's name; list them in
# model order so the file reads like the architecture.
_HF_TARGET_ORDER = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)


def _hf_module_name(model: Decoder, name: str, module: torch.nn.Module) -> str:
    """HF module path of one LoRA module (e.g. 'model.layers.0.self_attn.q_proj', 'lm_head')."""
    key = "output.weight" if isinstance(module, LoraUnembedding) else f"{name}.weight"
    return family_of_model(model).key_to_hf(key).removesuffix(".weight")


def peft_adapter_config(model: Decoder, *, base_model_name_or_path: str) -> dict:
    """The adapter_config.json dict describing `model`'s LoRA adapters."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (call apply_lora)")
    shapes = {(module.rank, module.alpha) for module in modules.values()}
    assert len(shapes) == 1, f"LoRA modules disagree on (rank, alpha): {shapes}"
    ((rank, alpha),) = shapes
    targets = {_hf_module_name(model, name, m).rsplit(".", 1)[-1] for name, m in modules.items()}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
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


def peft_adapter_tensors(model: Decoder) -> dict[str, torch.Tensor]:
    """LoRA tensors under PEFT's key names, on the CPU and contiguous."""
    tensors = {}
    for name, module in lora_modules(model).items():
        hf_name = _PEFT_PREFIX + _hf_module_name(model, name, module)
        for factor in ("lora_A", "lora_B"):
            tensor = getattr(module, factor).detach().to("cpu").contiguous()
            tensors[f"{hf_name}.{factor}.weight"] = tensor
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
        save_file(tensors, str(staging / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps(adapter_config, indent=2) + "\n"
        (staging / ADAPTER_CONFIG_FILE).write_text(text)
    return out_dir
