"""A decoder whose token mixer alternates between Gated DeltaNet (linear attention) and gated
full attention, layer by layer as `layer_types` says (Qwen3.5, dense and MoE).

Each block is pre-norm like the dense decoder's (zero-centred RMSNorms, centered_rmsnorm.py):
x + mixer(norm(x)), then + feed_forward(norm(.)). A full-attention block holds `attention`
(gated_attention.py), a linear-attention block `linear_attention` (gated_deltanet.py).

The `attention=` object a sampler passes to `hidden_states` reaches both kinds: full-attention
layers call its `attend` (an AttentionBackend), linear-attention layers its `read_states` /
`write_states` (a RecurrentStates, recurrent.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from temper.config.checks import check_range
from temper.models.common.attention import AttentionBackend
from temper.models.common.centered_rmsnorm import GatedRMSNorm, ZeroCenteredRMSNorm
from temper.models.common.decoder import Decoder, DecoderConfig
from temper.models.common.fla_kernels import (
    LINEAR_ATTENTION_KERNELS,
    LinearAttentionKernels,
    load_fla_kernels,
)
from temper.models.common.gated_attention import GatedAttention
from temper.models.common.gated_deltanet import GatedDeltaNet

LINEAR_ATTENTION = "linear_attention"
FULL_ATTENTION = "full_attention"
LAYER_TYPES = (LINEAR_ATTENTION, FULL_ATTENTION)


@dataclass(kw_only=True)
class HybridDecoderConfig(DecoderConfig):
    """A decoder with Gated DeltaNet and gated full-attention layers (fields of the full
    attention documented on DecoderConfig)."""

    layer_types: tuple[str, ...] = ()
    """Each layer's token mixer, 'linear_attention' or 'full_attention'; empty: every
    full_attention_interval-th layer full attention, the others linear."""
    full_attention_interval: int = 4
    """Spacing of the full-attention layers when layer_types is empty."""
    partial_rotary_factor: float = 0.25
    """Share of each attention head's dims RoPE rotates (the first ones)."""
    linear_conv_kernel: int = 4
    """Kernel length of the Gated DeltaNet's causal depthwise conv."""
    linear_num_key_heads: int = 16
    """Gated DeltaNet query/key heads; divides linear_num_value_heads."""
    linear_num_value_heads: int = 32
    """Gated DeltaNet value heads (the recurrent state has one per head)."""
    linear_key_head_dim: int = 128
    """Width of each Gated DeltaNet query/key head."""
    linear_value_head_dim: int = 128
    """Width of each Gated DeltaNet value head."""
    linear_attention_kernels: LinearAttentionKernels = "auto"
    """'auto': flash-linear-attention's chunked delta rule (and causal-conv1d's conv) for
    CUDA forwards in bf16/fp16 when installed; 'torch': always the pure-PyTorch path."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__qualname__
        positive = ("full_attention_interval", "linear_conv_kernel", "linear_num_key_heads")
        positive += ("linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        for field in positive:
            check_range(getattr(self, field), field=f"{name}.{field}", integer=True, greater_than=0)
        if self.linear_attention_kernels not in LINEAR_ATTENTION_KERNELS:
            raise ValueError(
                f"{name}.linear_attention_kernels must be one of "
                f"{list(LINEAR_ATTENTION_KERNELS)}, got {self.linear_attention_kernels!r}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads != 0:
            raise ValueError(
                f"{name}.linear_num_key_heads={self.linear_num_key_heads} must divide "
                f"linear_num_value_heads={self.linear_num_value_heads}"
            )
        check_range(
            self.partial_rotary_factor,
            field=f"{name}.partial_rotary_factor",
            greater_than=0,
            at_most=1,
        )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"{name}.partial_rotary_factor={self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotary dims of head_dim={self.head_dim}; they must be even "
                "and at least 2"
            )
        if not self.layer_types:
            interval = self.full_attention_interval
            self.layer_types = tuple(
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_layers)
            )
        self.layer_types = tuple(self.layer_types)
        unknown = sorted({kind for kind in self.layer_types if kind not in LAYER_TYPES})
        if unknown:
            raise ValueError(
                f"{name}.layer_types has unknown layer types {unknown}; valid: {list(LAYER_TYPES)}"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"{name}.layer_types has {len(self.layer_types)} entries; it needs one per "
                f"layer (num_layers={self.num_layers})"
            )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Indices of the linear-attention (Gated DeltaNet) layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def conv_dim(self) -> int:
        """Channels of the Gated DeltaNet conv: q, k and v."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """(conv channels, kernel - 1): one row's conv state in one linear layer."""
        return (self.conv_dim, self.linear_conv_kernel - 1)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """(value heads, key head dim, value head dim): one row's delta-rule state (fp32)."""
        return (self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim)

    @property
    def gated_attention_params(self) -> int:
        """Parameters of one full-attention mixer (q with its gate, k, v, o, q/k norms)."""
        params = self.dim * self.head_dim * (3 * self.num_heads + 2 * self.num_kv_heads)
        params += 2 * self.head_dim
        if self.attention_bias:
            params += self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads) + self.dim
        return params

    @property
    def linear_attention_params(self) -> int:
        """Parameters of one Gated DeltaNet mixer."""
        value_dim = self.linear_num_value_heads * self.linear_value_head_dim
        heads = self.linear_num_value_heads
        projections = self.dim * (self.conv_dim + value_dim + 2 * heads) + value_dim * self.dim
        own = self.conv_dim * self.linear_conv_kernel + 2 * heads + self.linear_value_head_dim
        return projections + own

    def mixer_params(self) -> int:
        """Token-mixer parameters over all layers, with each block's two norms."""
        return (
            len(self.attention_layers) * self.gated_attention_params
            + len(self.linear_layers) * self.linear_attention_params
            + self.num_layers * 2 * self.dim
        )

    def block(self, *, layer_index: int, qk_norm: bool) -> nn.Module:
        del qk_norm  # the gated attention always normalizes q and k
        return HybridBlock(self, layer_index=layer_index)

    def final_norm(self) -> nn.Module:
        return ZeroCenteredRMSNorm(self.dim, eps=self.norm_eps)


