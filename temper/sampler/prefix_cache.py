"""Keys and values of finished sequences, kept so that a prompt extending one prefills only
its new tokens.

Shapes: L layers, F sequences stored together, K key/value heads, C positions, T tokens, H
head dim.

A multi-turn episode asks for its next action with a prompt that is its last request's prompt
and completion plus the environment's observation: without this cache every turn prefills the
whole conversation again (in the multi-turn recipes, four fifths of sampling time). When a
sequence finishes, the engine stores the keys/values it has computed (its prompt and every
sampled token but the last, which was never fed through the model); when a prompt arrives, the
longest stored sequence it starts with gives its first positions, and only the rest is
prefilled (admission.py, `ExtendAttention` in kv_cache.py).

The sequences that finish together are stored as one block (one gather from the KV cache);
an entry is a row of its block, and memory is counted per entry, by its own length. A block
is hashed only when a lookup first needs it, so an RL step that samples single-turn problems
(every sequence stored, none looked up before the weights change) pays for the gather alone.
Entries are found by a chain of hashes over their tokens (one per prefix length), so a lookup
costs one dict probe per prompt position, and a hit is confirmed token by token. A prompt may
also share only the start of an entry (two conversations with one system prompt, a request
that rewrites a conversation's end): every `BLOCK` tokens of an entry are indexed too, so such
a prompt copies the longest whole blocks they have in common. Keys and
values depend on the weights: the engine empties the cache when its weights generation changes,
and a multi-LoRA sampler drops an adapter slot's entries when it loads another adapter there.
Entries of the same adapter slot only match each other. An engine that records a MoE
model's routes (routes.py) stores each sequence's routes with its keys and values, so a prompt
extending it takes the routes its cached tokens were computed with. The cache holds at most
`max_bytes`;
the least recently used entries go first. Requests that ask for prompt logprobs do not use it
(they need every prompt position's hidden state).

A hybrid model's entries also keep the sequence's final recurrent states (its linear-attention
layers', recurrent_pool.py), counted in its bytes. A recurrent state cannot be rewound: it
holds the sequence's whole past, not one slot per position. So such a cache (`whole_only`)
gives a prompt only an entry it extends whole (the next turn of a multi-turn episode, whose
prompt is the last turn's prompt and completion plus the new observation); a prompt that
shares only part of an entry prefills from the start.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from temper.sampler.kv_cache import SlotPrefix
from temper.sampler.recurrent_pool import SlotStates

BLOCK = 16
"""Partial matches are found at multiples of this many tokens (an entry of n tokens adds n /
BLOCK index keys, not n)."""


@dataclass(frozen=True, kw_only=True)
class CachedPrefix:
    """One stored sequence: row `row` of a block of sequences stored together, F of them
    with C >= len(tokens) positions each (a view is made only when the entry is used)."""

    tokens: tuple[int, ...]
    adapter: int
    k_LFKCH: torch.Tensor
    v_LFKCH: torch.Tensor
    row: int
    nbytes: int
    routes_TLK: torch.Tensor | None = None
    """The experts each stored token was routed to (an engine that records routes,
    routes.py): its whole sequence's, however much of it this entry covers."""
    states: SlotStates | None = None
    """A hybrid model's recurrent states of the block, [L, F, ...] (row `row`'s are this
    sequence's after its last token)."""

    @property
    def length(self) -> int:
        return len(self.tokens)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This sequence's keys and values, [L, K, length, H] each."""
        length = self.length
        return self.k_LFKCH[:, self.row, :, :length], self.v_LFKCH[:, self.row, :, :length]

    def slot_prefix(self) -> SlotPrefix:
        """What a slot starting from this entry is given: its keys/values and, for a hybrid
        model, its final recurrent states (`PrefixCache.whole_only` entries only)."""
        k_LKTH, v_LKTH = self.keys_values()
        if self.states is None:
            return SlotPrefix(k_LKTH, v_LKTH)
        row = self.row
        states = SlotStates(self.states.conv_LCW[:, row], self.states.state_LNKV[:, row])
        return SlotPrefix(k_LKTH, v_LKTH, states)

    def routes(self) -> torch.Tensor:
        """This entry's tokens' routes, [length, L, K]."""
        assert self.routes_TLK is not None
        return self.routes_TLK[: self.length]


def prefix_hashes(tokens: Sequence[int], *, adapter: int) -> list[int]:
    """hashes[n - 1] identifies tokens[:n] (with the adapter slot), for every n."""
    hashes, value = [], hash(("prefix", adapter))
    for token in tokens:
        value = hash((value, token))
        hashes.append(value)
    return hashes


@dataclass(frozen=True, kw_only=True)
class _Block:
    """Sequences stored together, not yet indexed."""

    sequences: Sequence[Sequence[int]]
    adapters: Sequence[int]
    k_LFKCH: torch.Tensor
    v_LFKCH: torch.Tensor
    bytes_per_position: int
    routes: Sequence[torch.Tensor] | None
    states: SlotStates | None
    bytes_per_sequence: int


