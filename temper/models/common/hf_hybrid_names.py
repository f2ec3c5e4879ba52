"""Hybrid decoder <-> Hugging Face: the Gated DeltaNet's state-dict names and the config.json
fields the Qwen3.5 families share.

Our linear-attention blocks hold `linear_attention.*` (gated_deltanet.py); HF checkpoints name
them `linear_attn.*`, with the conv weight under `conv1d.weight` ([C, 1, kernel], stored as is).
Every other key is the dense decoder's (hf_names.py) or the MoE decoder's
(hf_expert_names.py): the family passes its own mapping for those.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from temper.models.common.hybrid_decoder import LAYER_TYPES, HybridDecoderConfig

_LINEAR_KEYS = {
    "linear_attention.in_proj_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "linear_attention.in_proj_z.weight": "linear_attn.in_proj_z.weight",
    "linear_attention.in_proj_b.weight": "linear_attn.in_proj_b.weight",
    "linear_attention.in_proj_a.weight": "linear_attn.in_proj_a.weight",
    "linear_attention.conv_weight": "linear_attn.conv1d.weight",
    "linear_attention.dt_bias": "linear_attn.dt_bias",
    "linear_attention.A_log": "linear_attn.A_log",
    "linear_attention.norm.weight": "linear_attn.norm.weight",
    "linear_attention.out_proj.weight": "linear_attn.out_proj.weight",
}
_HF_LINEAR_KEYS = {hf: ours for ours, hf in _LINEAR_KEYS.items()}
_OUR_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_BLOCK = re.compile(r"model\.layers\.(\d+)\.(.+)")


def with_linear_attention(
    key_to_hf: Callable[[str], str], key_from_hf: Callable[[str], str | None]
) -> tuple[Callable[[str], str], Callable[[str], str | None]]:
    """(key_to_hf, key_from_hf) of a hybrid family: the Gated DeltaNet's names, then the given
    mappings for every other key."""

    def hybrid_key_to_hf(key: str) -> str:
        match = _OUR_BLOCK.fullmatch(key)
        if match is not None and match.group(2) in _LINEAR_KEYS:
            return f"model.layers.{match.group(1)}.{_LINEAR_KEYS[match.group(2)]}"
        return key_to_hf(key)

    def hybrid_key_from_hf(hf_key: str) -> str | None:
        match = _HF_BLOCK.fullmatch(hf_key)
        if match is not None and match.group(2) in _HF_LINEAR_KEYS:
            return f"blocks.{match.group(1)}.{_HF_LINEAR_KEYS[match.group(2)]}"
        return key_from_hf(hf_key)

    return hybrid_key_to_hf, hybrid_key_from_hf


# transformers' Qwen3.5 config defaults, for config.json files that leave a field out.
_HF_DEFAULTS = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
}


def check_hybrid_fields(hf_config: Mapping[str, Any], *, family: str) -> None:
    """The config.json checks both Qwen3.5 families share: silu, an output-gated attention,
    the default RoPE, the required shape fields, known layer types."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act {hf_config['hidden_act']!r} is not supported; "
            f"{family} uses 'silu'"
        )
    if hf_config.get("attn_output_gate", True) is not True:
        raise ValueError(f"config.json: attn_output_gate=false is not supported for {family}")
    rope = hf_config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json: rope_parameters.rope_type {rope['rope_type']!r} is not supported; "
            f"{family} implements the default RoPE"
        )
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    missing = [name for name in required if name not in hf_config]
    if missing:
        raise ValueError(f"config.json: missing required {family} fields {missing}")
    unknown = sorted(
        {kind for kind in hf_config.get("layer_types") or () if kind not in LAYER_TYPES}
    )
    if unknown:
        raise ValueError(
            f"config.json: layer_types has unknown layer types {unknown}; valid: "
            f"{list(LAYER_TYPES)}"
        )
    layer_types = hf_config.get("layer_types")
    if layer_types and len(layer_types) != hf_config["num_hidden_layers"]:
        raise ValueError(
            f"config.json: layer_types has {len(layer_types)} entries; it needs one per layer "
            f"(num_hidden_layers={hf_config['num_hidden_layers']})"
        )


def hybrid_fields_from_hf(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The HybridDecoderConfig fields of a Qwen3.5 config.json (beyond the dense decoder's)."""
    rope = hf_config.get("rope_parameters") or {}

    def get(name: str) -> Any:
        return hf_config.get(name, _HF_DEFAULTS[name])

    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json: missing rope_parameters.rope_theta (or rope_theta)")
    return {
        "rope_theta": float(theta),
        "partial_rotary_factor": float(
            rope.get("partial_rotary_factor", get("partial_rotary_factor"))
        ),
        "layer_types": tuple(hf_config.get("layer_types") or ()),
        "full_attention_interval": get("full_attention_interval"),
        "linear_conv_kernel": get("linear_conv_kernel_dim"),
        "linear_num_key_heads": get("linear_num_key_heads"),
        "linear_num_value_heads": get("linear_num_value_heads"),
        "linear_key_head_dim": get("linear_key_head_dim"),
        "linear_value_head_dim": get("linear_value_head_dim"),
    }


def hybrid_config_to_hf(config: HybridDecoderConfig) -> dict[str, Any]:
    """The config.json fields of the hybrid layers and the partial RoPE."""
    return {
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        "partial_rotary_factor": config.partial_rotary_factor,
        "attn_output_gate": True,
        "layer_types": list(config.layer_types),
        "full_attention_interval": config.full_attention_interval,
        "linear_conv_kernel_dim": config.linear_conv_kernel,
        "linear_num_key_heads": config.linear_num_key_heads,
        "linear_num_value_heads": config.linear_num_value_heads,
        "linear_key_head_dim": config.linear_key_head_dim,
        "linear_value_head_dim": config.linear_value_head_dim,
    }
