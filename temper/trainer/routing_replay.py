"""Routing replay: a MoE model's tokens through the experts the sampler routed them to.

Shapes: T tokens of a datum, N datum tokens of a micro-batch (datums concatenated), R rows of
its flattened forward (B * T padded, or the packed layout's positions), L sparse layers, K
experts per token, E experts.

A token's logprob depends on which experts its router picked, and tiny numeric differences
between sampler and trainer (another kernel, dtype or batch) flip near-tied top-k choices: the
trainer then scores some tokens through other experts than the ones that produced them, and
their importance ratios are wrong. With `routing_replay="sampler"` every datum carries the
routes the sampler recorded (`Datum.routed_experts`, sampler/routes.py) and each micro-batch's
forward (and a backward's recomputation of it) sends each datum token to those experts, each
weighted by the trainer router's probability of it, renormalized as the model does
(models/common/moe.py): the selection is the sampler's, the weights stay differentiable, so
the router still learns. Padding rows keep the router's own choice (they reach no loss).
Every loss sees the replayed forward; nothing else changes.

A datum's routes must cover its model_input exactly ([T, L, K], ids in 0..E-1, K distinct per
token): anything else is refused before the model runs, naming the datum and the field. A
shared prefix (shared_prefix.py) runs once for several datums, so with replay it is shared
only as far as their routes agree too.

`RouteAgreement` counts, over the datum tokens that carry routes (with or without replay),
how often the top-k the trainer used, and its own router's top-k, differ from the sampler's
(as sets): the `routing/*` metrics of forward_backward (router_stats.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from temper.api.types import Datum, RoutingReplay
from temper.config.checks import check_choice
from temper.models.common.moe import ReplayedRoutes
from temper.models.common.moe_stats import moe_layers

ROUTING_REPLAY_CHOICES = ("off", "sampler")
METRIC_PREFIX = "routing/"


@dataclass(frozen=True)
class RouteShape:
    """What a datum's routes must look like for a model."""

    num_layers: int
    """Sparse layers."""
    top_k: int
    num_experts: int

    @classmethod
    def of(cls, model: nn.Module) -> RouteShape | None:
        """None for a dense model."""
        layers = moe_layers(model)
        if not layers:
            return None
        block = layers[0][1]
        return cls(num_layers=len(layers), top_k=block.top_k, num_experts=block.num_experts)


def check_replay(routing_replay: RoutingReplay, *, shape: RouteShape | None) -> None:
    """A ValueError for a replay mode that is not one, or replay on a dense model."""
    check_choice(routing_replay, field="routing_replay", choices=ROUTING_REPLAY_CHOICES)
    if routing_replay != "off" and shape is None:
        raise ValueError(
            f"routing_replay={routing_replay!r} replays a MoE model's routes, but the model "
            "has no MoE layers; use routing_replay='off'"
        )


def datum_routes(
    data: Sequence[Datum],
    *,
    shape: RouteShape | None,
    routing_replay: RoutingReplay,
) -> list[torch.Tensor | None]:
    """Each datum's routes as int64 [T, L, K] (None where it carries none), checked against
    its model_input and the model; a ValueError naming the datum and the field otherwise."""
    routes: list[torch.Tensor | None] = []
    for index, datum in enumerate(data):
        where = f"datum {index}: routed_experts"
        given = datum.routed_experts
        if given is None:
            if routing_replay == "sampler":
                raise ValueError(
                    f"{where} is missing; routing_replay='sampler' replays the routes every "
                    "datum carries (a sampled sequence's routed_experts, recorded by a sampler "
                    "with record_routes)"
                )
            routes.append(None)
            continue
        if shape is None:
            raise ValueError(f"{where} given, but the model has no MoE layers to route")
        length = datum.model_input.length
        expected = (length, shape.num_layers, shape.top_k)
        if given.shape != expected:
            raise ValueError(
                f"{where} has shape {list(given.shape)}, but the datum has {length} tokens "
                f"and the model {shape.num_layers} MoE layers of top_k {shape.top_k}; "
                f"expected {list(expected)} (a route per model_input token)"
            )
        routes_TLK = given.to_torch()
        _check_ids(routes_TLK, num_experts=shape.num_experts, where=where)
        routes.append(routes_TLK)
    return routes


def _check_ids(routes_TLK: torch.Tensor, *, num_experts: int, where: str) -> None:
    bad_TLK = (routes_TLK < 0) | (routes_TLK >= num_experts)
    if bool(bad_TLK.any()):
        token, layer, _ = (int(i) for i in bad_TLK.nonzero()[0])
        raise ValueError(
            f"{where}: token {token}, MoE layer {layer} names expert "
            f"{int(routes_TLK[bad_TLK][0])}; valid ids are 0..{num_experts - 1}"
        )
    sorted_TLK = routes_TLK.sort(dim=-1).values
    repeated_TL = (sorted_TLK[..., 1:] == sorted_TLK[..., :-1]).any(dim=-1)
    if bool(repeated_TL.any()):
        token, layer = (int(i) for i in repeated_TL.nonzero()[0])
        raise ValueError(
            f"{where}: token {token}, MoE layer {layer} names an expert twice "
            f"({routes_TLK[token, layer].tolist()}); a token's top-k experts are distinct"
        )


