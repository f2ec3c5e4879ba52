"""Router metrics and the load-balancing loss of a MoE model's forward_backward calls.

Shapes: N tokens of a micro-batch's datums (datums concatenated, no padding).

The engine holds a `RouterStats` when its model has MoE blocks (none for a dense model: nothing
is recorded, nothing reported, nothing computed). For each forward_backward call it opens a
`RouterCall`: the blocks keep their routing while the call runs (per thread, so the thread
shards' forwards do not mix), each micro-batch's routing of its datums' tokens is taken right
after its forward, and the call's sums (models/common/moe_stats.py) become its metrics,
summed over the data-parallel ranks first so every rank reports the whole call's.

With `router_aux_loss="add"` each micro-batch b also adds
coef * (n_b / n) * aux_b to what it back-propagates (n_b of the call's n datum tokens, over all
ranks; coef is the model config's `router_aux_loss_coef`): the token-weighted mean of the
micro-batches' load-balancing losses, which is the whole call's when it runs as one
micro-batch (transformers adds coef * aux to a mean loss the same way). The reported
`moe/aux_loss` is always the whole call's, however it was split. `loss:sum` and the per-datum
outputs stay the loss function's own.

Datums that carry the sampler's routes also count, per micro-batch, where the top-k the
forward used and the one its router picks differ from them (`RouteAgreement`,
routing_replay.py): the call's `routing/*` metrics, summed over ranks with the router sums in
one collective.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Literal

import torch
from torch import nn

from temper.models.common.moe import Routing
from temper.models.common.moe_stats import (
    RouterSums,
    load_balancing_loss,
    moe_layers,
    select_tokens,
)
from temper.trainer.inputs import MicroBatch, PreparedDatum
from temper.trainer.routing_replay import RouteAgreement
from temper.trainer.sharding import Sharding

AuxLossMode = Literal["report", "add"]


class RouterStats:
    """The MoE blocks of one model and what a forward_backward measures on them."""

    def __init__(self, model: nn.Module, *, mode: AuxLossMode, coef: float) -> None:
        layers = moe_layers(model)
        assert layers, "a dense model has no router statistics"
        self.layers = [index for index, _ in layers]
        self.blocks = [block for _, block in layers]
        self.num_layers = len(model.blocks)
        self.num_experts = self.blocks[0].num_experts
        self.top_k = self.blocks[0].top_k
        self.mode = mode
        self.coef = coef

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """The blocks keep each forward's routing; dropped when the call ends."""
        for block in self.blocks:
            block.keep_routing = True
        try:
            yield
        finally:
            for block in self.blocks:
                block.keep_routing = False
                block.routings.clear()

    def take(self) -> list[Routing]:
        """The calling thread's last forward's routing in every sparse layer, in layer order;
        the blocks no longer hold it."""
        ident = threading.get_ident()
        return [block.routings.pop(ident) for block in self.blocks]

    def discard(self) -> None:
        """Drop the calling thread's routings (a backward's recomputed forward keeps them)."""
        ident = threading.get_ident()
        for block in self.blocks:
            block.routings.pop(ident, None)


