"""How the engine's decode steps run: the plain path, which speed wings override.

Shapes: B rows, T tokens, D model dim, V vocab.

The engine picks its `Decoding` once, when it is built: this plain one (the model itself, a
step's rows all at once, the process's threads), on CPU the speed wing's `CpuDecoding`
(cpu/decoding.py: fused or packed twins of the model, rows split over threads, a thread
setting), or on CUDA `CudaGraphDecoding` (cuda_graphs.py: a step's logits replayed from a
captured graph). The engine's decode loop calls the same methods whichever it is, so it reads
the same whatever runs underneath. `Draw` is what a step yields for its rows (one per group of
rows, joined in row order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from temper.models.common.attention import AttentionBackend
from temper.sampler.hybrid_backends import decode_backend
from temper.sampler.kv_cache import KVCache
from temper.sampler.weight_source import WeightSource

Result = TypeVar("Result")


class DecodeModel(Protocol):
    """The part of a model a decode step runs: the model itself, or a twin of it."""

    def hidden_states(
        self, tokens_BT: torch.Tensor, *, positions_BT: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor: ...

    def logits(self, hidden_BD: torch.Tensor) -> torch.Tensor: ...


class Decoding:
    """The plain decode path: the model, whole steps, the process's threads."""

    def decoder(self, weights: WeightSource) -> DecodeModel:
        """What a generate call's decode steps run on: the model itself."""
        return weights.model

    @contextlib.contextmanager
    def threads(self, num_threads: int | None, *, rows: int) -> Iterator[None]:
        """Around a generate call: torch's threads as they are."""
        del num_threads, rows  # only the CPU wing sets threads
        yield

    def map_rows(self, step: Callable[[range], Result], num_rows: int) -> list[Result]:
        """`step` over a decode step's rows 0..num_rows-1: one call for all of them."""
        return [step(range(num_rows))]

    def width(self, positions_B: torch.Tensor) -> int:
        """Cache positions a decode step's rows attend over: no more than they use. Every
        group of rows (`map_rows`) attends over the whole step's width, so its rows' draws
        are bitwise those of one group."""
        return int(positions_B.max()) + 1

    def logits(
        self,
        decoder: DecodeModel,
        cache: KVCache,
        *,
        tokens_B: torch.Tensor,
        positions_B: torch.Tensor,
        width: int,
        first_slot: int,
    ) -> torch.Tensor:
        """Next-token logits [B, V] (fp32) of the rows in slots first_slot.. (one group of a
        decode step): a forward of `decoder` over their last tokens."""
        attention = decode_backend(cache, positions_B, width=width, first_slot=first_slot)
        hidden_B1D = decoder.hidden_states(
            tokens_B[:, None], positions_BT=positions_B[:, None], attention=attention
        )
        return decoder.logits(hidden_B1D[:, 0]).float()

    def weights_changed(self) -> None:
        """After every update of the engine's weights (nothing here: `decoder` reads them)."""

    def sleep(self) -> None:
        """The engine released its KV cache (nothing here)."""

    def wake_up(self) -> None:
        """The engine allocated its KV cache again (nothing here)."""

    def close(self) -> None:
        """Release what the path holds (nothing here)."""


@dataclass(frozen=True, kw_only=True)
class Draw:
    """A step's draw for consecutive rows: tokens, their logprobs, and the rows' sampling
    logprobs (one [B_i, V] tensor per shard; joined only when per-token Python work needs
    them)."""

    tokens_B: torch.Tensor
    token_logprobs_B: torch.Tensor
    logprobs_BV: list[torch.Tensor]

    @staticmethod
    def concat(draws: Sequence[Draw]) -> Draw:
        if len(draws) == 1:
            return draws[0]
        return Draw(
            tokens_B=torch.cat([draw.tokens_B for draw in draws]),
            token_logprobs_B=torch.cat([draw.token_logprobs_B for draw in draws]),
            logprobs_BV=[logprobs_BV for draw in draws for logprobs_BV in draw.logprobs_BV],
        )
