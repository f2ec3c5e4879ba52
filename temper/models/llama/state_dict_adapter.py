"""Llama 3 <-> Hugging Face: config.json fields (with the `llama3` RoPE scaling) and state-dict
key names (the dense decoder's, shared with Qwen3: temper/models/common/hf_names.py).

config.json fields Temper does not implement (another RoPE type, an unknown RoPE field,
`mlp_bias`, an activation other than silu) fail here, naming the field and what is valid,
before any weight is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from temper.models.common.hf_names import (
    decoder_config_to_hf,
    decoder_fields_from_hf,
    key_from_hf,
    key_to_hf,
)
from temper.models.common.rope import Llama3RopeScaling
from temper.models.llama.model import Llama

HF_ARCHITECTURE = "LlamaForCausalLM"
HF_MODEL_TYPE = "llama"

__all__ = ["config_from_hf", "config_to_hf", "key_from_hf", "key_to_hf"]

_LLAMA3_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
_ROPE_FIELDS = {"default": (), "llama3": _LLAMA3_FIELDS}
_ROPE_TYPE_KEYS = ("rope_type", "type", "rope_theta")


def _rope(hf_config: Mapping[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    # transformers >= 5 nests RoPE settings in `rope_parameters`; 4.x has `rope_theta` and
    # `rope_scaling` at the top level.
    if hf_config.get("rope_parameters"):
        where, rope = "rope_parameters", dict(hf_config["rope_parameters"])
    else:
        where, rope = "rope_scaling", dict(hf_config.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_FIELDS:
        raise ValueError(
            f"config.json: {where}.rope_type {rope_type!r} is not supported; Temper's Llama "
            f"implements {sorted(_ROPE_FIELDS)}"
        )
    valid = _ROPE_FIELDS[rope_type]
    unknown = sorted(set(rope) - set(valid) - set(_ROPE_TYPE_KEYS))
    if unknown:
        raise ValueError(
            f"config.json: {where} fields {unknown} are not supported for rope_type "
            f"{rope_type!r}; valid fields: {sorted((*valid, *_ROPE_TYPE_KEYS))}"
        )
    missing = [name for name in valid if name not in rope]
    if missing:
        raise ValueError(f"config.json: {where} with rope_type {rope_type!r} lacks {missing}")
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("config.json: missing rope_theta (or rope_parameters.rope_theta)")
    if rope_type == "default":
        return float(theta), None
    return float(theta), Llama3RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
    )


def config_from_hf(hf_config: Mapping[str, Any]) -> Llama.Config:
    """Build our config from a HF Llama config.json dict."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"config.json: hidden_act {hf_config['hidden_act']!r} is not supported; "
            "Llama uses 'silu'"
        )
    if hf_config.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported for Llama; valid: false")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
    required += ("intermediate_size",)
    missing = [name for name in required if name not in hf_config]
    if missing:
        raise ValueError(f"config.json: missing required Llama fields {missing}")
    theta, scaling = _rope(hf_config)
    return Llama.Config(
        **decoder_fields_from_hf(hf_config, norm_eps=1e-5, max_seq_len=131_072),
        rope_theta=theta,
        rope_scaling=scaling,
    )


def _rope_parameters(config: Llama.Config) -> dict[str, Any]:
    if config.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    return {
        "rope_type": "llama3",
        "rope_theta": config.rope_theta,
        **{name: getattr(scaling, name) for name in _LLAMA3_FIELDS},
    }


def config_to_hf(config: Llama.Config, *, dtype_name: str) -> dict[str, Any]:
    """A config.json dict that transformers (4.43+ and 5.x) loads as LlamaForCausalLM."""
    rope_parameters = _rope_parameters(config)
    rope_scaling = None
    if config.rope_scaling is not None:
        rope_scaling = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_config_to_hf(config, dtype_name=dtype_name),
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }
