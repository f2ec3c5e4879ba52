"""Per-slot decoding state, kept compact: active sequences always occupy slots 0..B-1.

Shapes: S slots, M most new tokens per slot, X stop token ids per slot.

Everything a decode step touches lives in tensors indexed by slot, so a step updates all
active sequences with a few vectorized ops; Python-side work happens only when a sequence
starts, hits a stop string, or finishes. When a slot frees up, the last active sequence moves
into it (its KV rows are copied by the engine), which keeps the active slots a prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

import temper.sampler.sampling as sampling
from temper.api.types import TopkLogprobs
from temper.sampler.requests import RequestState
from temper.sampler.stopping import StopStringMatcher


@dataclass
class SlotOwner:
    """Who occupies a slot: a request's sample, and its per-sample Python state."""

    state: RequestState
    sample_index: int
    matcher: StopStringMatcher | None
    topk: list[TopkLogprobs] | None
    support: list[list[int]] | None = None
    """The kept token ids of each drawn position (`SamplingParams.return_support`)."""
    stopped_by_string: bool = False

    @property
    def needs_python(self) -> bool:
        """Per-token Python work: stop strings, top-k logprobs, kept supports."""
        return self.matcher is not None or self.topk is not None or self.support is not None


class SlotTable:
    def __init__(self, *, num_slots: int, max_new_tokens: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.num_slots = num_slots
        self.num_active = 0
        self.owners: list[SlotOwner | None] = [None] * num_slots
        self.num_python_rows = 0
        """Active slots whose owner `needs_python` (the engine counts them down as they
        finish)."""
        self.num_reserved = 0
        """The last slot is reserved (1) while a long prompt is prefilled into it in chunks
        (chunked_prefill.py); no sequence is claimed into it meanwhile."""
        self.positions_S = zeros(num_slots, dtype=torch.long)
        """Cache position the slot's next input token is written to (= tokens cached)."""
        self.last_token_S = zeros(num_slots, dtype=torch.long)
        self.num_generated_S = zeros(num_slots, dtype=torch.long)
        self.max_new_S = zeros(num_slots, dtype=torch.long)
        self.stream_starts_S = zeros(num_slots, dtype=torch.long)
        """Each sequence's seed, mixed once (`sampling.stream_starts`): its draws' stream."""
        self.temperature_S = zeros(num_slots, dtype=torch.float32)
        self.top_k_S = zeros(num_slots, dtype=torch.long)
        self.top_p_S = zeros(num_slots, dtype=torch.float32)
        self.adapter_S = zeros(num_slots, dtype=torch.long)
        """The adapter slot of a multi-LoRA model each sequence samples with."""
        self.stop_ids_SX = torch.full((num_slots, 1), -1, dtype=torch.long, device=device)
        # Host-side copies of what decides which sampling work a step needs, so the engine
        # can skip it without reading tensors back from the device.
        self.greedy: list[bool] = [False] * num_slots
        self.sort_widths: list[int] = [0] * num_slots
        """Per slot, `sampling.sampling_logprobs`' sort_width for that row alone."""
        self.has_stop_ids: list[bool] = [False] * num_slots
        self.adapters: list[int] = [0] * num_slots
        """Per slot, the adapter slot its sequence samples with (as `adapter_S`)."""
        self.tokens_SM = zeros(num_slots, max_new_tokens, dtype=torch.long)
        self.logprobs_SM = zeros(num_slots, max_new_tokens, dtype=torch.float32)
        self._per_slot = (
            self.positions_S,
            self.last_token_S,
            self.num_generated_S,
            self.max_new_S,
            self.stream_starts_S,
            self.temperature_S,
            self.top_k_S,
            self.top_p_S,
            self.adapter_S,
        )

    @property
    def num_free(self) -> int:
        return self.num_slots - self.num_active - self.num_reserved

    def reserve_last(self) -> int:
        """Reserve the last slot (it must be free); returns it."""
        assert self.num_reserved == 0 and self.num_free > 0
        self.num_reserved = 1
        return self.num_slots - 1

    def unreserve_last(self) -> None:
        assert self.num_reserved == 1
        self.num_reserved = 0

    def claim(self, owners: Sequence[SlotOwner], *, prompt_lens: Sequence[int]) -> range:
        """Put new samples in the next free slots, in order; returns their slots.

        Each per-slot field is written for all of them at once: one op per field, however
        many samples start (a GRPO batch starts hundreds together)."""
        if len(owners) > self.num_free:
            raise ValueError(f"{len(owners)} samples to start but only {self.num_free} free slots")
        slots = range(self.num_active, self.num_active + len(owners))
        rows = slice(slots.start, slots.stop)
        self.num_active = slots.stop
        self.owners[rows] = owners
        self.num_python_rows += sum(owner.needs_python for owner in owners)
        params = [owner.state.params for owner in owners]
        columns = (
            (self.positions_S, prompt_lens),
            (self.max_new_S, [owner.state.max_new_tokens for owner in owners]),
            (self.temperature_S, [p.temperature for p in params]),
            (self.top_k_S, [p.top_k for p in params]),
            (self.top_p_S, [p.top_p for p in params]),
            (self.adapter_S, [owner.state.request.adapter for owner in owners]),
        )
        for tensor_S, values in columns:
            tensor_S[rows] = torch.tensor(values, dtype=tensor_S.dtype)
        seeds = torch.tensor([owner.state.seeds[owner.sample_index] for owner in owners])
        self.stream_starts_S[rows] = sampling.stream_starts(seeds)
        self.num_generated_S[rows] = 0
        self.greedy[rows] = [p.temperature == 0 for p in params]
        self.adapters[rows] = [owner.state.request.adapter for owner in owners]
        self.sort_widths[rows] = [sampling.row_sort_width(p) for p in params]
        stop_ids = [owner.state.stop_token_ids for owner in owners]
        self.has_stop_ids[rows] = [bool(ids) for ids in stop_ids]
        width = max(map(len, stop_ids), default=0)
        if width > self.stop_ids_SX.shape[1]:
            extra = width - self.stop_ids_SX.shape[1]
            self.stop_ids_SX = torch.nn.functional.pad(self.stop_ids_SX, (0, extra), value=-1)
        self.stop_ids_SX[rows] = -1
        if width:
            padded = [list(ids) + [-1] * (width - len(ids)) for ids in stop_ids]
            self.stop_ids_SX[rows, :width] = torch.tensor(padded, dtype=torch.long)
        return slots

    def move(self, *, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Move the sequences in `sources` to `targets` (state only; the engine moves the
        KV). The two lists pair up in order and must not share a slot."""
        device = self.positions_S.device
        source_N = torch.tensor(sources, device=device)
        target_N = torch.tensor(targets, device=device)
        for tensor in (*self._per_slot, self.stop_ids_SX):
            tensor[target_N] = tensor[source_N]
        count = int(self.num_generated_S[target_N].max())
        for tensor_SM in (self.tokens_SM, self.logprobs_SM):
            tensor_SM[target_N, :count] = tensor_SM[source_N, :count]
        for hints in (self.owners, self.greedy, self.sort_widths, self.has_stop_ids, self.adapters):
            for source, target in zip(sources, targets, strict=True):
                hints[target] = hints[source]
        for source in sources:
            self.owners[source] = None

    def release_last(self, count: int = 1) -> None:
        """Free the `count` highest active slots."""
        self.num_active -= count
        self.owners[self.num_active : self.num_active + count] = [None] * count

    def clear(self) -> None:
        self.num_active = 0
        self.num_reserved = 0
        self.owners = [None] * self.num_slots
        self.num_python_rows = 0
