"""Qwen3-MoE <-> Hugging Face: config.json fields and state-dict key names.

Attention and dense layers use the dense decoder's names (temper/models/common/hf_names.py);
the router and the experts, stored one tensor per expert, use hf_expert_names.py.

Fields Temper does not implement fail here, naming the field, before any weight is read: a
RoPE type other than the default, sliding windows, an activation other than silu,
`num_experts_per_tok` above the expert count.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from temper.models.common.hf_expert_names import (
    expert_key_from_hf,
    expert_key_to_hf,
    key_from_hf,
    key_to_hf,
)
from temper.models.common.hf_names import decoder_config_to_hf, decoder_fields_from_hf
from temper.models.qwen3.state_dict_adapter import check_qwen3_fields, rope_theta
from temper.models.qwen3_moe.model import Qwen3Moe

HF_ARCHITECTURE = "Qwen3MoeForCausalLM"
HF_MODEL_TYPE = "qwen3_moe"

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "expert_key_from_hf",
    "expert_key_to_hf",
    "key_from_hf",
    "key_to_hf",
]


def config_from_hf(hf_config: Mapping[str, Any]) -> Qwen3Moe.Config:
    """Build our config from a HF Qwen3-MoE config.json dict."""
    check_qwen3_fields(hf_config, family="Qwen3-MoE")
    # transformers 5 writes the expert count as `num_local_experts`, releases as `num_experts`.
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    required = {"num_experts": num_experts}
    for name in ("num_experts_per_tok", "moe_intermediate_size", "intermediate_size"):
        required[name] = hf_config.get(name)
    missing = [name for name, value in required.items() if value is None]
    if missing:
        raise ValueError(f"config.json: missing required Qwen3-MoE fields {missing}")
    top_k = hf_config["num_experts_per_tok"]
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok={top_k} is not valid for num_experts="
            f"{num_experts}; valid: 1..{num_experts}"
        )
    return Qwen3Moe.Config(
        **decoder_fields_from_hf(hf_config, norm_eps=1e-6, max_seq_len=40_960),
        rope_theta=rope_theta(hf_config),
        num_experts=num_experts,
        top_k=top_k,
        moe_ffn_dim=hf_config["moe_intermediate_size"],
        norm_topk_prob=hf_config.get("norm_topk_prob", False),
        decoder_sparse_step=hf_config.get("decoder_sparse_step", 1),
        mlp_only_layers=tuple(hf_config.get("mlp_only_layers") or ()),
        router_aux_loss_coef=hf_config.get("router_aux_loss_coef", 0.001),
    )


def config_to_hf(config: Qwen3Moe.Config, *, dtype_name: str) -> dict[str, Any]:
    """A config.json dict that transformers (4.51+ and 5.x) loads as Qwen3MoeForCausalLM."""
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": HF_MODEL_TYPE,
        **decoder_config_to_hf(config, dtype_name=dtype_name),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.num_layers,
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "moe_intermediate_size": config.moe_ffn_dim,
        "norm_topk_prob": config.norm_topk_prob,
        "decoder_sparse_step": config.decoder_sparse_step,
        "mlp_only_layers": list(config.mlp_only_layers),
        "router_aux_loss_coef": config.router_aux_loss_coef,
        "output_router_logits": False,
    }