class RouteReplay:
    """The MoE blocks of one model, and the routes one micro-batch replays on them."""

    def __init__(self, model: nn.Module) -> None:
        self.blocks = [block for _, block in moe_layers(model)]
        assert self.blocks, "a dense model has no routes to replay"

    @contextlib.contextmanager
    def replaying(
        self, routes: Sequence[torch.Tensor], *, rows_N: torch.Tensor, num_rows: int
    ) -> Iterator[None]:
        """Around a micro-batch's forward and backward on the calling thread: datum token n
        (row rows_N[n] of the forward's R rows) goes to routes[...][n]'s experts in every
        sparse layer; the other rows are routed by the router."""
        device = rows_N.device
        routes_NLK = torch.cat(list(routes)).to(device)
        experts_RLK = routes_NLK.new_zeros((num_rows, *routes_NLK.shape[1:]))
        experts_RLK[rows_N] = routes_NLK  # a shared prefix's rows: equal routes, any writer
        given_R1 = torch.zeros((num_rows, 1), dtype=torch.bool, device=device)
        given_R1[rows_N] = True
        thread = threading.get_ident()
        for layer, block in enumerate(self.blocks):
            block.replays[thread] = ReplayedRoutes(
                experts_NK=experts_RLK[:, layer], given_N1=given_R1
            )
        try:
            yield
        finally:
            for block in self.blocks:
                block.replays.pop(thread, None)


@dataclass(frozen=True)
class RouteAgreement:
    """Counts over datum tokens with routes: where the trainer's top-k (as used, and as its
    router would pick) differs from the sampler's, in any sparse layer or per layer."""

    num_tokens: float = 0.0
    num_routes: float = 0.0
    """Token-layer pairs (num_tokens * L)."""
    tokens_differ: float = 0.0
    routes_differ: float = 0.0
    live_tokens_differ: float = 0.0
    live_routes_differ: float = 0.0

    @classmethod
    def of(
        cls, sampler_NLK: torch.Tensor, *, used_NLK: torch.Tensor, probs_NLE: torch.Tensor
    ) -> RouteAgreement:
        """The counts of N tokens: the sampler's experts, the ones the forward used, and its
        router's probabilities (whose top-k is the router's own choice)."""
        with torch.no_grad():
            sampler_NLK = sampler_NLK.to(used_NLK.device).sort(dim=-1).values
            live_NLK = probs_NLE.topk(sampler_NLK.shape[-1], dim=-1).indices
            differ_NL = (used_NLK.sort(dim=-1).values != sampler_NLK).any(dim=-1)
            live_differ_NL = (live_NLK.sort(dim=-1).values != sampler_NLK).any(dim=-1)
            return cls(
                num_tokens=float(differ_NL.shape[0]),
                num_routes=float(differ_NL.numel()),
                tokens_differ=float(differ_NL.any(dim=1).sum()),
                routes_differ=float(differ_NL.sum()),
                live_tokens_differ=float(live_differ_NL.any(dim=1).sum()),
                live_routes_differ=float(live_differ_NL.sum()),
            )

    def __add__(self, other: RouteAgreement) -> RouteAgreement:
        return RouteAgreement(*(a + b for a, b in zip(self.flat(), other.flat(), strict=True)))

    def flat(self) -> list[float]:
        return [
            self.num_tokens,
            self.num_routes,
            self.tokens_differ,
            self.routes_differ,
            self.live_tokens_differ,
            self.live_routes_differ,
        ]

    def metrics(self) -> dict[str, float]:
        """`routing/topk_diff` (share of tokens whose top-k in some sparse layer differs from
        the sampler's), `routing/topk_diff_layers` (share of token-layer pairs), and the same
        for the trainer router's own top-k (`routing/router_topk_diff...`: what the trainer
        would use without replay); none without routed tokens."""
        if not self.num_tokens:
            return {}
        return {
            f"{METRIC_PREFIX}topk_diff": self.tokens_differ / self.num_tokens,
            f"{METRIC_PREFIX}topk_diff_layers": self.routes_differ / self.num_routes,
            f"{METRIC_PREFIX}router_topk_diff": self.live_tokens_differ / self.num_tokens,
            f"{METRIC_PREFIX}router_topk_diff_layers": self.live_routes_differ / self.num_routes,
        }