class PrefixCache:
    def __init__(self, *, max_bytes: int, whole_only: bool = False) -> None:
        """`whole_only`: entries are used whole or not at all (a hybrid model's, whose
        recurrent states are those after the entry's last token)."""
        if max_bytes < 0:
            raise ValueError(f"PrefixCache: max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.whole_only = whole_only
        self.nbytes = 0
        self.num_hits = 0
        self.num_hit_tokens = 0
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()  # by hash, LRU first
        self._blocks: dict[int, int] = {}  # hash of an entry's first k * BLOCK tokens -> its key
        self._pending: list[_Block] = []  # stored, newest last, indexed when first needed
        self._generation: int | None = None

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        self._index()
        return len(self._entries)

    def follow(self, generation: int) -> None:
        """Empty the cache if the weights changed since the entries were computed."""
        if generation != self._generation:
            self.clear()
            self._generation = generation

    def clear(self) -> None:
        self._entries.clear()
        self._blocks.clear()
        self._pending.clear()
        self.nbytes = 0

    def drop_adapter(self, adapter: int) -> None:
        """Forget the entries of one adapter slot (its weights are about to change)."""
        self._index()
        for key, entry in list(self._entries.items()):
            if entry.adapter == adapter:
                self._remove(key)

    def longest(self, prompt: Sequence[int], *, adapter: int) -> CachedPrefix | None:
        """The longest cached start of `prompt` that leaves at least its last token to
        compute (its position gives the logits): a whole stored sequence, or (unless
        `whole_only`) the first multiple of BLOCK tokens of one (then an entry cut to that
        length)."""
        self._index()
        if not self._entries or len(prompt) < 2:
            return None
        hashes = prefix_hashes(prompt[:-1], adapter=adapter)
        for length in range(len(hashes), 0, -1):
            key = hashes[length - 1]
            if key not in self._entries and length % BLOCK == 0 and not self.whole_only:
                key = self._blocks.get(key, key)  # an entry this prompt shares blocks with
            entry = self._entries.get(key)
            if (
                entry is not None
                and entry.adapter == adapter
                and entry.tokens[:length] == tuple(prompt[:length])
            ):
                self._entries.move_to_end(key)
                self.num_hits += 1
                self.num_hit_tokens += length
                if entry.length > length:
                    return replace(entry, tokens=entry.tokens[:length])
                return entry
        return None

    def store(
        self,
        sequences: Sequence[Sequence[int]],
        *,
        adapters: Sequence[int],
        k_LFKCH: torch.Tensor,
        v_LFKCH: torch.Tensor,
        routes: Sequence[torch.Tensor] | None = None,
        states: SlotStates | None = None,
    ) -> None:
        """Keep the keys/values of several sequences: sequence f's are row f of k_LFKCH and
        v_LFKCH, positions 0..len-1 (the block is held until the last of its entries goes),
        `routes[f]`, its tokens' recorded routes [len, L, K], when given, and a hybrid
        model's recurrent states after each sequence (row f of `states`, [L, F, ...]).

        They are hashed only when a lookup needs them: a single-turn RL step stores every
        sequence it samples and looks none up before its weights change."""
        num_layers, _, num_kv_heads, width, head_dim = k_LFKCH.shape
        assert all(0 < len(tokens) <= width for tokens in sequences)
        per_position = 2 * num_layers * num_kv_heads * head_dim * k_LFKCH.element_size()
        if routes is not None:
            assert all(len(r) == len(t) for r, t in zip(routes, sequences, strict=True))
            per_position += routes[0][0].numel() * routes[0].element_size()
        per_sequence = 0
        if states is not None:
            assert self.whole_only, "recurrent states are only right at an entry's end"
            per_sequence = (states.conv_LCW.nbytes + states.state_LNKV.nbytes) // len(sequences)
        block = _Block(
            sequences=sequences, adapters=adapters, k_LFKCH=k_LFKCH, v_LFKCH=v_LFKCH,
            bytes_per_position=per_position, routes=routes, states=states,
            bytes_per_sequence=per_sequence,
        )  # fmt: skip
        self._pending.append(block)
        self.nbytes += per_position * sum(map(len, sequences)) + per_sequence * len(sequences)
        if self.nbytes > self.max_bytes:
            self._index()
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))

    def _index(self) -> None:
        """Enter the pending blocks' sequences, oldest first."""
        for block in self._pending:
            for row, (tokens, adapter) in enumerate(
                zip(block.sequences, block.adapters, strict=True)
            ):
                hashes = prefix_hashes(tokens, adapter=adapter)
                key = hashes[-1]
                if key in self._entries:
                    self._remove(key)  # the same tokens again: the newer copy stays
                for length in range(BLOCK, len(tokens), BLOCK):
                    self._blocks[hashes[length - 1]] = key  # the newest entry with them
                nbytes = block.bytes_per_position * len(tokens) + block.bytes_per_sequence
                self._entries[key] = CachedPrefix(
                    tokens=tuple(tokens), adapter=adapter, k_LFKCH=block.k_LFKCH,
                    v_LFKCH=block.v_LFKCH, row=row, nbytes=nbytes,
                    routes_TLK=None if block.routes is None else block.routes[row],
                    states=block.states,
                )  # fmt: skip
        self._pending.clear()

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.nbytes -= entry.nbytes
        if entry.length > BLOCK:
            hashes = prefix_hashes(entry.tokens, adapter=entry.adapter)
            for length in range(BLOCK, entry.length, BLOCK):
                if self._blocks.get(hashes[length - 1]) == key:
                    del self._blocks[hashes[length - 1]]
