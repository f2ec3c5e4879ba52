"""A static, preallocated KV cache and the attention backends that fill and read it.

Shapes: L layers (with keys/values), S slots (sequences decoded at once), K key/value heads, C
cache positions per slot, H head dim, B rows of a forward, N query heads, T tokens, R the real
(unpadded) tokens of a right-padded forward.

The cache is allocated once, at its full size, when the engine is built (its byte size is
known and reported up front); weight updates and requests never reallocate it. On CPU its
zeros are the kernel's (kv_cache_memory.py): building an engine costs what its requests will
touch.

A hybrid model's cache holds keys/values for its full-attention layers only (a model layer's
place in the cache is `layer_of[layer_index]`) and, beside them, the recurrent-state pool of
its linear-attention layers (`states`, recurrent_pool.py), which it moves, copies, releases
and allocates with the keys/values of the same slots. The backends that also read and write
those states are hybrid_backends.py.

Decoding works on a prefix of the slots: the engine keeps active sequences in slots 0..B-1
(it moves a sequence down when one below it finishes), so a decode step reads `k[layer, :B]`,
a view, and never gathers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from temper.models.common.attention import causal_attention, masked_attention
from temper.sampler.kv_cache_memory import zeros
from temper.sampler.recurrent_pool import RecurrentPool, RecurrentPoolShape, SlotStates


@dataclass(frozen=True, kw_only=True)
class KVCacheShape:
    num_layers: int
    """Layers with keys/values: all of a dense model's, a hybrid model's full-attention ones."""
    num_slots: int
    num_kv_heads: int
    max_seq_len: int
    head_dim: int
    attention_layers: tuple[int, ...] | None = None
    """The model layers (indices in the whole model) the cache's layers hold, in order; None:
    layers 0..num_layers-1 (a dense model)."""

    def __post_init__(self) -> None:
        assert self.attention_layers is None or len(self.attention_layers) == self.num_layers

    @classmethod
    def for_model(cls, model_config: Any, *, num_slots: int, max_seq_len: int) -> KVCacheShape:
        """Keys/values for every layer of a dense model; for a hybrid model (one with
        `linear_layers`) those of its `attention_layers` only."""
        attention_layers, num_layers = None, model_config.num_layers
        if getattr(model_config, "linear_layers", ()):
            attention_layers = tuple(model_config.attention_layers)
            num_layers = len(attention_layers)
        return cls(
            num_layers=num_layers,
            num_slots=num_slots,
            num_kv_heads=model_config.num_kv_heads,
            max_seq_len=max_seq_len,
            head_dim=model_config.head_dim,
            attention_layers=attention_layers,
        )

    @property
    def dims(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_slots, self.num_kv_heads, self.max_seq_len, self.head_dim)

    def nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of keys plus values, known before anything is allocated."""
        return 2 * math.prod(self.dims) * torch.empty((), dtype=dtype).element_size()

    def bytes_per_position(self, dtype: torch.dtype) -> int:
        """Keys plus values of one token of one sequence (all cached layers)."""
        return self.nbytes(dtype) // (self.num_slots * self.max_seq_len)


@dataclass(frozen=True)
class SlotPrefix:
    """A copy of what one slot holds for its first positions: keys/values [L, K, T, H] each
    and, for a hybrid model, its recurrent states after them."""

    k_LKTH: torch.Tensor
    v_LKTH: torch.Tensor
    states: SlotStates | None = None