class RouterCall:
    """One forward_backward call's router statistics."""

    def __init__(
        self,
        stats: RouterStats,
        prepared: list[PreparedDatum],
        *,
        device: torch.device,
        sharding: Sharding | None,
    ) -> None:
        """Sharded, every rank must open its call together (the "add" mode's token count is
        summed over ranks before any model work)."""
        self.stats = stats
        self.device = device
        self.sharding = sharding
        self.sums: dict[int, RouterSums] = {}
        """Each micro-batch's, by its first datum: summed in datum order whatever order the
        thread shards finish in, so the metrics are the same on every run."""
        self.agreements: dict[int, RouteAgreement] = {}
        """The same, of the micro-batches with datums that carry the sampler's routes."""
        self.num_tokens = float(sum(len(datum.tokens) for datum in prepared))
        if stats.mode == "add" and sharding is not None:
            self.num_tokens = sharding.sum_over_dp(self.num_tokens)

    def take_batch(self, batch: MicroBatch) -> torch.Tensor | None:
        """After `batch`'s forward, on its thread: record its sums; in "add" mode, return its
        weighted load-balancing loss to add to what it back-propagates (None otherwise)."""
        rows_N = batch.token_rows(self.device)
        adding = self.stats.mode == "add"
        with torch.set_grad_enabled(adding and torch.is_grad_enabled()):
            routings = [select_tokens(routing, rows_N) for routing in self.stats.take()]
        self.sums[batch.datums[0].index] = RouterSums.of(routings)
        agreement = _agreement(batch, routings)
        if agreement is not None:
            self.agreements[batch.datums[0].index] = agreement
        if not adding:
            return None
        aux = load_balancing_loss(routings, num_experts=self.stats.num_experts)
        return aux * (self.stats.coef * rows_N.numel() / self.num_tokens)

    def metrics(self) -> dict[str, float]:
        """The call's router metrics as `name:mean` (every data-parallel rank's tokens)."""
        stats = self.stats
        total = RouterSums.zeros(
            num_layers=len(stats.layers), num_experts=stats.num_experts, top_k=stats.top_k
        )
        for key in sorted(self.sums):
            total = total + self.sums[key]
        agreement = RouteAgreement()
        for key in sorted(self.agreements):
            agreement = agreement + self.agreements[key]
        if self.sharding is not None:
            # One collective for both (every rank enters it, with routes or without).
            flat = torch.cat((total.flat(), torch.tensor(agreement.flat(), dtype=torch.float64)))
            flat = self.sharding.sum_tensor_over_dp(flat).double().cpu()
            size = len(agreement.flat())
            total = total.from_flat(flat[:-size])
            agreement = RouteAgreement(*flat[-size:].tolist())
        metrics = total.metrics(layers=stats.layers, num_layers=stats.num_layers)
        metrics |= agreement.metrics()
        return {f"{name}:mean": value for name, value in metrics.items()}


def _agreement(batch: MicroBatch, routings: list[Routing]) -> RouteAgreement | None:
    """How the batch's routed datum tokens' top-k compares with their sampler routes; None
    when no datum of it carries routes."""
    routes = [datum.routes_TLK for datum in batch.datums]
    if all(route is None for route in routes):
        return None
    lengths = [len(datum.tokens) for datum in batch.datums]
    carried_N = torch.cat(
        [torch.full((n,), route is not None) for n, route in zip(lengths, routes, strict=True)]
    )
    rows_M = carried_N.nonzero().squeeze(1).to(routings[0].experts_NK.device)
    with torch.no_grad():
        used_MLK = torch.stack([r.experts_NK.index_select(0, rows_M) for r in routings], dim=1)
        probs_MLE = torch.stack([r.probs_NE.index_select(0, rows_M) for r in routings], dim=1)
    sampler_MLK = torch.cat([route for route in routes if route is not None])
    return RouteAgreement.of(sampler_MLK, used_NLK=used_MLK, probs_NLE=probs_MLE)


# -- a call's micro-batches, as the engine runs them (router None: a dense model) -----------


def recording(router: RouterCall | None) -> contextlib.AbstractContextManager:
    """Around a call's forwards: its MoE blocks keep their routings."""
    return contextlib.nullcontext() if router is None else router.stats.recording()


def objective(loss: torch.Tensor, batch: MicroBatch, router: RouterCall | None) -> torch.Tensor:
    """What a micro-batch back-propagates: its loss, plus (MoE, "add") its weighted
    load-balancing loss; on the thread that ran its forward, right after it."""
    aux = None if router is None else router.take_batch(batch)
    return loss if aux is None else loss + aux


def backpropagate(loss: torch.Tensor, batch: MicroBatch, router: RouterCall | None) -> None:
    objective(loss, batch, router).backward()
    if router is not None:
        router.stats.discard()  # what activation checkpointing's recomputation kept


def call_metrics(router: RouterCall | None) -> dict[str, float]:
    return {} if router is None else router.metrics()
