"""A pre-norm decoder-only transformer: embed -> blocks -> norm -> output projection.

Shapes: B batch, T tokens, D model dim, V vocab, H head dim.

`hidden_states()` stops before the output projection so that logprob code can project in
chunks (see logprobs.py) and never hold [B*T, V] fp32 logits at once; `forward()` returns full
logits for convenience and for tests.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from temper.models.common.attention import GroupedQueryAttention
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.rmsnorm import RMSNorm
from temper.models.common.rope import rope_cos_sin

ActivationCheckpointing = Literal["none", "full"]


class DecoderBlock(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        ffn_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        attention_bias: bool,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = GroupedQueryAttention(
            dim=dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            qk_norm=qk_norm,
            bias=attention_bias,
            norm_eps=norm_eps,
        )
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.feed_forward = SwiGLU(dim=dim, hidden_dim=ffn_dim)

    def forward(
        self, x_BTD: torch.Tensor, cos_BTH: torch.Tensor, sin_BTH: torch.Tensor
    ) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(self.attention_norm(x_BTD), cos_BTH, sin_BTH)
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Decoder(nn.Module):
    def __init__(
        self,
        *,
        vocab_size: int,
        dim: int,
        num_layers: int,
        ffn_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm: bool,
        attention_bias: bool,
        norm_eps: float,
        rope_theta: float,
        tie_embeddings: bool,
        init_std: float,
        activation_checkpointing: ActivationCheckpointing,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.init_std = init_std
        self.activation_checkpointing = activation_checkpointing
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(
            DecoderBlock(
                dim=dim,
                ffn_dim=ffn_dim,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                qk_norm=qk_norm,
                attention_bias=attention_bias,
                norm_eps=norm_eps,
            )
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(dim, eps=norm_eps)
        self.output = None if tie_embeddings else nn.Linear(dim, vocab_size, bias=False)

    @property
    def output_weight_VD(self) -> torch.Tensor:
        """The unembedding matrix (the embedding itself when tied)."""
        return self.embed.weight if self.output is None else self.output.weight

    @torch.no_grad()
    def init_weights(self, *, generator: torch.Generator | None = None) -> None:
        """Random init in place: normal(0, init_std) matrices, zero biases, unit norms."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=self.init_std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def hidden_states(
        self, tokens_BT: torch.Tensor, *, positions_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final normalized hidden states [B, T, D] (before the output projection)."""
        if positions_BT is None:
            positions_BT = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(
                tokens_BT
            )
        x_BTD = self.embed(tokens_BT)
        cos_BTH, sin_BTH = rope_cos_sin(
            positions_BT, head_dim=self.head_dim, theta=self.rope_theta, dtype=x_BTD.dtype
        )
        checkpointed = self.activation_checkpointing == "full" and torch.is_grad_enabled()
        for block in self.blocks:
            if checkpointed:
                x_BTD = checkpoint(block, x_BTD, cos_BTH, sin_BTH, use_reentrant=False)
            else:
                x_BTD = block(x_BTD, cos_BTH, sin_BTH)
        return self.norm(x_BTD)

    def forward(
        self, tokens_BT: torch.Tensor, *, positions_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V] in the model's dtype."""
        hidden_BTD = self.hidden_states(tokens_BT, positions_BT=positions_BT)
        return F.linear(hidden_BTD, self.output_weight_VD)