class KVCache:
    def __init__(
        self,
        shape: KVCacheShape,
        *,
        dtype: torch.dtype,
        device: torch.device,
        states: RecurrentPoolShape | None = None,
    ) -> None:
        """`states`: the recurrent-state pool of a hybrid model's linear-attention layers."""
        self.shape, self.dtype, self.device = shape, dtype, device
        self.k_LSKCH = zeros(shape.dims, dtype=dtype, device=device)
        self.v_LSKCH = zeros(shape.dims, dtype=dtype, device=device)
        self.num_slots = shape.num_slots
        self.max_seq_len = shape.max_seq_len
        layers = shape.attention_layers or range(shape.num_layers)
        self.layer_of: list[int] = [-1] * (max(layers, default=-1) + 1)
        """A model layer's index in the cache's first dimension (-1: no keys/values)."""
        for index, layer in enumerate(layers):
            self.layer_of[layer] = index
        self.states = None if states is None else RecurrentPool(states, dtype=dtype, device=device)
        """Each slot's recurrent states (a hybrid model), moved and copied with its keys/values."""

    @property
    def allocated(self) -> bool:
        return self.k_LSKCH.numel() > 0

    def release(self) -> None:
        """Free the memory (a generator's sleep); `reacquire` allocates it again."""
        empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self.k_LSKCH, self.v_LSKCH = empty, empty.clone()
        if self.states is not None:
            self.states.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reacquire(self) -> None:
        if not self.allocated:
            self.k_LSKCH = zeros(self.shape.dims, dtype=self.dtype, device=self.device)
            self.v_LSKCH = zeros(self.shape.dims, dtype=self.dtype, device=self.device)
        if self.states is not None:
            self.states.reacquire()

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values (a hybrid model's states: `states.nbytes`)."""
        return self.k_LSKCH.nbytes + self.v_LSKCH.nbytes

    def copy_slots(self, *, sources: Sequence[int], targets: Sequence[int], length: int) -> None:
        """Copy the first `length` positions of slots `sources` into `targets` (paired in
        order, all layers, and their recurrent states) in one gather per tensor; the two must
        not share a slot."""
        if len(sources) == 1:
            source, target = slice(sources[0], sources[0] + 1), slice(targets[0], targets[0] + 1)
        else:
            device = self.k_LSKCH.device
            source = torch.tensor(sources, device=device)
            target = torch.tensor(targets, device=device)
        self.k_LSKCH[:, target, :, :length] = self.k_LSKCH[:, source, :, :length]
        self.v_LSKCH[:, target, :, :length] = self.v_LSKCH[:, source, :, :length]
        if self.states is not None:
            self.states.copy_slots(sources=sources, targets=targets)

    def read_prefix(self, *, slot: int, length: int) -> SlotPrefix:
        """A copy of one slot's first `length` positions (and its recurrent states, which
        must be those after them)."""
        return SlotPrefix(
            self.k_LSKCH[:, slot, :, :length].clone(),
            self.v_LSKCH[:, slot, :, :length].clone(),
            None if self.states is None else self.states.read_slot(slot),
        )

    def write_prefix(self, *, slot: int, prefix: SlotPrefix) -> None:
        """Give a slot these first positions; a hybrid model's slot also the prefix's states."""
        length = prefix.k_LKTH.shape[2]
        self.k_LSKCH[:, slot, :, :length] = prefix.k_LKTH
        self.v_LSKCH[:, slot, :, :length] = prefix.v_LKTH
        if self.states is not None:
            assert prefix.states is not None, "a hybrid model's prefix carries its states"
            self.states.write_slot(slot, prefix.states)

    def read_prefixes(
        self, *, slots: Sequence[int], length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of the first `length` positions of several slots (ascending), [L,
        len(slots), K, length, H] each, in one copy per tensor."""
        if slots[-1] - slots[0] == len(slots) - 1:  # a range (all finished at once): a slice
            span = slice(slots[0], slots[-1] + 1)
            return (
                self.k_LSKCH[:, span, :, :length].clone(),
                self.v_LSKCH[:, span, :, :length].clone(),
            )
        index = torch.tensor(slots, device=self.k_LSKCH.device)
        return self.k_LSKCH[:, index, :, :length], self.v_LSKCH[:, index, :, :length]


class PrefillAttention:
    """Full prompts, right-padded: attend causally, and store keys/values in `slots_B`."""

    def __init__(self, cache: KVCache, slots_B: torch.Tensor) -> None:
        self.cache = cache
        self.slots_B = slots_B

    def attend(
        self, layer_index: int, q_BNTH: torch.Tensor, k_BKTH: torch.Tensor, v_BKTH: torch.Tensor
    ) -> torch.Tensor:
        length, layer = k_BKTH.shape[2], self.cache.layer_of[layer_index]
        self.cache.k_LSKCH[layer, self.slots_B, :, :length] = k_BKTH
        self.cache.v_LSKCH[layer, self.slots_B, :, :length] = v_BKTH
        return causal_attention(q_BNTH, k_BKTH, v_BKTH)


class ExtendAttention:
    """Prompts whose first `starts_B[b]` positions are already in their slots (a cached
    prefix, prefix_cache.py): row b's T tokens (right-padded past `lengths_B[b]`) sit at
    positions starts_B[b] + t. Stores the real tokens' keys/values after the prefix and
    attends causally over prefix and row; padded queries' outputs are never read."""

    def __init__(
        self,
        cache: KVCache,
        slots_B: torch.Tensor,
        *,
        starts_B: torch.Tensor,
        lengths_B: torch.Tensor,
        positions_BT: torch.Tensor,
    ) -> None:
        self.cache = cache
        self.slots_B = slots_B
        self.width = int((starts_B + lengths_B).max())
        visible_BTC = torch.arange(self.width, device=slots_B.device) <= positions_BT[..., None]
        self.visible_B1TC = visible_BTC[:, None]
        # The real tokens, and the flat row of (slot, kv head, position) each of their heads
        # goes to in a layer's [S * K * C, H] view (padding is not written: past a long
        # cached prefix it could run off the end of the slot).
        offsets_T = torch.arange(positions_BT.shape[1], device=slots_B.device)
        self.rows_R, self.columns_R = torch.nonzero(offsets_T < lengths_B[:, None], as_tuple=True)
        num_kv_heads = cache.k_LSKCH.shape[2]
        heads_K = torch.arange(num_kv_heads, device=slots_B.device)
        flat_RK = (slots_B[self.rows_R, None] * num_kv_heads + heads_K) * cache.max_seq_len
        self.flat_index_N = (flat_RK + positions_BT[self.rows_R, self.columns_R, None]).reshape(-1)

    def attend(
        self, layer_index: int, q_BNTH: torch.Tensor, k_BKTH: torch.Tensor, v_BKTH: torch.Tensor
    ) -> torch.Tensor:
        head_dim, layer = k_BKTH.shape[-1], self.cache.layer_of[layer_index]
        for new_BKTH, cache_SKCH in (
            (k_BKTH, self.cache.k_LSKCH[layer]),
            (v_BKTH, self.cache.v_LSKCH[layer]),
        ):
            new_RKH = new_BKTH.transpose(1, 2)[self.rows_R, self.columns_R]
            cache_SKCH.view(-1, head_dim).index_copy_(
                0, self.flat_index_N, new_RKH.reshape(-1, head_dim)
            )
        k_BKCH = self.cache.k_LSKCH[layer, self.slots_B, :, : self.width]
        v_BKCH = self.cache.v_LSKCH[layer, self.slots_B, :, : self.width]
        return masked_attention(q_BNTH, k_BKCH, v_BKCH, visible_B1TC=self.visible_B1TC)


_MIN_CPU_WIDTH = 16


class DecodeAttention:
    """One new token per row; row b is slot `first_slot + b` and its token sits at
    `positions_B[b]`. A decode step may run as several of these over consecutive row groups
    at once (thread shards): each writes and reads only its own slots.

    Keys past a row's position hold stale values from earlier occupants or prompt padding; the
    mask hides them. Attention reads only the first `width` cache positions.

    On CPU, with one query per row, attention is two small batched matmuls and a softmax per
    layer, several times faster than SDPA's CPU flash kernel, whose fixed cost per (row, head)
    dominates at this size. Query heads are grouped under their key/value head (G = N / K per
    group) so the cache is never expanded. It is computed in fp32 whatever the cache dtype (as
    SDPA accumulates; CPU batched matmuls this small are also faster in fp32 than in bf16,
    conversion included) and the output cast back. On CUDA, SDPA's fused kernels are the fast
    path, and they read a bf16 cache without an fp32 copy of it.
    """

    def __init__(
        self, cache: KVCache, positions_B: torch.Tensor, *, width: int, first_slot: int = 0
    ) -> None:
        device = positions_B.device
        if device.type == "cpu":
            # torch's CPU softmax over rows shorter than 16 runs a scalar loop, ~10x slower
            # than over 16 (measured: 123 us vs 12 us for 512 rows of 14); masked extra
            # positions cost almost nothing.
            width = min(max(width, _MIN_CPU_WIDTH), cache.max_seq_len)
        self.cache = cache
        self.width = width
        self.slots = slice(first_slot, first_slot + positions_B.shape[0])
        num_rows, num_kv_heads = positions_B.shape[0], cache.k_LSKCH.shape[2]
        visible_BC = torch.arange(width, device=device) <= positions_B[:, None]
        self.visible_B11C = visible_BC[:, None, None, :]
        self.hidden_B11C = ~self.visible_B11C
        # Flat row index of (slot b, head k, position p) in a layer's [S * K * C, H] view:
        # index_copy_ on it is several times faster than two-tensor advanced indexing.
        slots_B = torch.arange(first_slot, first_slot + num_rows, device=device)
        rows_BK = slots_B[:, None] * num_kv_heads
        rows_BK = rows_BK + torch.arange(num_kv_heads, device=device)[None, :]
        self.flat_index_N = (rows_BK * cache.max_seq_len + positions_B[:, None]).reshape(-1)

    def attend(
        self, layer_index: int, q_BN1H: torch.Tensor, k_BK1H: torch.Tensor, v_BK1H: torch.Tensor
    ) -> torch.Tensor:
        num_rows, num_kv_heads, _, head_dim = k_BK1H.shape
        layer = self.cache.layer_of[layer_index]
        k_SKCH = self.cache.k_LSKCH[layer]
        v_SKCH = self.cache.v_LSKCH[layer]
        new_rows = num_rows * num_kv_heads
        k_SKCH.view(-1, head_dim).index_copy_(0, self.flat_index_N, k_BK1H.reshape(new_rows, -1))
        v_SKCH.view(-1, head_dim).index_copy_(0, self.flat_index_N, v_BK1H.reshape(new_rows, -1))
        k_BKCH = k_SKCH[self.slots, :, : self.width]
        v_BKCH = v_SKCH[self.slots, :, : self.width]
        if q_BN1H.device.type == "cpu":
            return _grouped_attention(q_BN1H, k_BKCH, v_BKCH, hidden_B11C=self.hidden_B11C)
        return masked_attention(q_BN1H, k_BKCH, v_BKCH, visible_B1TC=self.visible_B11C)


def _grouped_attention(
    q_BN1H: torch.Tensor, k_BKCH: torch.Tensor, v_BKCH: torch.Tensor, *, hidden_B11C: torch.Tensor
) -> torch.Tensor:
    num_rows, num_heads, _, head_dim = q_BN1H.shape
    num_kv_heads = k_BKCH.shape[1]
    q_BKGH = q_BN1H.reshape(num_rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores_BKGC = torch.matmul(q_BKGH.float(), k_BKCH.float().transpose(-1, -2))
    scores_BKGC = scores_BKGC.mul_(head_dim**-0.5).masked_fill_(hidden_B11C, -torch.inf)
    out_BKGH = torch.matmul(torch.softmax(scores_BKGC, dim=-1), v_BKCH.float())
    return out_BKGH.view(num_rows, num_heads, 1, head_dim).to(q_BN1H.dtype)
