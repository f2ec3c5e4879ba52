"""Gradient norm and clipping over gradients that may be DTensors on different meshes.

A model parallelized with FSDP and TP holds plain tensors (single process), DTensors sharded
over the data-parallel mesh, and 2-D DTensors over (dp, tp); torch's foreach norm cannot mix
meshes. Gradients are grouped by (mesh, placements), each group's norm is reduced to a full
(global) value once, and the groups are combined: one collective per group, not per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def settle_partial_grads(parameters: Sequence[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placements.

    A replicated parameter used on sharded activations (a per-head norm under TP) gets a
    partial-sum gradient; summing it here (an all-reduce over the tp group) before the norm and
    the optimizer makes it the whole gradient.
    """
    for parameter in parameters:
        grad = parameter.grad
        if isinstance(grad, DTensor) and grad.placements != parameter.placements:
            parameter.grad = grad.redistribute(
                device_mesh=parameter.device_mesh, placements=parameter.placements
            )


def total_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` together, as a plain 0-d fp32 tensor equal on every rank."""
    groups: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None
        groups.setdefault(key, []).append(grad)
    norms = []
    for members in groups.values():
        norm = torch.nn.utils.get_total_norm(members, norm_type=2.0)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().cpu())
    if len(norms) == 1:
        return norms[0]  # single process: exactly torch's clip_grad_norm_ value
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm(parameters: Sequence[nn.Parameter], *, max_norm: float) -> float:
    """Scale gradients so their joint norm is at most `max_norm`; returns the norm before.

    `max_norm=inf` measures without clipping.
    """
    with_grad = [p for p in parameters if p.grad is not None]
    if not with_grad:
        return 0.0
    settle_partial_grads(with_grad)
    norm = total_grad_norm([p.grad for p in with_grad])
    if not math.isinf(max_norm):
        # The same coefficient as torch's clip_grad_norm_: max_norm / (norm + 1e-6), at most 1.
        coefficient = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
        by_kind: dict[object, list[torch.Tensor]] = {}
        for parameter in with_grad:
            grad = parameter.grad
            key = (grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else grad.device
            by_kind.setdefault(key, []).append(grad)
        for grads in by_kind.values():
            torch._foreach_mul_(grads, coefficient)  # one multi-tensor op per kind of gradient
    return float(norm)
