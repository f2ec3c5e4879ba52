"""Domain types mirroring Tinker's names and semantics (the server converts wire types to these).

Only the sampling types exist so far; training types (Datum, ModelInput, AdamParams, ...) join
with the trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

StopReason = Literal["stop", "length"]
TopkLogprobs = list[tuple[int, float]]
"""The k most likely (token id, logprob) pairs at one position, most likely first."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to draw completions (Tinker semantics).

    temperature 0 means greedy decoding. top_k -1 (Tinker's default) or 0 means no top-k limit.
    stop: None stops at the tokenizer's EOS; a string or list of strings adds stop strings; a
    list of ints adds stop token ids (EOS still stops in both cases); [] disables stopping
    entirely, EOS included, so generation runs to max_tokens.
    """

    max_tokens: int | None = None
    """Most tokens to generate; None: up to the sampler's context limit."""
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop: str | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None
    """Same seed, prompt and weights give the same tokens, whatever else shares the batch."""

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (
            isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
        ):
            raise TypeError(f"max_tokens must be an int or None, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0 (or None), got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or -1/0 for no limit, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise TypeError(f"seed must be an int or None, got {self.seed!r}")
        _check_stop(self.stop)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if isinstance(self.stop, str):
            return (self.stop,)
        if self.stop and isinstance(self.stop[0], str):
            return tuple(self.stop)
        return ()

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        if self.stop and not isinstance(self.stop, str) and isinstance(self.stop[0], int):
            return tuple(self.stop)
        return ()

    @property
    def stops_at_eos(self) -> bool:
        return self.stop is None or len(self.stop) > 0


def _check_stop(stop: object) -> None:
    if stop is None or isinstance(stop, str):
        if stop == "":
            raise ValueError("stop must not be the empty string")
        return
    if not isinstance(stop, Sequence):
        raise TypeError(f"stop must be None, a string, or a list of strings or ints, got {stop!r}")
    kinds = {type(item) for item in stop}
    if kinds - {str, int} or len(kinds) > 1:
        raise TypeError(f"stop must be all strings or all ints, got {list(stop)!r}")
    if any(item == "" for item in stop):
        raise ValueError("stop strings must not be empty")
    if any(isinstance(item, int) and item < 0 for item in stop):
        raise ValueError(f"stop token ids must be >= 0, got {list(stop)!r}")


@dataclass(frozen=True, kw_only=True)
class SampledSequence:
    tokens: list[int]
    """Generated tokens; a stop token or the tokens completing a stop string are included."""
    logprobs: list[float]
    """Logprob of each generated token under the distribution it was drawn from."""
    stop_reason: StopReason
    topk_logprobs: list[TopkLogprobs] | None = None
    """Per generated position, when requested."""


@dataclass(frozen=True, kw_only=True)
class SampleResponse:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    """Per prompt position (None at position 0), when requested."""
    topk_prompt_logprobs: list[TopkLogprobs | None] | None = None
    """Per prompt position (None at position 0), when requested."""
