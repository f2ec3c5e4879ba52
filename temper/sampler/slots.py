"""Per-slot decoding state, kept compact: active sequences always occupy slots 0..B-1.

Shapes: S slots, M most new tokens per slot, X stop token ids per slot.

Everything a decode step touches lives in tensors indexed by slot, so a step updates all
active sequences with a few vectorized ops; Python-side work happens only when a sequence
starts, hits a stop string, or finishes. When a slot frees up, the last active sequence moves
into it (its KV rows are copied by the engine), which keeps the active slots a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from temper.api.types import TopkLogprobs
from temper.sampler import sampling
from temper.sampler.requests import RequestState
from temper.sampler.stopping import StopStringMatcher


@dataclass
class SlotOwner:
    """Who occupies a slot: a request's sample, and its per-sample Python state."""

    state: RequestState
    sample_index: int
    matcher: StopStringMatcher | None
    topk: list[TopkLogprobs] | None
    stopped_by_string: bool = False


class SlotTable:
    def __init__(self, *, num_slots: int, max_new_tokens: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_slots = num_slots
        self.num_active = 0
        self.owners: list[SlotOwner | None] = [None] * num_slots
        self.positions_S = zeros(num_slots, dtype=torch.long)
        """Cache position the slot's next input token is written to (= tokens cached)."""
        self.last_token_S = zeros(num_slots, dtype=torch.long)
        self.num_generated_S = zeros(num_slots, dtype=torch.long)
        self.max_new_S = zeros(num_slots, dtype=torch.long)
        self.seeds_S = zeros(num_slots, dtype=torch.long)
        self.temperature_S = zeros(num_slots, dtype=torch.float32)
        self.top_k_S = zeros(num_slots, dtype=torch.long)
        self.top_p_S = zeros(num_slots, dtype=torch.float32)
        self.stop_ids_SX = torch.full((num_slots, 1), -1, dtype=torch.long, device=device)
        # Host-side copies of what decides which sampling work a step needs, so the engine
        # can skip it without reading tensors back from the device.
        self.greedy: list[bool] = [False] * num_slots
        self.sort_widths: list[int] = [0] * num_slots
        """Per slot, `sampling.sampling_logprobs`' sort_width for that row alone."""
        self.has_stop_ids: list[bool] = [False] * num_slots
        self.tokens_SM = zeros(num_slots, max_new_tokens, dtype=torch.long)
        self.logprobs_SM = zeros(num_slots, max_new_tokens, dtype=torch.float32)
        self._per_slot = (
            self.positions_S,
            self.last_token_S,
            self.num_generated_S,
            self.max_new_S,
            self.seeds_S,
            self.temperature_S,
            self.top_k_S,
            self.top_p_S,
        )

    @property
    def num_free(self) -> int:
        return self.num_slots - self.num_active

    def claim(self, owner: SlotOwner, *, prompt_len: int) -> int:
        """Put a new sample in the next free slot; returns the slot."""
        slot = self.num_active
        self.num_active += 1
        state, params = owner.state, owner.state.params
        self.owners[slot] = owner
        self.positions_S[slot] = prompt_len
        self.num_generated_S[slot] = 0
        self.max_new_S[slot] = state.max_new_tokens
        self.seeds_S[slot] = state.seeds[owner.sample_index]
        self.temperature_S[slot] = params.temperature
        self.top_k_S[slot] = params.top_k
        self.top_p_S[slot] = params.top_p
        self.greedy[slot] = params.temperature == 0
        self.sort_widths[slot] = sampling.row_sort_width(params)
        self.has_stop_ids[slot] = bool(state.stop_token_ids)
        stop_ids = state.stop_token_ids
        if len(stop_ids) > self.stop_ids_SX.shape[1]:
            extra = len(stop_ids) - self.stop_ids_SX.shape[1]
            self.stop_ids_SX = torch.nn.functional.pad(self.stop_ids_SX, (0, extra), value=-1)
        self.stop_ids_SX[slot] = -1
        if stop_ids:
            self.stop_ids_SX[slot, : len(stop_ids)] = torch.tensor(stop_ids)
        return slot

    def move(self, *, source: int, target: int) -> None:
        """Move the sequence in `source` to `target` (state only; the engine moves the KV)."""
        for tensor in (*self._per_slot, self.stop_ids_SX):
            tensor[target] = tensor[source]
        count = int(self.num_generated_S[source])
        self.tokens_SM[target, :count] = self.tokens_SM[source, :count]
        self.logprobs_SM[target, :count] = self.logprobs_SM[source, :count]
        for hints in (self.owners, self.greedy, self.sort_widths, self.has_stop_ids):
            hints[target] = hints[source]
        self.owners[source] = None

    def release_last(self) -> None:
        self.num_active -= 1
        self.owners[self.num_active] = None

    def clear(self) -> None:
        self.num_active = 0
        self.owners = [None] * self.num_slots
