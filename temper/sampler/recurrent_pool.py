"""The recurrent-state pool of a hybrid model: each slot's states for its linear-attention layers.

Shapes: L linear-attention layers, S slots, C conv channels, W conv window (kernel - 1), N
value heads, K key head dim, V value head dim, F sequences read together.

A hybrid model (Qwen3.5: three Gated DeltaNet layers for every full-attention layer) carries,
per sequence and per linear-attention layer, the last W inputs of its causal convolution and
the delta rule's recurrent state; neither grows with the sequence. The pool holds them for
every slot, beside the KV cache (which then holds only the full-attention layers), allocated
once at full size with it: its bytes are known up front (`RecurrentPoolShape.nbytes`). The
conv states are in the model's dtype, the recurrent states in fp32 (what the model's
recurrent step reads and writes: temper/models/common/recurrent.py).

The pool follows the KV cache's slots (the KV cache owns it and moves both together): a
sequence that moves down when one below it finishes takes its states along, a prompt's other
samples copy its states with its keys/values, and a sample waiting for a slot keeps a copy of
both. A slot's states are always written before they are read: a fresh prompt's prefill starts
from zeros and writes its rows (the model reads no state for it), and a prompt that extends a
cached sequence is given that sequence's final states first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from temper.sampler.kv_cache_memory import zeros


@dataclass(frozen=True, kw_only=True)
class RecurrentPoolShape:
    linear_layers: tuple[int, ...]
    """The model's linear-attention layers (their indices in the whole model), in order."""
    num_slots: int
    conv_state_shape: tuple[int, int]
    """(conv channels, kernel - 1)."""
    recurrent_state_shape: tuple[int, int, int]
    """(value heads, key head dim, value head dim)."""

    @classmethod
    def for_model(cls, model_config: Any, *, num_slots: int) -> RecurrentPoolShape | None:
        """The pool a hybrid model needs; None for a model without linear-attention layers."""
        linear_layers = tuple(getattr(model_config, "linear_layers", ()))
        if not linear_layers:
            return None
        return cls(
            linear_layers=linear_layers,
            num_slots=num_slots,
            conv_state_shape=tuple(model_config.conv_state_shape),
            recurrent_state_shape=tuple(model_config.recurrent_state_shape),
        )

    @property
    def num_layers(self) -> int:
        return len(self.linear_layers)

    @property
    def conv_dims(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_slots, *self.conv_state_shape)

    @property
    def state_dims(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_slots, *self.recurrent_state_shape)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """One sequence's states (conv in `dtype`, recurrent in fp32): the same at any length."""
        conv = math.prod(self.conv_state_shape) * torch.empty((), dtype=dtype).element_size()
        return self.num_layers * (conv + 4 * math.prod(self.recurrent_state_shape))

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of the whole pool, known before anything is allocated."""
        return self.num_slots * self.bytes_per_slot(dtype)


@dataclass(frozen=True)
class SlotStates:
    """A copy of one sequence's states: conv [L, C, W] and recurrent [L, N, K, V]."""

    conv_LCW: torch.Tensor
    state_LNKV: torch.Tensor


class RecurrentPool:
    def __init__(
        self, shape: RecurrentPoolShape, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.pool_layer = {layer: index for index, layer in enumerate(shape.linear_layers)}
        """A model layer's index in the pool's first dimension."""
        self.conv_LSCW = torch.empty(0, dtype=dtype, device=device)
        self.state_LSNKV = torch.empty(0, dtype=torch.float32, device=device)
        self.reacquire()

    @property
    def allocated(self) -> bool:
        return self.state_LSNKV.numel() > 0

    @property
    def nbytes(self) -> int:
        return self.conv_LSCW.nbytes + self.state_LSNKV.nbytes

    def release(self) -> None:
        """Free the memory (the engine's sleep); `reacquire` allocates it again."""
        self.conv_LSCW = torch.empty(0, dtype=self.dtype, device=self.device)
        self.state_LSNKV = torch.empty(0, dtype=torch.float32, device=self.device)

    def reacquire(self) -> None:
        if not self.allocated:
            self.conv_LSCW = zeros(self.shape.conv_dims, dtype=self.dtype, device=self.device)
            self.state_LSNKV = zeros(self.shape.state_dims, dtype=torch.float32, device=self.device)

    def layer(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One model layer's states of every slot: conv [S, C, W], recurrent [S, N, K, V]."""
        index = self.pool_layer[layer_index]
        return self.conv_LSCW[index], self.state_LSNKV[index]

    def copy_slots(self, *, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy the states of slots `sources` into `targets` (paired in order, all layers);
        the two must not share a slot."""
        source = torch.tensor(sources, device=self.device)
        target = torch.tensor(targets, device=self.device)
        self.conv_LSCW[:, target] = self.conv_LSCW[:, source]
        self.state_LSNKV[:, target] = self.state_LSNKV[:, source]

    def read(self, slots: Sequence[int]) -> SlotStates:
        """A copy of several slots' states: conv [L, F, C, W], recurrent [L, F, N, K, V]."""
        index = torch.tensor(slots, device=self.device)
        return SlotStates(self.conv_LSCW[:, index], self.state_LSNKV[:, index])

    def read_slot(self, slot: int) -> SlotStates:
        return SlotStates(self.conv_LSCW[:, slot].clone(), self.state_LSNKV[:, slot].clone())

    def write_slot(self, slot: int, states: SlotStates | None) -> None:
        """Give a slot these states (None: zeros, a sequence's start)."""
        if states is None:
            self.conv_LSCW[:, slot] = 0
            self.state_LSNKV[:, slot] = 0
        else:
            self.conv_LSCW[:, slot] = states.conv_LCW
            self.state_LSNKV[:, slot] = states.state_LNKV
