"""Shared helper: run a loss on hand-picked tokens and read back its gradient."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from temper.losses import get_loss, resolve_config


def loss_and_grad(
    name: str,
    *,
    logprobs: list[float],
    inputs: Mapping[str, list[float]],
    config: Mapping[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(elementwise loss, d sum(loss) / d logprobs), the way the engine sums and backprops."""
    spec = get_loss(name)
    logprobs_N = torch.tensor(logprobs, dtype=torch.float32, requires_grad=True)
    inputs_N = {key: torch.tensor(value, dtype=torch.float32) for key, value in inputs.items()}
    inputs_N["target_tokens"] = torch.zeros(len(logprobs), dtype=torch.int64)
    loss_N = spec.fn(logprobs_N=logprobs_N, inputs=inputs_N, config=resolve_config(spec, config))
    loss_N.sum().backward()
    return loss_N.detach(), logprobs_N.grad
