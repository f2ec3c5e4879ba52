"""The Gated DeltaNet's GPU speed wing: flash-linear-attention's chunked gated delta rule (and
causal-conv1d's conv) in place of the pure-PyTorch forms, when installed.

Shapes: B batch, T tokens, H key heads, N value heads, K key head dim, V value head dim,
C conv channels, J conv taps.

`load_fla_kernels` looks the packages up once, when a layer is built; a layer given kernels
uses them for a forward whose input is on CUDA in bf16 or fp16 (fla's chunked kernel refuses
fp32), and the pure path (delta_rule.py, causal_conv.py) otherwise: on CPU, in fp32, and for
the sampler's one-token recurrent step. The pure path stays the readable reference; a GPU test
compares the two.

fla's conventions, as the layer feeds them: [B, T, heads, dim] (not head-first); q and k with
as many heads as v (repeated here); g the per-token log decay in fp32; scale K**-0.5; q and k
L2-normalized inside the kernel (use_qk_l2norm_in_kernel); initial_state [B, N, K, V] and the
final state asked for (the sampler carries it). causal_conv1d_fn takes [B, C, T], which a
transposed [B, T, C] view is (channels-last strides), and a [C, J] weight.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

LinearAttentionKernels = Literal["auto", "torch"]
"""'auto': fla's kernels where they apply when installed; 'torch': always the pure path."""
LINEAR_ATTENTION_KERNELS = ("auto", "torch")


@dataclass(frozen=True)
class FlaKernels:
    chunk_gated_delta_rule: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule."""
    causal_conv1d_fn: Callable[..., torch.Tensor] | None
    """causal_conv1d.causal_conv1d_fn, or None when that package is absent."""

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """Whether a forward on `x` runs the kernels (CUDA, half precision)."""
        return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)

    def chunk_rule(
        self,
        q_BTHK: torch.Tensor,
        k_BTHK: torch.Tensor,
        v_BTNV: torch.Tensor,
        g_BTN: torch.Tensor,
        beta_BTN: torch.Tensor,
        *,
        state_BNKV: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """delta_rule.chunk_gated_delta_rule's contract: (out_BTNV in v's dtype, final
        state_BNKV fp32)."""
        group = v_BTNV.shape[2] // k_BTHK.shape[2]
        q_BTNK, k_BTNK = (x.repeat_interleave(group, dim=2) for x in (q_BTHK, k_BTHK))
        out_BTNV, state_BNKV = self.chunk_gated_delta_rule(
            q_BTNK,
            k_BTNK,
            v_BTNV,
            g=g_BTN.float(),
            beta=beta_BTN.to(v_BTNV.dtype),
            scale=k_BTHK.shape[-1] ** -0.5,
            initial_state=None if state_BNKV is None else state_BNKV.float(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return out_BTNV.to(v_BTNV.dtype), state_BNKV.float()

    def causal_conv(self, qkv_BTC: torch.Tensor, weight_CJ: torch.Tensor) -> torch.Tensor:
        """silu(causal depthwise conv) from zero history, [B, T, C] (causal_conv.py's)."""
        assert self.causal_conv1d_fn is not None
        out_BCT = self.causal_conv1d_fn(qkv_BTC.transpose(1, 2), weight_CJ, None, activation="silu")
        return out_BCT.transpose(1, 2)


def load_fla_kernels(mode: LinearAttentionKernels) -> FlaKernels | None:
    """fla's kernels if `mode` is 'auto' and flash-linear-attention is importable, else None
    (the pure path)."""
    if mode not in LINEAR_ATTENTION_KERNELS:
        raise ValueError(
            f"linear_attention_kernels must be one of {list(LINEAR_ATTENTION_KERNELS)}, "
            f"got {mode!r}"
        )
    if mode == "torch":
        return None
    try:
        rule_module = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError:
        return None
    try:
        conv = importlib.import_module("causal_conv1d").causal_conv1d_fn
    except ImportError:
        conv = None
    return FlaKernels(
        chunk_gated_delta_rule=rule_module.chunk_gated_delta_rule, causal_conv1d_fn=conv
    )
