"""How requests enter the engine: validation, then admission into free slots (prefill).

Shapes: B rows, T tokens, D model dim, V vocab, L layers, K kv heads, H head dim.

The admission role of `SamplerEngine` (engine.py), kept apart from decoding. While slots are
free, waiting requests (oldest first) are prefilled together, one row per prompt, writing
their keys/values straight into the cache. A prompt is prefilled once however many samples
it has: its other samples copy its cached rows, and samples that find no free slot yet keep a
copy of the prompt's cache until they start. Each sample draws its first token from the
prompt's last logits.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import torch
from torch import nn

from temper.sampler.kv_cache import KVCache, PrefillAttention
from temper.sampler.prompt_scoring import (
    prompt_logprobs,
    target_prompt_logprobs,
    topk_prompt_logprobs,
)
from temper.sampler.requests import RequestState, SampleRequest
from temper.sampler.slots import SlotOwner, SlotTable
from temper.sampler.stopping import StopStringMatcher
from temper.tokenizer import Tokenizer


class Admission:
    """Mixin: the engine's request validation and slot admission (see the module docstring)."""

    config: Any
    cache: KVCache
    slots: SlotTable
    tokenizer: Tokenizer | None
    device: torch.device
    vocab_size: int
    model: nn.Module
    _entropy: random.Random
    _num_python_rows: int
    _adapter_rows: Any  # a multi-LoRA model's AdapterRows, else None
    _one_adapter: int | None  # the slot of every request of the call, if they share one
    # and the engine's decoding role: _draw_and_record(first_slot, logits_BV)

    def _start(self, request: SampleRequest, index: int) -> RequestState:
        state = RequestState(
            request,
            index=index,
            vocab_size=self.vocab_size,
            max_seq_len=self.config.max_seq_len,
            eos_token_id=getattr(self.tokenizer, "eos_token_id", None),
            entropy=self._entropy,
        )
        if state.params.stop_strings and self.tokenizer is None:
            raise ValueError(
                f"request {index}: stop strings need a tokenizer; build the engine with "
                "tokenizer=... or pass stop token ids"
            )
        return state

    def _admit(self, waiting: deque[RequestState]) -> None:
        starting: list[tuple[RequestState, SlotOwner]] = []  # each sample that starts now
        prefill_rows: list[tuple[RequestState, int]] = []  # (request, its first in `starting`)
        budget, free = self.config.max_prefill_tokens, self.slots.num_free
        for state in waiting:
            if free == 0:
                break
            if state.num_waiting == 0:
                continue
            if not state.prefilled:
                if prefill_rows and len(state.prompt) > budget:
                    break  # keep arrival order: later requests wait for the next round
                budget -= len(state.prompt)
                prefill_rows.append((state, len(starting)))
            take = min(state.num_waiting, free)
            for _ in range(take):
                starting.append((state, self._owner(state, sample_index=state.num_admitted)))
                state.num_admitted += 1
            free -= take
        slots = self.slots.claim(
            [owner for _, owner in starting],
            prompt_lens=[len(state.prompt) for state, _ in starting],
        )
        claims = [(state, slot) for (state, _), slot in zip(starting, slots, strict=True)]
        to_prefill = [(state, slots[first]) for state, first in prefill_rows]
        if to_prefill:
            self._prefill(to_prefill)
        self._place_prompts(claims, prefill_slots={id(s): slot for s, slot in to_prefill})
        while waiting and waiting[0].num_waiting == 0:
            waiting.popleft()
        for state, _ in claims:
            if state.num_waiting == 0:
                state.prefix = None  # every sample has started; the copy is no longer needed
        logits_BV = torch.stack([state.first_logits_V for state, _ in claims])
        self._draw_and_record(slots.start, logits_BV)

    def _owner(self, state: RequestState, *, sample_index: int) -> SlotOwner:
        matcher = None
        if state.params.stop_strings:
            matcher = StopStringMatcher(state.params.stop_strings, tokenizer=self.tokenizer)
        topk = [] if state.request.topk_sample_logprobs else None
        owner = SlotOwner(state=state, sample_index=sample_index, matcher=matcher, topk=topk)
        if matcher is not None or topk is not None:
            self._num_python_rows += 1
        return owner

    def _prefill(self, rows: list[tuple[RequestState, int]]) -> None:
        lengths = [len(state.prompt) for state, _ in rows]
        tokens_BT = torch.zeros((len(rows), max(lengths)), dtype=torch.long)
        for row, (state, _) in enumerate(rows):
            tokens_BT[row, : lengths[row]] = torch.tensor(state.prompt)
        tokens_BT = tokens_BT.to(self.device)
        slots_B = torch.tensor([slot for _, slot in rows], device=self.device)
        model = self.model
        adapter_rows = self._adapter_rows
        if adapter_rows is not None:
            index = [state.request.adapter for state, _ in rows]
            one = self._one_adapter
            adapter_rows.set(one if one is not None else torch.tensor(index, device=self.device))
        hidden_BTD = model.hidden_states(tokens_BT, attention=PrefillAttention(self.cache, slots_B))
        last_B = torch.tensor(lengths, device=self.device) - 1
        last_hidden_BD = hidden_BTD[torch.arange(len(rows), device=self.device), last_B]
        logits_BV = model.logits(last_hidden_BD).float()
        for row, (state, _) in enumerate(rows):
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

    def _place_prompts(
        self, claims: list[tuple[RequestState, int]], *, prefill_slots: dict[int, int]
    ) -> None:
        """Give every newly claimed slot its prompt's cached keys/values."""
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
                k_LKTH, v_LKTH = state.prefix
                self.cache.write_prefix(slot=slot, k_LKTH=k_LKTH, v_LKTH=v_LKTH)
        if sources:
            # One gather for every sample of every new prompt. Positions past a shorter
            # prompt copy padding, which decode overwrites before any query can see it.
            self.cache.copy_slots(sources=sources, targets=targets, length=length)
        for state, slot in claims:
            if state.num_waiting and state.prefix is None:
                state.prefix = self.cache.read_prefix(slot=slot, length=len(state.prompt))
