"""Routed experts plus one always-on shared expert scaled by a sigmoid gate (Qwen3.5-MoE).

out = MoE(x) + sigmoid(x . w_gate) * SwiGLU_shared(x). The routed part is moe.py's MoE (this
is one, so router statistics, routing replay, expert LoRA and expert parallelism treat it as
any MoE block); the shared expert and its one-output gate are dense layers beside it.
"""

from __future__ import annotations

import torch
from torch import nn

from temper.models.common.feed_forward import SwiGLU
from temper.models.common.moe import MoE


class SharedExpertMoE(MoE):
    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        shared_hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__(
            dim=dim,
            hidden_dim=hidden_dim,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
        )
        self.shared_expert = SwiGLU(dim=dim, hidden_dim=shared_hidden_dim)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        shared_BTD = torch.sigmoid(self.shared_expert_gate(x_BTD)) * self.shared_expert(x_BTD)
        return super().forward(x_BTD) + shared_BTD
