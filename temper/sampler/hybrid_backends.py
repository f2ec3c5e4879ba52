"""The attention backends of a hybrid model: the KV cache's, plus its slots' recurrent states.

Shapes: B rows of a forward, S slots, C conv channels, W conv window (kernel - 1), N value
heads, K key head dim, V value head dim.

A hybrid model (Qwen3.5) takes one backend object for all its layers: full-attention layers
call `attend` (the KV cache's backends, kv_cache.py, unchanged) and linear-attention layers
call the `RecurrentStates` methods (temper/models/common/recurrent.py), which read and write
the rows of the recurrent-state pool (recurrent_pool.py) that belong to the forward's slots:
- a prefill starts every row from zeros (`read_states` is None: the model's chunked form from
  a fresh state) and writes each row's states after its last real token (`lengths_B`: the
  rows are right-padded);
- an extend (a prompt after a cached prefix) starts each row from its slot's states, which
  admission wrote first (the cached sequence's final states, or zeros for a row without a
  prefix);
- a decode step reads and writes slots first_slot.. in place, as views (no gather, and the
  same buffers in every step, so a CUDA graph can capture it); thread shards over row groups
  each touch only their own slots.

`prefill_backend`, `extend_backend` and `decode_backend` pick the hybrid twin when the cache
has a state pool and the plain backend otherwise, so a dense model runs exactly as without
this module.
"""

from __future__ import annotations

import torch

from temper.sampler.kv_cache import DecodeAttention, ExtendAttention, KVCache, PrefillAttention


class _GatheredRows:
    """The states of the pool rows `slots_B` (any slots, one per row of the forward)."""

    cache: KVCache
    slots_B: torch.Tensor
    _lengths_B: torch.Tensor | None
    _fresh: bool

    @property
    def lengths_B(self) -> torch.Tensor | None:
        return self._lengths_B

    def read_states(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._fresh:
            return None
        assert self.cache.states is not None
        conv_SCW, state_SNKV = self.cache.states.layer(layer_index)
        return conv_SCW[self.slots_B], state_SNKV[self.slots_B]

    def write_states(
        self, layer_index: int, *, conv_BCW: torch.Tensor, state_BNKV: torch.Tensor
    ) -> None:
        assert self.cache.states is not None
        conv_SCW, state_SNKV = self.cache.states.layer(layer_index)
        conv_SCW[self.slots_B] = conv_BCW
        state_SNKV[self.slots_B] = state_BNKV


class HybridPrefill(_GatheredRows, PrefillAttention):
    """Whole prompts from a fresh state, right-padded past `lengths_B`, into slots `slots_B`."""

    def __init__(self, cache: KVCache, slots_B: torch.Tensor, *, lengths_B: torch.Tensor) -> None:
        super().__init__(cache, slots_B)
        self._lengths_B, self._fresh = lengths_B, True


class HybridExtend(_GatheredRows, ExtendAttention):
    """Prompts after a cached prefix: each row continues from its slot's states."""

    def __init__(
        self,
        cache: KVCache,
        slots_B: torch.Tensor,
        *,
        starts_B: torch.Tensor,
        lengths_B: torch.Tensor,
        positions_BT: torch.Tensor,
    ) -> None:
        super().__init__(
            cache, slots_B, starts_B=starts_B, lengths_B=lengths_B, positions_BT=positions_BT
        )
        self._lengths_B, self._fresh = lengths_B, False


class HybridDecode(DecodeAttention):
    """One token per row; row b is slot first_slot + b, whose states it reads and writes in
    place."""

    lengths_B = None  # one real token per row

    def read_states(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.cache.states is not None
        conv_SCW, state_SNKV = self.cache.states.layer(layer_index)
        return conv_SCW[self.slots], state_SNKV[self.slots]

    def write_states(
        self, layer_index: int, *, conv_BCW: torch.Tensor, state_BNKV: torch.Tensor
    ) -> None:
        conv_BCW_view, state_BNKV_view = self.read_states(layer_index)
        conv_BCW_view.copy_(conv_BCW)
        state_BNKV_view.copy_(state_BNKV)


def prefill_backend(
    cache: KVCache, slots_B: torch.Tensor, *, lengths_B: torch.Tensor
) -> PrefillAttention:
    """Whole prompts (right-padded past `lengths_B`) into slots `slots_B`."""
    if cache.states is None:
        return PrefillAttention(cache, slots_B)
    return HybridPrefill(cache, slots_B, lengths_B=lengths_B)


def extend_backend(
    cache: KVCache,
    slots_B: torch.Tensor,
    *,
    starts_B: torch.Tensor,
    lengths_B: torch.Tensor,
    positions_BT: torch.Tensor,
) -> ExtendAttention:
    """Prompts after cached prefixes (kv_cache.py's `ExtendAttention`)."""
    kind = ExtendAttention if cache.states is None else HybridExtend
    return kind(cache, slots_B, starts_B=starts_B, lengths_B=lengths_B, positions_BT=positions_BT)


def decode_backend(
    cache: KVCache, positions_B: torch.Tensor, *, width: int, first_slot: int = 0
) -> DecodeAttention:
    """One decode step's rows in slots first_slot.. (kv_cache.py's `DecodeAttention`)."""
    kind = DecodeAttention if cache.states is None else HybridDecode
    return kind(cache, positions_B, width=width, first_slot=first_slot)
