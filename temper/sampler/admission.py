"""How requests enter the engine: validation, then admission into free slots (prefill).

Shapes: B rows, T tokens, D model dim, V vocab, L layers, K kv heads, H head dim.

An object the engine owns (engine.py), kept apart from decoding: it shares the engine's
weights, caches and slot table, and hands back what each round started (the engine draws
their first tokens). While slots are free, waiting requests (oldest first) are prefilled
together, one row per prompt, writing their keys/values straight into the cache. A prompt is
prefilled once however many samples it has: its other samples copy its cached rows, and
samples that find no free slot yet keep a copy of the prompt's cache until they start. Each
sample draws its first token from the prompt's last logits. Requests admitted together with
the same prompt (an episode runner sends each episode of a group as its own request) share
one prefill the same way.

A prompt that extends a finished sequence still in the prefix cache (the next turn of a
multi-turn episode) starts from that sequence's keys/values and prefills only its new tokens
(prefix_cache.py); a round with no such prompt prefills exactly as without the cache.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from temper.sampler.hybrid_backends import extend_backend, prefill_backend
from temper.sampler.kv_cache import KVCache
from temper.sampler.prefix_cache import CachedPrefix, PrefixCache
from temper.sampler.prompt_scoring import (
    prompt_logprobs,
    target_prompt_logprobs,
    topk_prompt_logprobs,
)
from temper.sampler.requests import RequestState, SampleRequest
from temper.sampler.routes import RouteRecorder, recording
from temper.sampler.row_adapters import RowAdapters
from temper.sampler.slots import SlotOwner, SlotTable
from temper.sampler.stopping import StopStringMatcher
from temper.sampler.weight_source import WeightSource
from temper.tokenizer import Tokenizer


@dataclass(frozen=True)
class Admitted:
    """What one admission round started: the samples in slots first_slot.. (to the last
    active), and the logits [B, V] each one draws its first token from."""

    first_slot: int
    logits_BV: torch.Tensor


class Admission:
    """The engine's request validation and slot admission (see the module docstring)."""

    def __init__(
        self,
        *,
        weights: WeightSource,
        cache: KVCache,
        prefix_cache: PrefixCache,
        slots: SlotTable,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_seq_len: int,
        max_prefill_tokens: int,
        entropy: random.Random,
        adapters: RowAdapters,
        routes: RouteRecorder | None = None,
    ) -> None:
        """`entropy`: where unseeded requests draw their seeds; `entropy`, `adapters` and
        `routes` (the route records of a MoE model's engine, if it keeps them) are the
        engine's, shared."""
        self.weights = weights
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.slots = slots
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.entropy = entropy
        self.adapters = adapters
        self.routes = routes
        self.device = weights.device

    def start(self, request: SampleRequest, index: int) -> RequestState:
        """Request `index` of a call, validated (a ValueError naming it), as a state that
        waits for slots."""
        state = RequestState(
            request,
            index=index,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            entropy=self.entropy,
        )
        if state.params.stop_strings and self.tokenizer is None:
            raise ValueError(
                f"request {index}: stop strings need a tokenizer; build the engine with "
                "tokenizer=... or pass stop token ids"
            )
        return state

    def admit(self, waiting: deque[RequestState], *, budget: int) -> Admitted | None:
        """Start waiting requests (oldest first) in free slots, prefilling prompts of at most
        `budget` tokens in all (the first prompt of a round whatever its size while
        `budget` is `max_prefill_tokens`: nothing decodes beside it); None if none starts."""
        starting: list[tuple[RequestState, SlotOwner]] = []  # each sample that starts now
        # (request, its first in `starting`, the cached prefix it extends)
        prefill_rows: list[tuple[RequestState, int, CachedPrefix | None]] = []
        twins: dict[int, RequestState] = {}  # a request's prompt is prefilled by its twin's
        by_prompt: dict[tuple[int, ...], RequestState] = {}  # the rows' shareable prompts
        whole = budget >= self.max_prefill_tokens
        free = self.slots.num_free
        for state in waiting:
            if free == 0:
                break
            if state.num_waiting == 0:
                continue
            key = _sharing_key(state.request)
            if not state.prefilled and key in by_prompt:
                twins[id(state)] = by_prompt[key]
                state.prompt_cache_hit_tokens = len(state.prompt)
            elif not state.prefilled:
                cached = self._cached_prefix(state.request)
                state.prompt_cache_hit_tokens = 0 if cached is None else cached.length
                new_tokens = len(state.prompt) - (cached.length if cached else 0)
                if new_tokens > budget and (prefill_rows or not whole):
                    break  # keep arrival order: later requests wait for the next round
                budget -= new_tokens
                prefill_rows.append((state, len(starting), cached))
                if key is not None:
                    by_prompt[key] = state
            take = min(state.num_waiting, free)
            for _ in range(take):
                starting.append((state, self._owner(state, sample_index=state.num_admitted)))
                state.num_admitted += 1
            free -= take
        if not starting:
            return None
        slots = self.slots.claim(
            [owner for _, owner in starting],
            prompt_lens=[len(state.prompt) for state, _ in starting],
        )
        claims = [(state, slot) for (state, _), slot in zip(starting, slots, strict=True)]
        to_prefill = [(state, slots[first], cached) for state, first, cached in prefill_rows]
        if to_prefill:
            self._prefill(to_prefill)
        prefill_slots = {id(state): slot for state, slot, _ in to_prefill}
        for state, _ in claims:
            twin = twins.get(id(state))
            if twin is not None:  # the same prompt: its twin's logits, routes and cache rows
                state.first_logits_V = twin.first_logits_V
                state.prompt_routes = twin.prompt_routes
                prefill_slots[id(state)] = prefill_slots[id(twin)]
        self._place_prompts(claims, prefill_slots=prefill_slots)
        while waiting and waiting[0].num_waiting == 0:
            waiting.popleft()
        for state, _ in claims:
            if state.num_waiting == 0:
                state.prefix = None  # every sample has started; the copy is no longer needed
        logits_BV = torch.stack([state.first_logits_V for state, _ in claims])
        return Admitted(first_slot=slots.start, logits_BV=logits_BV)

    def _owner(self, state: RequestState, *, sample_index: int) -> SlotOwner:
        matcher = None
        if state.params.stop_strings:
            matcher = StopStringMatcher(state.params.stop_strings, tokenizer=self.tokenizer)
        topk = [] if state.request.topk_sample_logprobs else None
        support = [] if state.params.return_support else None
        return SlotOwner(
            state=state, sample_index=sample_index, matcher=matcher, topk=topk, support=support
        )

    def _cached_prefix(self, request: SampleRequest) -> CachedPrefix | None:
        """The longest cached sequence the request's prompt extends, if it may use one."""
        if not self.prefix_cache.enabled or _needs_prompt_hidden_states(request):
            return None
        return self.prefix_cache.longest(request.prompt, adapter=request.adapter)

    def _prefill(self, rows: list[tuple[RequestState, int, CachedPrefix | None]]) -> None:
        """Prefill each row's prompt into its slot, after its cached prefix if it has one."""
        starts = [0 if cached is None else cached.length for _, _, cached in rows]
        lengths = [len(state.prompt) - starts[row] for row, (state, _, _) in enumerate(rows)]
        tokens_BT = torch.zeros((len(rows), max(lengths)), dtype=torch.long)
        for row, (state, _, _) in enumerate(rows):
            tokens_BT[row, : lengths[row]] = torch.tensor(state.prompt[starts[row] :])
        tokens_BT = tokens_BT.to(self.device)
        slots_B = torch.tensor([slot for _, slot, _ in rows], device=self.device)
        lengths_B = torch.tensor(lengths, device=self.device)
        positions_BT, attention = None, prefill_backend(self.cache, slots_B, lengths_B=lengths_B)
        if any(starts):
            for _, slot, cached in rows:
                if cached is not None:
                    self.cache.write_prefix(slot=slot, prefix=cached.slot_prefix())
                elif self.cache.states is not None:
                    self.cache.states.write_slot(slot, None)  # this row starts from zeros
            starts_B = torch.tensor(starts, device=self.device)
            positions_BT = starts_B[:, None] + torch.arange(tokens_BT.shape[1], device=self.device)
            attention = extend_backend(
                self.cache, slots_B, starts_B=starts_B, lengths_B=lengths_B,
                positions_BT=positions_BT,
            )  # fmt: skip
        model = self.weights.model
        adapter_rows = self.adapters.rows
        self.adapters.use([state.request.adapter for state, _, _ in rows])
        with recording(self.routes, model) as tape:
            hidden_BTD = model.hidden_states(
                tokens_BT, positions_BT=positions_BT, attention=attention
            )
        if tape is not None:
            self._keep_prompt_routes(rows, tape=tape, starts=starts, lengths=lengths)
        last_hidden_BD = hidden_BTD[torch.arange(len(rows), device=self.device), lengths_B - 1]
        logits_BV = model.logits(last_hidden_BD).float()
        # Rows with prompt logprobs never start from a cached prefix (`_cached_prefix`), so
        # theirs are whole prompts from position 0.
        for row, (state, _, _) in enumerate(rows):
            state.first_logits_V = logits_BV[row]
            request, hidden_TD = state.request, hidden_BTD[row, : lengths[row]]
            if adapter_rows is not None:  # prompt scoring: this row's adapter only
                adapter_rows.set(request.adapter)
            if request.prompt_logprobs or request.topk_prompt_logprobs:
                state.prompt_logprobs = prompt_logprobs(model, hidden_TD, tokens_BT[row])
            if request.topk_prompt_logprobs:
                state.topk_prompt_logprobs = topk_prompt_logprobs(
                    model, hidden_TD, k=request.topk_prompt_logprobs
                )
            if request.target_prompt_logprobs is not None:
                state.target_prompt_logprobs = target_prompt_logprobs(
                    model, hidden_TD, request.target_prompt_logprobs
                )

    def _keep_prompt_routes(
        self,
        rows: list[tuple[RequestState, int, CachedPrefix | None]],
        *,
        tape: list[torch.Tensor],
        starts: list[int],
        lengths: list[int],
    ) -> None:
        """Each prefilled prompt's routes: its cached prefix's records, then the prefill's."""
        assert self.routes is not None
        routes_NLK = self.routes.stacked(tape)
        routes_BTLK = routes_NLK.view(len(rows), max(lengths), *routes_NLK.shape[1:])
        for row, (state, _, cached) in enumerate(rows):
            new_TLK = routes_BTLK[row, : lengths[row]]
            if cached is not None and starts[row]:
                new_TLK = torch.cat((cached.routes(), new_TLK))
            state.prompt_routes = new_TLK

    def _place_prompts(
        self, claims: list[tuple[RequestState, int]], *, prefill_slots: dict[int, int]
    ) -> None:
        """Give every newly claimed slot its prompt's cached keys/values (and a hybrid
        model's recurrent states after the prompt)."""
        sources: list[int] = []
        targets: list[int] = []
        length = 0
        for state, slot in claims:
            source = prefill_slots.get(id(state))
            if source == slot:
                continue
            if source is not None:
                sources.append(source)
                targets.append(slot)
                length = max(length, len(state.prompt))
            else:
                self.cache.write_prefix(slot=slot, prefix=state.prefix)
        if sources:
            # One gather for every sample of every new prompt. Positions past a shorter
            # prompt copy padding, which decode overwrites before any query can see it.
            self.cache.copy_slots(sources=sources, targets=targets, length=length)
        for state, slot in claims:
            if state.num_waiting and state.prefix is None:
                state.prefix = self.cache.read_prefix(slot=slot, length=len(state.prompt))


def _needs_prompt_hidden_states(request: SampleRequest) -> bool:
    """Prompt logprobs of any kind: the request's prefill must compute every position."""
    return bool(
        request.prompt_logprobs
        or request.topk_prompt_logprobs
        or request.target_prompt_logprobs is not None
    )


def _sharing_key(request: SampleRequest) -> tuple[int, ...] | None:
    """Requests admitted together with equal keys prefill their prompt once (an episode
    runner sends a group's identical first prompts as separate requests); None: no sharing."""
    if _needs_prompt_hidden_states(request):
        return None
    return (request.adapter, *request.prompt)
