"""Router statistics of a MoE model's forward: the load-balancing loss, and each sparse layer's
load and entropy.

Shapes: L sparse layers, N tokens, E experts, K experts per token.

The statistics are taken over the tokens a caller selects from each `Routing` (the trainer
passes its datums' tokens, never padding), in the order the layers run:

- the load-balancing loss as transformers defines it for Qwen3-MoE
  (`load_balancing_loss_func`, Switch Transformer eqs. 4-6): with f_e the top-k assignments
  to expert e per token (summing to K over the experts; every layer's tokens together) and P_e
  the mean router probability of e over the same tokens, aux = E * sum_e f_e * P_e. Even use
  (f_e = K / E, P_e = 1 / E) gives K, every token on the same K experts E; it can dip a little
  below K when an expert's tokens are the ones least sure of it.
- per layer, the largest expert's load: its assignments over the even share K * N / E (1.0
  balanced, E / K when every token picks it), and the mean router entropy per token in nats
  (ln E for a uniform router, 0 for a one-hot one).

`RouterSums` holds the sums these come from; sums add up over micro-batches, threads and
ranks, so the statistics of a whole call are exact however it was split. Nothing here touches
the model: `moe_layers` finds the blocks and the caller collects their routings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from temper.models.common.moe import MoE, Routing

METRIC_PREFIX = "moe/"
"""Every router metric's name starts with this."""


def moe_layers(model: nn.Module) -> list[tuple[int, MoE]]:
    """(block index, MoE block) of every sparse layer of a decoder, in layer order; empty for
    a dense model."""
    return [
        (index, block.feed_forward)
        for index, block in enumerate(model.blocks)
        if isinstance(block.feed_forward, MoE)
    ]


def select_tokens(routing: Routing, rows_N: torch.Tensor) -> Routing:
    """The routing of the tokens at `rows_N` (int64 rows of the flattened forward)."""
    return Routing(
        probs_NE=routing.probs_NE.index_select(0, rows_N),
        experts_NK=routing.experts_NK.index_select(0, rows_N),
    )


