"""A pre-norm decoder-only transformer: embed -> blocks -> norm -> output projection.

Shapes: B batch, T tokens, D model dim, V vocab, H head dim.

`hidden_states()` stops before the output projection so that logprob code can project in
chunks (see logprobs.py) and never hold [B*T, V] fp32 logits at once; `forward()` returns full
logits for convenience and for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from temper.config.checks import check_range
from temper.models.common.attention import AttentionBackend, GroupedQueryAttention
from temper.models.common.feed_forward import SwiGLU
from temper.models.common.moe import GroupedExperts
from temper.models.common.rmsnorm import RMSNorm
from temper.models.common.rope import Llama3RopeScaling, rope_cos_sin


@dataclass(kw_only=True)
class DecoderConfig:
    """Shape and numerics of a decoder; model families extend it with their own defaults."""

    vocab_size: int
    """Number of token ids the embedding and output layers cover."""
    dim: int
    """Model (hidden) width."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Attention query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); must divide num_heads."""
    head_dim: int
    """Width of each attention head."""
    ffn_dim: int
    """Hidden width of the SwiGLU feed-forward."""
    rope_theta: float = 1_000_000.0
    """RoPE base frequency."""
    rope_scaling: Llama3RopeScaling | None = None
    """RoPE frequency scaling (Llama 3.1's); None: plain RoPE."""
    norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Share the input embedding with the output projection."""
    attention_bias: bool = False
    """Biases on the q/k/v/o projections."""
    max_seq_len: int = 40_960
    """Longest sequence (prompt + completion) the model is used with."""
    init_std: float = 0.02
    """Standard deviation of the random normal init of weight matrices."""

    def __post_init__(self) -> None:
        name = type(self).__qualname__
        positive = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads")
        for field in (*positive, "head_dim", "ffn_dim", "max_seq_len"):
            check_range(getattr(self, field), field=f"{name}.{field}", integer=True, greater_than=0)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"{name}.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"{name}.head_dim must be even for RoPE, got {self.head_dim}")

    def feed_forward(self, *, layer_index: int) -> nn.Module:
        """The feed-forward of block `layer_index`: a SwiGLU of width ffn_dim (a MoE family
        returns its routed experts for sparse layers)."""
        del layer_index
        return SwiGLU(dim=self.dim, hidden_dim=self.ffn_dim)

    def block(self, *, layer_index: int, qk_norm: bool) -> nn.Module:
        """Decoder block `layer_index` (a hybrid family returns its own kinds of block)."""
        return DecoderBlock(self, layer_index=layer_index, qk_norm=qk_norm)

    def final_norm(self) -> nn.Module:
        """The norm before the output projection."""
        return RMSNorm(self.dim, eps=self.norm_eps)

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones): all of them here."""
        return self.head_dim


class DecoderBlock(nn.Module):
    def __init__(self, config: DecoderConfig, *, layer_index: int, qk_norm: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = GroupedQueryAttention(
            layer_index=layer_index,
            dim=config.dim,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            qk_norm=qk_norm,
            bias=config.attention_bias,
            norm_eps=config.norm_eps,
        )
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = config.feed_forward(layer_index=layer_index)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_B1TH: torch.Tensor,
        signed_sin_B1TH: torch.Tensor,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        h_BTD = x_BTD + self.attention(
            self.attention_norm(x_BTD), cos_B1TH, signed_sin_B1TH, attention
        )
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig, *, qk_norm: bool) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.dim)
        self.blocks = nn.ModuleList(
            config.block(layer_index=index, qk_norm=qk_norm) for index in range(config.num_layers)
        )
        self.norm = config.final_norm()
        self.output = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        # Optional trainable addition to the unembedding (e.g. LoRA); see `logit_inputs`.
        self.output_adapter: nn.Module | None = None

    @property
    def output_weight_VD(self) -> torch.Tensor:
        """The unembedding matrix (the embedding itself when tied)."""
        return self.embed.weight if self.output is None else self.output.weight

    def logit_inputs(self, hidden_BTD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, weight) whose product gives the logits: logits = hidden @ weight.T.

        Every logit computation goes through here so that an `output_adapter` applies
        everywhere; an adapter extends both factors (its `augment(hidden, weight)`), which
        keeps chunked logprobs exact without materializing a merged unembedding.
        """
        if self.output_adapter is None:
            return hidden_BTD, self.output_weight_VD
        return self.output_adapter.augment(hidden_BTD, self.output_weight_VD)

    def logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Logits [..., V] in the model's dtype from final hidden states. An adapter whose
        rows differ (multi_lora.py) adds its low-rank logits itself."""
        adapter_logits = getattr(self.output_adapter, "logits", None)
        if adapter_logits is not None:
            return adapter_logits(hidden_BTD, self.output_weight_VD)
        return F.linear(*self.logit_inputs(hidden_BTD))

    @torch.no_grad()
    def init_weights(self, *, generator: torch.Generator | None = None) -> None:
        """Random init in place: normal(0, init_std) matrices, zero biases, unit norms."""
        for module in self.modules():
            self.init_module(module, generator=generator)

    @torch.no_grad()
    def init_module(self, module: nn.Module, *, generator: torch.Generator | None = None) -> None:
        """`init_weights` for one module's own parameters (not its children's).

        Calling it on each of `modules()` in order, with one generator, is `init_weights`: the
        sharded init (temper/checkpoint/sharded_load.py) draws the same values one module at a
        time that way.
        """
        if isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std, generator=generator)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, GroupedExperts):
            for weight in (module.w_gate, module.w_up, module.w_down):
                nn.init.normal_(weight, mean=0.0, std=self.config.init_std, generator=generator)

    def hidden_states(
        self,
        tokens_BT: torch.Tensor,
        *,
        positions_BT: torch.Tensor | None = None,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Final normalized hidden states [B, T, D] (before the output projection).

        `attention` routes keys and values through a KV cache (see attention.py); by default
        each forward attends causally over its own tokens.
        """
        if positions_BT is None:
            positions_BT = torch.arange(tokens_BT.shape[1], device=tokens_BT.device).expand_as(
                tokens_BT
            )
        x_BTD = self.embed(tokens_BT)
        cos_B1TH, signed_sin_B1TH = rope_cos_sin(
            positions_BT,
            head_dim=self.config.rotary_dim,
            theta=self.config.rope_theta,
            dtype=x_BTD.dtype,
            scaling=self.config.rope_scaling,
        )
        for block in self.blocks:
            x_BTD = block(x_BTD, cos_B1TH, signed_sin_B1TH, attention)
        return self.norm(x_BTD)

    def forward(
        self, tokens_BT: torch.Tensor, *, positions_BT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V] in the model's dtype."""
        return self.logits(self.hidden_states(tokens_BT, positions_BT=positions_BT))