class HybridBlock(nn.Module):
    def __init__(self, config: HybridDecoderConfig, *, layer_index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.attention_norm = ZeroCenteredRMSNorm(config.dim, eps=config.norm_eps)
        if self.layer_type == FULL_ATTENTION:
            self.attention = GatedAttention(
                layer_index=layer_index,
                dim=config.dim,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                bias=config.attention_bias,
                norm_eps=config.norm_eps,
            )
        else:
            self.linear_attention = GatedDeltaNet(
                layer_index=layer_index,
                dim=config.dim,
                num_key_heads=config.linear_num_key_heads,
                num_value_heads=config.linear_num_value_heads,
                key_head_dim=config.linear_key_head_dim,
                value_head_dim=config.linear_value_head_dim,
                conv_kernel=config.linear_conv_kernel,
                norm_eps=config.norm_eps,
                kernels=load_fla_kernels(config.linear_attention_kernels),
            )
        self.ffn_norm = ZeroCenteredRMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = config.feed_forward(layer_index=layer_index)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos_B1TR: torch.Tensor,
        signed_sin_B1TR: torch.Tensor,
        attention: AttentionBackend | None = None,
    ) -> torch.Tensor:
        normed_BTD = self.attention_norm(x_BTD)
        if self.layer_type == FULL_ATTENTION:
            mixed_BTD = self.attention(normed_BTD, cos_B1TR, signed_sin_B1TR, attention)
        else:
            # A hybrid model's backend is also a RecurrentStates (recurrent.py).
            mixed_BTD = self.linear_attention(normed_BTD, states=attention)
        h_BTD = x_BTD + mixed_BTD
        return h_BTD + self.feed_forward(self.ffn_norm(h_BTD))


class HybridDecoder(Decoder):
    """The decoder with hybrid blocks and its own parameters' init (zero-centred norms at
    zero, the Gated DeltaNet's decay parameters as HF draws them)."""

    @torch.no_grad()
    def init_module(self, module: nn.Module, *, generator: torch.Generator | None = None) -> None:
        if isinstance(module, ZeroCenteredRMSNorm | GatedRMSNorm):
            module.reset_parameters()
        elif isinstance(module, GatedDeltaNet):
            module.reset_parameters(init_std=self.config.init_std, generator=generator)
        else:
            super().init_module(module, generator=generator)