def load_balancing_loss(routings: Sequence[Routing], *, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over every layer's tokens together (transformers'
    `load_balancing_loss_func`); differentiable through the router probabilities, fp32."""
    assignments_E = torch.zeros(num_experts, device=routings[0].probs_NE.device)
    probs_E = torch.zeros_like(assignments_E)
    num_rows = 0
    for routing in routings:
        experts = routing.experts_NK.reshape(-1)
        assignments_E = assignments_E + torch.bincount(experts, minlength=num_experts).float()
        probs_E = probs_E + routing.probs_NE.sum(dim=0)
        num_rows += routing.probs_NE.shape[0]
    return num_experts * torch.sum((assignments_E / num_rows) * (probs_E / num_rows))


@dataclass(frozen=True)
class RouterSums:
    """Sums over tokens of the routings of L sparse layers (float64, detached)."""

    num_tokens: float
    """Tokens routed in each layer."""
    top_k: int
    assignments_LE: torch.Tensor
    """Top-k assignments to each expert."""
    probs_LE: torch.Tensor
    """Router probabilities of each expert."""
    entropy_L: torch.Tensor
    """Router entropy (nats)."""

    @classmethod
    def of(cls, routings: Sequence[Routing]) -> RouterSums:
        """The sums of one forward's routings (one per sparse layer, the same tokens each)."""
        num_experts = routings[0].probs_NE.shape[1]
        assignments, probs, entropies = [], [], []
        with torch.no_grad():
            # Layer by layer: a float64 copy of every layer's probabilities at once would be
            # [L, N, E] (hundreds of MB for a 48-layer model over a long micro-batch).
            for routing in routings:
                probs_NE = routing.probs_NE.double()
                experts = routing.experts_NK.reshape(-1)
                assignments.append(torch.bincount(experts, minlength=num_experts).double())
                probs.append(probs_NE.sum(dim=0))
                entropies.append(torch.special.entr(probs_NE).sum())
            return cls(
                num_tokens=float(routings[0].probs_NE.shape[0]),
                top_k=routings[0].experts_NK.shape[1],
                assignments_LE=torch.stack(assignments).cpu(),
                probs_LE=torch.stack(probs).cpu(),
                entropy_L=torch.stack(entropies).cpu(),
            )

    @classmethod
    def zeros(cls, *, num_layers: int, num_experts: int, top_k: int) -> RouterSums:
        """No tokens yet (what sums start from)."""
        return cls(
            num_tokens=0.0,
            top_k=top_k,
            assignments_LE=torch.zeros(num_layers, num_experts, dtype=torch.float64),
            probs_LE=torch.zeros(num_layers, num_experts, dtype=torch.float64),
            entropy_L=torch.zeros(num_layers, dtype=torch.float64),
        )

    def __add__(self, other: RouterSums) -> RouterSums:
        return RouterSums(
            num_tokens=self.num_tokens + other.num_tokens,
            top_k=self.top_k,
            assignments_LE=self.assignments_LE + other.assignments_LE,
            probs_LE=self.probs_LE + other.probs_LE,
            entropy_L=self.entropy_L + other.entropy_L,
        )

    def flat(self) -> torch.Tensor:
        """Everything in one float64 vector (to sum over ranks in one collective)."""
        token_count = torch.tensor([self.num_tokens], dtype=torch.float64)
        parts = (token_count, self.assignments_LE.reshape(-1), self.probs_LE.reshape(-1))
        return torch.cat((*parts, self.entropy_L))

    def from_flat(self, flat: torch.Tensor) -> RouterSums:
        """Sums shaped like these, read from a `flat()` vector (summed over ranks)."""
        flat = flat.double().cpu()
        num_layers, num_experts = self.assignments_LE.shape
        size = num_layers * num_experts
        return RouterSums(
            num_tokens=float(flat[0]),
            top_k=self.top_k,
            assignments_LE=flat[1 : 1 + size].view(num_layers, num_experts),
            probs_LE=flat[1 + size : 1 + 2 * size].view(num_layers, num_experts),
            entropy_L=flat[1 + 2 * size :],
        )

    @property
    def aux_loss(self) -> float:
        """The load-balancing loss of all these tokens (`load_balancing_loss` of them)."""
        num_experts = self.assignments_LE.shape[1]
        num_rows = self.num_tokens * self.assignments_LE.shape[0]
        share_E = self.assignments_LE.sum(dim=0) / num_rows
        probs_E = self.probs_LE.sum(dim=0) / num_rows
        return float(num_experts * (share_E * probs_E).sum())

    def metrics(self, *, layers: Sequence[int], num_layers: int) -> dict[str, float]:
        """`moe/aux_loss`, the largest load and mean entropy over layers (`moe/max_load`,
        `moe/entropy`), then each layer's (`moe/layer_07/max_load`, `moe/layer_07/entropy`;
        `layers` are the block indices of the sparse layers, numbered with as many digits as
        the model's `num_layers` needs, so they sort in order)."""
        num_experts = self.assignments_LE.shape[1]
        even_share = self.top_k * self.num_tokens / num_experts
        max_load_L = self.assignments_LE.max(dim=1).values / even_share
        entropy_L = self.entropy_L / self.num_tokens
        metrics = {
            f"{METRIC_PREFIX}aux_loss": self.aux_loss,
            f"{METRIC_PREFIX}max_load": float(max_load_L.max()),
            f"{METRIC_PREFIX}entropy": float(entropy_L.mean()),
        }
        width = len(str(num_layers - 1))
        for index, max_load, entropy in zip(layers, max_load_L, entropy_L, strict=True):
            metrics[f"{METRIC_PREFIX}layer_{index:0{width}d}/max_load"] = float(max_load)
            metrics[f"{METRIC_PREFIX}layer_{index:0{width}d}/entropy"] = float(entropy)
        return metrics


def router_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """The router metrics of a forward_backward's output metrics, without their reduction
    suffix (`moe/aux_loss:mean` -> `moe/aux_loss`); empty for a dense model."""
    return {
        name.partition(":")[0]: float(value)
        for name, value in metrics.items()
        if name.startswith(METRIC_PREFIX)
    }
