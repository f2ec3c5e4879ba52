"""AdamW with per-call hyperparameters: clipping, the reported norm, and small CPU models
stepping on one thread without touching the caller's thread count."""

from __future__ import annotations

import torch
from torch import nn

from temper.api.types import AdamParams
from temper.distributed.thread_shards import ThreadShards
from temper.trainer.optim import SMALL_TENSOR, AdamW


def _parameters(seed: int) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    parameters = [nn.Parameter(torch.randn(300, 200, generator=generator)) for _ in range(3)]
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator)
    return parameters


def test_clips_to_the_max_norm_and_reports_the_norm_before():
    parameters = _parameters(0)
    norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in parameters])))
    reference = [p.detach().clone().requires_grad_() for p in parameters]
    for copy, parameter in zip(reference, parameters, strict=True):
        copy.grad = parameter.grad * (1.0 / (norm + 1e-6))
    expected = torch.optim.AdamW(reference, lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    expected.step()
    params = AdamParams(learning_rate=1e-2, beta2=0.95, grad_clip_norm=1.0)
    reported = AdamW(parameters).step(params)
    assert abs(reported - norm) <= 1e-5 * norm
    for parameter, copy in zip(parameters, reference, strict=True):
        torch.testing.assert_close(parameter.detach(), copy.detach(), rtol=0, atol=1e-6)
        assert parameter.grad is None  # cleared for the next accumulation


def test_small_cpu_parameters_step_on_one_thread_with_the_same_result():
    assert all(p.numel() < SMALL_TENSOR for p in _parameters(1))
    params = AdamParams(learning_rate=1e-3, grad_clip_norm=0.0)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        threads_seen = []
        one = AdamW(_parameters(1))
        original = one.torch_optimizer.step
        one.torch_optimizer.step = lambda: (
            threads_seen.append(torch.get_num_threads()),
            original(),
        )
        one.step(params)
        assert threads_seen == [1] and torch.get_num_threads() == 2
        # Elementwise updates do not depend on the thread count: bitwise the 2-thread step.
        two = AdamW(_parameters(1))
        two._single_threaded = False
        two.step(params)
        for a, b in zip(one.parameters, two.parameters, strict=True):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(previous)


def test_a_step_in_parts_on_threads_is_bitwise_the_one_call_step():
    """Split over thread shards, every parameter's update, moments and step count are those
    of torch's own step (AdamW is elementwise per parameter), over several steps, and the
    optimizer's state_dict has the same form."""
    sizes = [(29, 16), (300, 200), (7,), (200, 300), (64, 64), (3, 5)]

    def parameters() -> list[nn.Parameter]:
        generator = torch.Generator().manual_seed(4)
        return [nn.Parameter(torch.randn(size, generator=generator)) for size in sizes]

    threads = ThreadShards(2)
    try:
        one, parts = AdamW(parameters()), AdamW(parameters(), threads=threads)
        assert parts.threads is threads
        params = AdamParams(learning_rate=1e-2, beta2=0.95, weight_decay=0.1, grad_clip_norm=1.0)
        for step in range(3):
            generator = torch.Generator().manual_seed(10 + step)
            gradients = [torch.randn(size, generator=generator) for size in sizes]
            for optimizer in (one, parts):
                for parameter, gradient in zip(optimizer.parameters, gradients, strict=True):
                    parameter.grad = gradient.clone()
            assert one.step(params) == parts.step(params)
        for a, b in zip(one.parameters, parts.parameters, strict=True):
            assert torch.equal(a, b)
        want, got = one.torch_optimizer.state_dict(), parts.torch_optimizer.state_dict()
        assert want["param_groups"] == got["param_groups"]
        for index, state in want["state"].items():
            assert state.keys() == got["state"][index].keys()
            for name, value in state.items():
                assert torch.equal(value, got["state"][index][name]), (index, name)
    finally:
        threads.close()
