"""Qwen3.5-MoE decoder: Qwen3.5's hybrid token mixers (Gated DeltaNet and gated full
attention, temper/models/common/hybrid_decoder.py) with, in every layer, routed SwiGLU experts
(softmax top-k, renormalized) plus a shared expert behind a sigmoid gate
(shared_expert_moe.py).

`ffn_dim` is the shared expert's hidden width (HF shared_expert_intermediate_size); there is no
dense feed-forward. Single-device code; HF naming lives in state_dict_adapter.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from temper.config.configurable import Configurable
from temper.models.common.hybrid_decoder import HybridDecoder, HybridDecoderConfig
from temper.models.common.moe_decoder import MoEDecoderConfig
from temper.models.common.shared_expert_moe import SharedExpertMoE


class Qwen3_5Moe(HybridDecoder, Configurable):
    @dataclass(kw_only=True)
    class Config(HybridDecoderConfig, MoEDecoderConfig, Configurable.Config):
        """Qwen3.5-MoE shapes (fields documented on HybridDecoderConfig, MoEDecoderConfig and
        DecoderConfig; ffn_dim is the shared expert's width); named sizes are in sizes.py."""

        def __post_init__(self) -> None:
            super().__post_init__()
            name = type(self).__qualname__
            if self.decoder_sparse_step != 1 or self.mlp_only_layers:
                raise ValueError(
                    f"{name}: every Qwen3.5-MoE layer is sparse; decoder_sparse_step must be 1 "
                    f"(got {self.decoder_sparse_step}) and mlp_only_layers empty (got "
                    f"{list(self.mlp_only_layers)})"
                )

        def feed_forward(self, *, layer_index: int) -> nn.Module:
            del layer_index
            return SharedExpertMoE(
                dim=self.dim,
                hidden_dim=self.moe_ffn_dim,
                shared_hidden_dim=self.ffn_dim,
                num_experts=self.num_experts,
                top_k=self.top_k,
                norm_topk_prob=self.norm_topk_prob,
            )

        def feed_forward_params(self, *, active: bool) -> int:
            experts = self.top_k if active else self.num_experts
            routed = self.num_experts * self.dim + experts * 3 * self.dim * self.moe_ffn_dim
            shared = 3 * self.dim * self.ffn_dim + self.dim
            return self.num_layers * (routed + shared)

    def __init__(self, config: Config) -> None:
        super().__init__(config, qk_norm=True)
