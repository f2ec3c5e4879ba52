"""The generator seam: what sampling clients, jobs and the server ask of a generator backend.

Two backends stand behind it: Temper's KV-cache engine (temper/sampler/engine.py, the
default) and vLLM (vllm.py, extra `vllm`). Both take token-id prompts with Temper's
`SamplingParams` and return Temper's `SampleResponse`s; both report each sampled token's
logprob under the distribution it was drawn from; both take new weights by name while they
run. Which one a client gets is chosen by `GeneratorChoice.Config.backend` (choice.py); the
Temper engine's own settings stay in its `SamplerEngine.Config` (the `sampler` field of job
and server configs).

What differs between them, and what the callers rely on:
- `model`: the module whose tensors the generator reads in place (Temper's engine on a
  trainer's module of the same dtype), else None (vLLM always holds its own copy).
- `holds_one_version`: True when the generator cannot keep an old policy version alive beside
  a new one without a second engine (vLLM). The weight-sync layer then lets requests already
  submitted on the old version finish and retires the old snapshot instead of copying it
  (temper/client/weight_sync.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from temper.api.types import SampleResponse
from temper.sampler.requests import SampleRequest
from temper.sampler.weight_source import WeightUpdate


@runtime_checkable
class Generator(Protocol):
    """A generator backend (see the module docstring)."""

    holds_one_version: bool

    @property
    def model(self) -> nn.Module | None: ...

    @property
    def version(self) -> int:
        """Policy version of the weights in use (set by `update_weights`)."""
        ...

    @property
    def vocab_size(self) -> int: ...

    def generate(self, requests: Sequence[SampleRequest]) -> list[SampleResponse]:
        """Run requests to completion; responses in request order. A bad request raises a
        ValueError naming it before any work."""
        ...

    def score(
        self, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Logprob of tokens[1:] of each sequence given the ones before it (fp32)."""
        ...

    def update_weights(self, source: WeightUpdate, *, version: int) -> None:
        """Sample from these weights from now on."""
        ...

    def sleep(self) -> None:
        """Release the KV cache (and, where the backend can, its weights) until `wake_up`."""
        ...

    def wake_up(self) -> None:
        """Re-acquire what `sleep` released; sampling works again."""
        ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def score_each_alone(
    generator: Generator, sequences: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """`score` of each sequence as if it were alone (a batch's padding would round the
    numbers differently). A generator whose calls are round trips to other ranks does it in
    one call where it can (its `score_alone`)."""
    score_alone = getattr(generator, "score_alone", None)
    if score_alone is not None:
        return score_alone(sequences)
    return [generator.score([sequence])[0] for sequence in sequences]
