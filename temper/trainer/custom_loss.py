"""Tinker's custom losses (`forward_backward_custom`): a loss computed by the caller from the
trainer's per-datum logprobs, turned into per-token weights whose weighted logprob sum has the
loss's gradient (the engine back-propagates that sum)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from temper.api.types import Datum

CustomLossFn = Callable[[list[Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]
"""Tinker's custom loss: (data, per-datum logprobs) -> (loss, metrics)."""


def custom_loss_weights(
    loss_fn: CustomLossFn, data: Sequence[Datum], logprobs: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float], list[torch.Tensor]]:
    """(loss, metrics, dloss/dlogprobs per datum) of a custom loss; a rank of a sharded
    engine that holds no datums this call contributes nothing."""
    if not data:
        return torch.zeros(()), {}, []
    leaves = [lp.detach().clone().requires_grad_(True) for lp in logprobs]
    result = loss_fn(list(data), leaves)
    # Everything is checked before the backward pass, so a bad result changes no gradient.
    where = "forward_backward_custom: loss_fn"
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(f"{where} must return (loss, metrics), got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else list(loss.shape)
        raise TypeError(f"{where} must return a 0-d tensor as its loss, got {got}")
    if not loss.requires_grad:
        raise ValueError(
            f"{where} returned a loss that does not depend on the logprobs it was given "
            "(requires_grad=False); compute it from those tensors, without .detach()"
        )
    if not bool(torch.isfinite(loss)):
        raise ValueError(f"{where} returned a non-finite loss ({loss.item()})")
    metrics = float_metrics(metrics, where=where)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    weights = [
        torch.zeros_like(leaf) if grad is None else grad.detach()
        for leaf, grad in zip(leaves, grads, strict=True)
    ]
    for index, weights_T in enumerate(weights):
        if not bool(torch.isfinite(weights_T).all()):
            raise ValueError(
                f"{where}: the loss's gradient with respect to datum {index}'s logprobs is "
                "not finite"
            )
    return loss, metrics, weights


def float_metrics(metrics: object, *, where: str) -> dict[str, float]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where} must return its metrics as a dict, got {type(metrics).__name__}")
    converted = {}
    for key, value in metrics.items():
        try:
            converted[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of many values
            raise TypeError(f"{where}: metrics[{key!r}] must be a number, got {value!r}") from None
    return converted
