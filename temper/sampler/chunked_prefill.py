"""Chunked prefill: a long prompt enters the batch a chunk per decode step.

Shapes: T tokens, D model dim, V vocab, L layers, K experts per token.

A prompt longer than `chunk_tokens` (SamplerEngine.Config.prefill_chunk_tokens) is not
prefilled with the other prompts of an admission round: it is prefilled here, one chunk per
engine step, so the rows decoding meanwhile wait for at most one chunk's forward per step.
Chunk boundaries sit at the multiples of `chunk_tokens` counted from the prompt's first token
(after a cached prefix, the first chunk runs to the next multiple), so they depend on the
prompt alone, never on which other calls share the batch; a prompt is chunked the same way
when its call runs alone, and each chunk is a forward of that one prompt, so its first token's
logits are bitwise the same in any batch.

The chunks go into the engine's last KV-cache slot, reserved while a prompt is in progress
(one at a time; the others wait in arrival order), each chunk extending what the slot holds:
keys/values, and for a hybrid model (Qwen3.5) the recurrent states after the chunk, which the
next chunk's delta-rule and convolution start from (the same path as a prompt after a cached
prefix, hybrid_backends.py). After the last chunk the prompt's cache is copied out
(`RequestState.prefix`, as for samples that wait for a slot) and the slot freed: the request
then waits for admission like any prefilled one, which places its samples in slots and draws
their first tokens. Requests with prompt logprobs of any kind are prefilled whole by
admission (their scoring reads every position's hidden state of one forward).
"""

from __future__ import annotations

from collections import deque

import torch

from temper.sampler.hybrid_backends import extend_backend, prefill_backend
from temper.sampler.kv_cache import KVCache
from temper.sampler.prefix_cache import PrefixCache
from temper.sampler.requests import RequestState
from temper.sampler.routes import RouteRecorder, recording
from temper.sampler.row_adapters import RowAdapters
from temper.sampler.slots import SlotTable
from temper.sampler.weight_source import WeightSource


class ChunkedPrefill:
    """The engine's long prompts in progress (see the module docstring)."""

    def __init__(
        self,
        *,
        weights: WeightSource,
        cache: KVCache,
        prefix_cache: PrefixCache,
        slots: SlotTable,
        adapters: RowAdapters,
        routes: RouteRecorder | None,
        chunk_tokens: int,
    ) -> None:
        self.weights = weights
        self.cache = cache
        self.prefix_cache = prefix_cache
        self.slots = slots
        self.adapters = adapters
        self.routes = routes
        self.chunk_tokens = chunk_tokens
        self.queue: deque[RequestState] = deque()
        """Long prompts not fully prefilled, oldest first (the first one is in progress)."""
        self._done = 0  # prompt tokens the slot holds for the first of `queue`
        self._slot: int | None = None
        self.chunk_sizes: list[int] = []
        """Tokens of every chunk forward so far (for tests and benchmarks)."""

    def wants(self, state: RequestState) -> bool:
        """Whether `state`'s prompt is prefilled here: longer than one chunk, no prompt
        logprobs, not prefilled yet."""
        request = state.request
        scores_prompt = (
            request.prompt_logprobs
            or request.topk_prompt_logprobs
            or request.target_prompt_logprobs is not None
        )
        return not state.prefilled and not scores_prompt and len(state.prompt) > self.chunk_tokens

    @property
    def busy(self) -> bool:
        return bool(self.queue)

    def step(self) -> tuple[int, RequestState | None]:
        """Prefill the next chunk of the oldest prompt, if a slot is free for it: the tokens
        it took, and the request if its prompt is now whole (ready for admission)."""
        if not self.queue or (self._slot is None and self.slots.num_free == 0):
            return 0, None
        state = self.queue[0]
        if self._slot is None:
            self._slot = self.slots.reserve_last()
            self._done = self._start(state)
        start = self._done
        end = min(len(state.prompt), (start // self.chunk_tokens + 1) * self.chunk_tokens)
        self._forward(state, start=start, end=end)
        self.chunk_sizes.append(end - start)
        self._done = end
        if end < len(state.prompt):
            return end - start, None
        state.prefix = self.cache.read_prefix(slot=self._slot, length=len(state.prompt))
        self.slots.unreserve_last()
        self._slot = None
        self.queue.popleft()
        return end - start, state

    def abort(self) -> None:
        """Drop every prompt in progress and free the slot."""
        if self._slot is not None:
            self.slots.unreserve_last()
        self._slot = None
        self.queue.clear()

    def _start(self, state: RequestState) -> int:
        """Where the prompt's first chunk starts: after its cached prefix (written into the
        slot), else at 0."""
        cached = None
        if self.prefix_cache.enabled:
            cached = self.prefix_cache.longest(state.prompt, adapter=state.request.adapter)
        if cached is None:
            return 0
        self.cache.write_prefix(slot=self._slot, prefix=cached.slot_prefix())
        if self.routes is not None:
            state.prompt_routes = cached.routes()
        return cached.length

    def _forward(self, state: RequestState, *, start: int, end: int) -> None:
        """Prompt tokens start..end into the reserved slot, after the positions it holds."""
        device = self.weights.device
        tokens_1T = torch.tensor([state.prompt[start:end]], device=device)
        slots_1 = torch.tensor([self._slot], device=device)
        lengths_1 = torch.tensor([end - start], device=device)
        positions_1T = None
        if start == 0:
            attention = prefill_backend(self.cache, slots_1, lengths_B=lengths_1)
        else:
            positions_1T = start + torch.arange(end - start, device=device)[None]
            attention = extend_backend(
                self.cache,
                slots_1,
                starts_B=torch.tensor([start], device=device),
                lengths_B=lengths_1,
                positions_BT=positions_1T,
            )
        model = self.weights.model
        self.adapters.use([state.request.adapter])
        with recording(self.routes, model) as tape:
            hidden_1TD = model.hidden_states(
                tokens_1T, positions_BT=positions_1T, attention=attention
            )
        if tape is not None:
            assert self.routes is not None
            routes_TLK = self.routes.stacked(tape)
            previous = state.prompt_routes
            state.prompt_routes = (
                routes_TLK if previous is None else torch.cat((previous, routes_TLK))
            )
        if end == len(state.prompt):
            state.first_logits_V = model.logits(hidden_1TD[:, -1]).float()[0]
