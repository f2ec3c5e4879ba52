"""AdamW whose hyperparameters come with each step (Tinker's `optim_step(AdamParams)`).

The torch AdamW instance is kept for its state (moments, step counts); before each step its
param groups take the call's learning rate, betas, eps and weight decay. The gradient norm is
measured over all trainable parameters before clipping and reported either way.

Plain (unsharded) CPU or CUDA parameters use torch's multi-tensor ("foreach") AdamW; sharded
(DTensor) parameters the default. torch's fused kernel would save ~2 ms a step on the tiny
model, but it rounds differently (~1e-6), and in two RL runs with it the sum_digits recipe
learned visibly less than with the foreach kernel (tests/rl/test_job.py), so it is not used. CPU
parameters that are all small step on one thread (see SMALL_TENSOR).

Given `threads` (the trainer's thread shards, CPU), the foreach step runs as that many parts at
once, each on its own share of the parameters (balanced by size). Every AdamW operation is
elementwise with per-parameter scalars, so each parameter's update, moments and step count are
bitwise those of the one-call step; the state lives in the one torch optimizer either way (its
state_dict and checkpoints do not change). On the tiny model: 4.9-5.0 -> 3.7-4.1 ms a step in
the RL loop (docs/rl.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as functional_adam

from temper.api.types import AdamParams
from temper.distributed.grad_norm import clip_grad_norm
from temper.distributed.thread_shards import ThreadShards, split_by_tokens

SMALL_TENSOR = 1 << 20
"""Elements below which a CPU tensor's optimizer ops do not gain from intra-op threads."""


class AdamW:
    def __init__(
        self, parameters: Sequence[nn.Parameter], *, threads: ThreadShards | None = None
    ) -> None:
        """`threads`: run the step as parts on these single-threaded workers (CPU, foreach)."""
        self.parameters = list(parameters)
        if not self.parameters:
            raise ValueError("no trainable parameters: nothing for the optimizer to update")
        # On CPU, a step over small tensors runs faster on one thread: each multi-tensor op
        # would wake a second thread per tensor (~0.1 ms each on a 2-core VM), more than
        # splitting a tensor under SMALL_TENSOR elements saves. The tiny model's step: 4.6 ms
        # on one thread, 9.2 ms on two.
        self._single_threaded = all(
            p.device.type == "cpu" and p.numel() < SMALL_TENSOR for p in self.parameters
        )
        # Hyperparameters are placeholders until the first step sets them.
        foreach = _can_fuse(self.parameters)
        self.torch_optimizer = torch.optim.AdamW(
            self.parameters, lr=0.0, weight_decay=0.0, foreach=foreach or None
        )
        on_cpu = all(p.device.type == "cpu" for p in self.parameters)
        self.threads = threads if foreach and on_cpu else None

    def step(self, params: AdamParams) -> float:
        """One AdamW step on the accumulated gradients, then clear them; returns the gradient
        norm before clipping."""
        if not self._single_threaded:
            return self._step(params)
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._step(params)
        finally:
            torch.set_num_threads(previous)

    def _step(self, params: AdamParams) -> float:
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else math.inf
        # Works on sharded (DTensor) gradients too: the norm is the global one, equal on every
        # rank, and partial TP gradients are summed first.
        grad_norm = clip_grad_norm(self.parameters, max_norm=max_norm)
        for group in self.torch_optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        if self.threads is None:
            self.torch_optimizer.step()
        else:
            self._step_in_parts(self.threads)
        self.torch_optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def _step_in_parts(self, threads: ThreadShards) -> None:
        """`torch_optimizer.step()`, its parameters split into parts that step at once."""
        optimizer = self.torch_optimizer
        (group,) = optimizer.param_groups
        # Each parameter's state, created on its first step exactly as torch's own step does.
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], [], []
        has_complex = optimizer._init_group(
            group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        )
        beta1, beta2 = group["betas"]

        @torch.no_grad()  # grad mode is per thread
        def step_part(part: range) -> None:
            functional_adam(
                params[part.start : part.stop],
                grads[part.start : part.stop],
                exp_avgs[part.start : part.stop],
                exp_avg_sqs[part.start : part.stop],
                max_exp_avg_sqs[part.start : part.stop],
                steps[part.start : part.stop],
                amsgrad=group["amsgrad"],
                has_complex=has_complex,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=True,
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=None,
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )

        # Consecutive parts balanced by elements (the split the shards use for tokens).
        threads.map(step_part, split_by_tokens([p.numel() for p in params], threads.num_threads))


def _can_fuse(parameters: Sequence[nn.Parameter]) -> bool:
    return all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") for p in parameters)
