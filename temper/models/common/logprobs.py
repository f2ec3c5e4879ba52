"""Log-probabilities of target tokens without materializing [tokens, vocab] fp32 logits.

Shapes: N tokens (batch and time flattened), D model dim, V vocab, B batch, T time, K target
tokens scored per position (1 unless several candidates are given, as top-K distillation does).

The trainer and the sampler's `score()` both call `target_logprobs`, so their logprobs are
bitwise equal when given the same hidden states. Rows are processed in chunks sized so one
chunk of fp32 logits fits `chunk_bytes`; with several chunks the backward pass recomputes each
chunk's log-softmax from the saved hidden states instead of keeping it, so peak memory is one
chunk in both directions (a lone chunk's log-softmax is simply kept, and its buffer becomes the
gradient of the logits in place).

Numerics: logits are produced in the weights' dtype (as an `nn.Linear` unembedding would; under
autocast, in the autocast dtype) and the softmax runs in fp32. With a temperature, the
distribution is softmax(logits / temperature), the one a sampler at that temperature draws from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_BYTES = 256 * 2**20


def _chunk_rows(*, vocab_size: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (vocab_size * 4))


def _chunk_logits(
    hidden_ND: torch.Tensor, weight_VD: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits_NV = F.linear(hidden_ND, weight_VD).float()
    return logits_NV if temperature == 1.0 else logits_NV / temperature


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_ND, weight_VD, targets_NK, temperature, chunk_rows):
        num_tokens = hidden_ND.shape[0]
        logprobs_NK = hidden_ND.new_empty(targets_NK.shape, dtype=torch.float32)
        for start in range(0, num_tokens, chunk_rows):
            rows = slice(start, start + chunk_rows)
            # One fused row-wise kernel (max, sum of exps, subtract); 3-4x cheaper on CPU than
            # logsumexp followed by a subtraction.
            logprobs_NV = _chunk_logits(hidden_ND[rows], weight_VD, temperature).log_softmax(-1)
            logprobs_NK[rows] = logprobs_NV.gather(-1, targets_NK[rows])
        # A single chunk fits the memory budget by construction: keep its log-softmax for
        # backward (where it becomes the gradient in place) instead of recomputing it, which
        # saves a [N, D] x [D, V] matmul. Without a backward (no_grad), autograd drops ctx.
        ctx.saved_logprobs = logprobs_NV if 0 < num_tokens <= chunk_rows else None
        ctx.save_for_backward(hidden_ND, weight_VD, targets_NK)
        ctx.temperature = temperature
        ctx.chunk_rows = chunk_rows
        return logprobs_NK

    @staticmethod
    def backward(ctx, grad_logprobs_NK):
        hidden_ND, weight_VD, targets_NK = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        num_tokens = hidden_ND.shape[0]
        grad_hidden_ND = torch.empty_like(hidden_ND) if need_hidden else None
        grad_weight_VD = None
        # Taken, not borrowed: the gradient overwrites it, and a second backward through a
        # retained graph recomputes it.
        saved_logprobs_NV, ctx.saved_logprobs = ctx.saved_logprobs, None
        for start in range(0, num_tokens, chunk_rows):
            rows = slice(start, start + chunk_rows)
            logprobs_NV = saved_logprobs_NV
            if logprobs_NV is None:
                logprobs_NV = _chunk_logits(hidden_ND[rows], weight_VD, temperature).log_softmax(-1)
            grad_NK = grad_logprobs_NK[rows].float()
            # d logprob(target) / d logits = onehot(target) - softmax, times 1/temperature;
            # summed over a position's K targets (K = 1 sums one number: exact).
            grad_logits_NV = logprobs_NV.exp_().mul_(-grad_NK.sum(-1, keepdim=True))
            grad_logits_NV.scatter_add_(-1, targets_NK[rows], grad_NK)
            if temperature != 1.0:
                grad_logits_NV.div_(temperature)
            if need_hidden:
                grad_hidden_ND[rows] = grad_logits_NV.to(weight_VD.dtype) @ weight_VD
            if need_weight:
                # Accumulated over chunks in fp32, whatever the weights' dtype.
                chunk_grad_VD = grad_logits_NV.T @ hidden_ND[rows].float()
                if grad_weight_VD is None:
                    grad_weight_VD = chunk_grad_VD
                else:
                    grad_weight_VD += chunk_grad_VD
        if need_weight:
            if grad_weight_VD is None:  # no tokens
                grad_weight_VD = torch.zeros_like(weight_VD)
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        return grad_hidden_ND, grad_weight_VD, None, None, None


def target_logprobs(
    hidden_BTD: torch.Tensor,
    weight_VD: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T / temperature)[target] as fp32, shaped like `targets_BT`.

    `targets_BT` is shaped like the hidden states without their last dim, or has one more
    trailing dim K ([B, T, K]): K tokens scored at each position, from one softmax.
    Differentiable with respect to `hidden_BTD` and `weight_VD`.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens, got {temperature}")
    positions = hidden_BTD.shape[:-1]
    if targets_BT.shape[: len(positions)] != positions or targets_BT.ndim > len(positions) + 1:
        raise ValueError(
            f"targets shape {tuple(targets_BT.shape)} does not match hidden states "
            f"{tuple(positions)} (one more trailing dim, K targets per position, is allowed)"
        )
    vocab_size = weight_VD.shape[0]
    rows = _chunk_rows(vocab_size=vocab_size, chunk_bytes=chunk_bytes)
    hidden_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
    num_targets = targets_BT.shape[-1] if targets_BT.ndim > len(positions) else 1
    targets_NK = targets_BT.reshape(hidden_ND.shape[0], num_targets)
    device_type = hidden_ND.device.type
    if torch.is_autocast_enabled(device_type):
        # Mixed precision: the unembedding matmul in the autocast dtype, as a linear layer
        # would run, in forward and in backward's recomputation alike (autocast is off in
        # backward); the casts carry the gradients back to the fp32 tensors.
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            logprobs_NK = _TargetLogprobs.apply(
                hidden_ND.to(dtype), weight_VD.to(dtype), targets_NK, float(temperature), rows
            )
    else:
        logprobs_NK = _TargetLogprobs.apply(
            hidden_ND, weight_VD, targets_NK, float(temperature), rows
        )
    return logprobs_NK.view(targets_BT.shape)


def forward_logprobs(
    model: torch.nn.Module,
    inputs_BT: torch.Tensor,
    targets_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprobs of `targets_BT` after a full forward of `inputs_BT` (right-padded).

    The one scoring path: the trainer and the sampler's `score()` both call it.
    """
    hidden_BTX, weight_VX = model.logit_inputs(model.hidden_states(inputs_BT))
    return target_logprobs(hidden_BTX, weight_VX, targets_BT, temperature=temperature)
