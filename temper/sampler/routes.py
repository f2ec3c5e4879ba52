"""The sampler's records of a MoE model's routing: which experts each token went to.

Shapes: S slots, M most new tokens per slot, N tokens of one forward, P prompt tokens, L sparse
(MoE) layers, K experts per token.

With `SamplerEngine.Config.record_routes` the engine keeps, for every token it runs through the
model, the top-k experts of each sparse layer, and hands a finished sequence its routes as
`SampledSequence.routed_experts`: its prompt's tokens, then each sampled token that was fed
back (all but the last), the positions of the training datum `prompt + tokens[:-1]`. A trainer
replays them (trainer/routing_replay.py), so it computes each token through the experts the
sampler used.

Where the routes come from is the forward that computed the token's keys and values: the
prefill of its prompt (a prompt prefilled once for several samples gives each the same
routes), the decode step that fed a sampled token, and for a prompt that extends a cached
sequence (prefix_cache.py), the cached sequence's own records (stored with its keys and
values), so a multi-turn episode's earlier turns keep the routes they were decoded with.

A forward records through the MoE blocks' per-thread tapes (models/common/moe.py): every
forward a thread runs while its tape is set appends its experts, in layer order. The decode
twins of the CPU wing run the model's own MoE code on shallow copies of its blocks, which share
the blocks' tapes, and decode shards record on their own threads, so every decode path records
what it computed. Helper processes (cpu/process_split.py) run engines of their own that record
the same way and return the routes with the sequences.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from temper.api.types import RoutedExperts
from temper.models.common.moe import MoE
from temper.models.common.moe_stats import moe_layers
from temper.sampler.kv_cache_memory import zeros


def recording(
    routes: RouteRecorder | None, model: nn.Module
) -> contextlib.AbstractContextManager[list[torch.Tensor] | None]:
    """`routes.recording(model)`, or for an engine without records a block yielding None."""
    return contextlib.nullcontext() if routes is None else routes.recording(model)


class RouteRecorder:
    """The routes of the engine's sequences in flight: each slot's decoded tokens' routes
    (`decode_SMLK`), prompts' routes on their request state (admission.py)."""

    def __init__(
        self, model: nn.Module, *, num_slots: int, max_new_tokens: int, device: torch.device
    ) -> None:
        layers = moe_layers(model)
        assert layers, "a dense model has no routes"
        block = layers[0][1]
        self.num_layers, self.top_k, self.num_experts = len(layers), block.top_k, block.num_experts
        # The compact dtype RoutedExperts keeps them in (expert ids < 256: one byte each).
        self.dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        # Zero pages on CPU until a slot decodes that far (kv_cache_memory.zeros).
        self.decode_SMLK = zeros(
            (num_slots, max_new_tokens, self.num_layers, self.top_k),
            dtype=self.dtype,
            device=device,
        )
        """Slot s's route of its generated token i (fed back at decode step i + 1) at [s, i]."""

    @contextlib.contextmanager
    def recording(self, model: nn.Module) -> Iterator[list[torch.Tensor]]:
        """Around one forward of `model` on the calling thread: the experts_NK of each of its
        sparse layers, in layer order, appended to the list yielded."""
        blocks: Sequence[MoE] = [block for _, block in moe_layers(model)]
        tape: list[torch.Tensor] = []
        thread = threading.get_ident()
        for block in blocks:
            block.tapes[thread] = tape
        try:
            yield tape
        finally:
            for block in blocks:
                block.tapes.pop(thread, None)

    def stacked(self, tape: list[torch.Tensor]) -> torch.Tensor:
        """A forward's tape as [N, L, K] ids in the compact dtype."""
        assert len(tape) == self.num_layers, (len(tape), self.num_layers)
        return torch.stack(tape, dim=1).to(self.dtype)

    def store_decoded(self, rows: range, *, counts_B: torch.Tensor, tape: list[torch.Tensor]):
        """A decode step's routes for slots `rows`, whose fed tokens are their generated
        tokens counts_B - 1."""
        routes_BLK = self.stacked(tape)
        slots_B = torch.arange(rows.start, rows.stop, device=routes_BLK.device)
        self.decode_SMLK[slots_B, counts_B - 1] = routes_BLK

    def move(self, *, sources: list[int], targets: list[int], count: int) -> None:
        """Slots move down (engine `_finish`): their first `count` decoded routes go along."""
        self.decode_SMLK[targets, :count] = self.decode_SMLK[sources, :count]

    def sequence(self, prompt_PLK: torch.Tensor, *, slot: int, num_generated: int) -> torch.Tensor:
        """A finished sequence's routes [P + num_generated - 1, L, K]: its prompt's, then
        every generated token's but the last (never fed back)."""
        decoded = self.decode_SMLK[slot, : num_generated - 1]
        return torch.cat((prompt_PLK, decoded))

    def routed_experts(self, routes_TLK: torch.Tensor) -> RoutedExperts:
        return RoutedExperts.from_torch(routes_TLK, num_experts=self.num_experts)
