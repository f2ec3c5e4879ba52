"""How finished sequences leave the engine: their results, their cached prefixes, and the
compaction that keeps the active slots a prefix; plus the per-token Python work (stop
strings, top-k logprobs, supports) of the rows that ask for it.

Shapes: S slots, N finished sequences, B rows, V vocab, L layers, F finished sequences, K kv
heads, C positions, H head dim, T tokens.

An object the engine owns (engine.py), sharing its slot table and caches.
"""

from __future__ import annotations

import torch

import temper.sampler.sampling as sampling
from temper.api.types import SampledSequence
from temper.sampler.kv_cache import KVCache
from temper.sampler.prefix_cache import PrefixCache
from temper.sampler.routes import RouteRecorder
from temper.sampler.slots import SlotTable
from temper.sampler.support import kept_ids


class Retirement:
    def __init__(
        self,
        *,
        slots: SlotTable,
        cache: KVCache,
        prefix_cache: PrefixCache,
        routes: RouteRecorder | None,
    ) -> None:
        self.slots = slots
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.routes = routes
        self.device = slots.positions_S.device

    def per_token_python_work(
        self,
        first_slot: int,
        tokens_B: torch.Tensor,
        logprobs_BV: torch.Tensor,
        stopped_B: torch.Tensor,
    ) -> None:
        """Stop strings and top-k logprobs: only for the rows that asked for them."""
        tokens = tokens_B.tolist()
        for row, token in enumerate(tokens):
            owner = self.slots.owners[first_slot + row]
            if owner.topk is not None:
                k = owner.state.request.topk_sample_logprobs
                ids_K, values_K = sampling.topk_logprobs(logprobs_BV[row : row + 1], k)
                owner.topk.append(list(zip(ids_K[0].tolist(), values_K[0].tolist(), strict=True)))
            if owner.support is not None:
                owner.support.append(kept_ids(logprobs_BV[row]))
            if owner.matcher is not None and owner.matcher.push(token):
                stopped_B[row] = True

    def finish(self, finished: list[int], *, stopped: list[bool]) -> None:
        """Hand the sequences in slots `finished` (ascending) their results, then keep the
        active slots a prefix: the highest running sequences move down into the freed slots
        below the new count (their state and KV rows, in one gather each)."""
        slots = self.slots
        finished_N = torch.tensor(finished, device=self.device)
        counts = slots.num_generated_S[finished_N].tolist()
        width = max(counts)
        tokens = slots.tokens_SM[finished_N, :width].tolist()
        logprobs = slots.logprobs_SM[finished_N, :width].tolist()
        routes, routed = [None] * len(finished), [None] * len(finished)
        if self.routes is not None:
            routes = [
                self.routes.sequence(
                    slots.owners[slot].state.prompt_routes, slot=slot, num_generated=count
                )
                for slot, count in zip(finished, counts, strict=True)
            ]
            routed = [self.routes.routed_experts(routes_TLK) for routes_TLK in routes]
        for slot, count, row_tokens, row_logprobs, row_stopped, row_routed in zip(
            finished, counts, tokens, logprobs, stopped, routed, strict=True
        ):
            owner = slots.owners[slot]
            owner.state.sequences[owner.sample_index] = SampledSequence(
                tokens=row_tokens[:count],
                logprobs=row_logprobs[:count],
                stop_reason="stop" if row_stopped else "length",
                topk_logprobs=owner.topk,
                routed_experts=row_routed,
                support=owner.support,
            )
            if owner.needs_python:
                slots.num_python_rows -= 1
        if self.prefix_cache.enabled:
            self._keep_prefixes(finished, tokens=tokens, counts=counts, routes=routes)
        remaining = slots.num_active - len(finished)
        holes = [slot for slot in finished if slot < remaining]
        if holes:
            done = set(finished)
            movers = [slot for slot in range(remaining, slots.num_active) if slot not in done]
            length = int(slots.positions_S[movers].max())
            self.cache.copy_slots(sources=movers, targets=holes, length=length)
            if self.routes is not None:
                count = int(slots.num_generated_S[movers].max())
                self.routes.move(sources=movers, targets=holes, count=count)
            slots.move(sources=movers, targets=holes)
        slots.release_last(len(finished))

    def _keep_prefixes(
        self,
        finished: list[int],
        *,
        tokens: list[list[int]],
        counts: list[int],
        routes: list[torch.Tensor | None],
    ) -> None:
        """Store the finished sequences' keys/values (recorded routes, a hybrid model's
        recurrent states) in the prefix cache: the prompt and every sampled token but the
        last (never fed through the model), in one gather."""
        states = [self.slots.owners[slot].state for slot in finished]
        sequences = [
            [*state.prompt, *row_tokens[: count - 1]]
            for state, row_tokens, count in zip(states, tokens, counts, strict=True)
        ]
        k_LFKCH, v_LFKCH = self.cache.read_prefixes(slots=finished, length=max(map(len, sequences)))
        adapters = [state.request.adapter for state in states]
        pool = self.cache.states
        self.prefix_cache.store(
            sequences,
            adapters=adapters,
            k_LFKCH=k_LFKCH,
            v_LFKCH=v_LFKCH,
            routes=None if self.routes is None else routes,
            states=None if pool is None else pool.read(finished),  # after each whole sequence
        )
