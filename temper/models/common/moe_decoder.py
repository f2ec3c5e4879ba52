"""The shape of a decoder whose feed-forwards are routed experts in some layers (Qwen3-MoE).

A layer is sparse (a `MoE` block) unless it is listed in `mlp_only_layers` or falls between
`decoder_sparse_step`s; the others keep a dense SwiGLU of width `ffn_dim`, as the HF configs
define it. Parameter counts distinguish the total from the active (per token) count.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from temper.config.checks import check_range
from temper.models.common.decoder import DecoderConfig
from temper.models.common.moe import MoE


@dataclass(kw_only=True)
class MoEDecoderConfig(DecoderConfig):
    num_experts: int
    """Routed experts per sparse layer."""
    top_k: int
    """Experts each token is sent to (HF num_experts_per_tok); at most num_experts."""
    moe_ffn_dim: int
    """Hidden width of each expert's SwiGLU (HF moe_intermediate_size)."""
    norm_topk_prob: bool = True
    """Renormalize each token's top-k router weights to sum to one."""
    decoder_sparse_step: int = 1
    """Every decoder_sparse_step-th layer is sparse (1: all of them)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense SwiGLU of width ffn_dim."""
    router_aux_loss_coef: float = 0.001
    """Weight of the load-balancing loss when a loss adds it (it is always reported)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__qualname__
        for field in ("num_experts", "top_k", "moe_ffn_dim", "decoder_sparse_step"):
            check_range(getattr(self, field), field=f"{name}.{field}", integer=True, greater_than=0)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"{name}.top_k={self.top_k} exceeds num_experts={self.num_experts}; valid: "
                f"1..{self.num_experts}"
            )
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        outside = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if outside:
            raise ValueError(
                f"{name}.mlp_only_layers {outside} are not layers; valid: 0..{self.num_layers - 1}"
            )
        check_range(self.router_aux_loss_coef, field=f"{name}.router_aux_loss_coef", at_least=0)

    def is_sparse(self, layer_index: int) -> bool:
        """Whether block `layer_index` routes over experts (HF's rule)."""
        return (
            layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.is_sparse(index) for index in range(self.num_layers))

    def feed_forward(self, *, layer_index: int) -> nn.Module:
        if not self.is_sparse(layer_index):
            return super().feed_forward(layer_index=layer_index)
        return MoE(
            dim=self.dim,
            hidden_dim=self.moe_ffn_dim,
            num_experts=self.num_experts,
            top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob,
        )

    def mixer_params(self) -> int:
        """Token-mixer parameters over all layers, with each block's two norms (the
        family's)."""
        raise NotImplementedError(f"{type(self).__qualname__} does not count its mixers")

    def _count(self, *, active: bool) -> int:
        blocks = self.mixer_params() + self.feed_forward_params(active=active)
        embeddings = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return blocks + embeddings + self.dim

    @property
    def num_params(self) -> int:
        """Parameter count, every expert included (tied embeddings counted once)."""
        return self._count(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses: its top_k experts per sparse layer, and the rest."""
        return self._count(active=True)

    @property
    def expert_params(self) -> int:
        """Parameters in routed experts, all layers (what expert parallelism would split)."""
        return self.num_sparse_layers * self.num_experts * 3 * self.dim * self.moe_ffn_dim

    def feed_forward_params(self, *, active: bool) -> int:
        """Feed-forward parameters over all layers: every expert, or (active) the top_k a token
        uses; routers and dense layers count in both."""
        experts = self.top_k if active else self.num_experts
        sparse = self.num_experts * self.dim + experts * 3 * self.dim * self.moe_ffn_dim
        dense = 3 * self.dim * self.ffn_dim
        num_sparse = self.num_sparse_layers
        return num_sparse * sparse + (self.num_layers - num_sparse) * dense
