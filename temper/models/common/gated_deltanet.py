"""The Gated DeltaNet layer: Qwen3.5's linear attention.

Shapes: B batch, T tokens, D model dim, C conv channels (q, k and v side by side, in
in_proj_qkv's output order), W = conv kernel - 1, N value heads, M key heads, K key head dim,
V value head dim.

x -> in_proj_qkv -> causal depthwise conv1d (kernel W + 1, silu) -> q, k, v; beta = sigmoid(b)
and the log decay g = -exp(A_log) * softplus(a + dt_bias) per value head; the gated delta rule
(delta_rule.py) mixes the tokens; a gated RMSNorm (times silu(z)) and out_proj give the output.
Query and key heads are repeated to the value heads (head n reads key head n // (N / M)).

The layer holds no state. With no `RecurrentStates` (training, scoring) it runs the chunked form
from zero; with one (a sampler) it continues from the states read and writes the states after
each row's last real token, taking the recurrent form for a one-token step (recurrent.py).
Given fla's kernels (fla_kernels.py), a CUDA forward in bf16/fp16 runs the chunked form and the
conv from zero through them instead.

The parameters that no matmul reads (the conv's taps, A_log, dt_bias, the gated norm's weight)
enter at the dtype of the projections' outputs: under a mixed-precision trainer's bf16
autocast over fp32 weights they are rounded to bf16 and the conv multiplies and adds in bf16,
as autocast casts the weights of the projections and as the generator's bf16 copy of the
weights computes (and the delta rule runs with autocast off, delta_rule.py). The trainer's
forward then computes this layer bitwise as the generator does, and the sampler-trainer
mismatch of a hybrid policy keeps only what a dense one has: a bf16-mixed hybrid's
`mismatch/kl` measures 0.4-0.9x a dense policy's, against 1.3-1.55x with the conv in fp32 on
exact taps and the delta rule's products left to autocast (docs/benchmarks.md,
`hybrid_mismatch_sources.py`). In fp32, and in a bf16 model, these casts change nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.causal_conv import CausalConvSilu
from temper.models.common.centered_rmsnorm import GatedRMSNorm
from temper.models.common.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from temper.models.common.fla_kernels import FlaKernels
from temper.models.common.recurrent import RecurrentStates


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        *,
        layer_index: int,
        dim: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        norm_eps: float,
        kernels: FlaKernels | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.kernels = kernels
        """fla's kernels (fla_kernels.py), used where they apply; None: the pure path."""
        self.num_key_heads, self.num_value_heads = num_key_heads, num_value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        key_dim, value_dim = num_key_heads * key_head_dim, num_value_heads * value_head_dim
        self.conv_dim = 2 * key_dim + value_dim
        self.in_proj_qkv = nn.Linear(dim, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, num_value_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, 1, conv_kernel))
        """The depthwise conv's weight [C, 1, W + 1] (HF conv1d.weight)."""
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads))
        self.norm = GatedRMSNorm(value_head_dim, eps=norm_eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)

    @torch.no_grad()
    def reset_parameters(self, *, init_std: float, generator: torch.Generator | None) -> None:
        """This module's own parameters (not its children's), for training from scratch: the
        conv normal(0, init_std) and A = exp(A_log) uniform in [0.01, 16] as the HF init
        draws them, and dt_bias as flash-linear-attention's and Mamba2's init set it, so that
        softplus(dt_bias) is a step dt log-uniform in [0.001, 0.1].

        HF sets dt_bias to one (it only fills weights a checkpoint lacks): the log decay
        g = -A * softplus(a + dt_bias) then starts near -1.3 A, so most heads forget within a
        token, and a tiny hybrid trained from random weights learns slower (docs/rl.md,
        "A hybrid policy")."""
        nn.init.normal_(self.conv_weight, mean=0.0, std=init_std, generator=generator)
        self.A_log.uniform_(0.01, 16.0, generator=generator).log_()
        dt = self.dt_bias.uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp_()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus

    def forward(
        self, x_BTD: torch.Tensor, *, states: RecurrentStates | None = None
    ) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        read = None if states is None else states.read_states(self.layer_index)
        lengths_B = None if states is None else states.lengths_B
        fast = self.kernels is not None and self.kernels.applies(x_BTD)
        qkv_BTC = self.in_proj_qkv(x_BTD)
        if states is None and fast and self.kernels.causal_conv1d_fn is not None:
            conv_BTC = self.kernels.causal_conv(qkv_BTC, self._conv_taps(qkv_BTC))
            conv_BCW = None
        elif states is None:
            conv_BTC, conv_BCW = self._causal_conv(qkv_BTC), None
        else:
            conv_BTC, conv_BCW = self._conv_from_state(
                qkv_BTC, None if read is None else read[0], lengths_B=lengths_B
            )
        key_dim = self.num_key_heads * self.key_head_dim
        q_BTX, k_BTX, v_BTX = conv_BTC.split(
            (key_dim, key_dim, self.conv_dim - 2 * key_dim), dim=-1
        )
        q_BTMK, k_BTMK = (
            x.unflatten(-1, (self.num_key_heads, self.key_head_dim)) for x in (q_BTX, k_BTX)
        )
        v_BTNV = v_BTX.reshape(B, T, self.num_value_heads, self.value_head_dim)
        beta_BTN = self.in_proj_b(x_BTD).sigmoid()
        # In fp32 (a bf16 or fp16 exp(A_log) may overflow), from A_log and dt_bias at the
        # projection's dtype, as a generator's bf16 copy holds them (see the class docstring).
        a_BTN = self.in_proj_a(x_BTD)
        A_N = self.A_log.to(a_BTN.dtype).float().exp()
        g_BTN = -A_N * F.softplus(a_BTN.float() + self.dt_bias.to(a_BTN.dtype))
        if lengths_B is not None:
            # beta = 0 and g = 0 leave the state unchanged over right padding.
            real_BT1 = (torch.arange(T, device=x_BTD.device) < lengths_B[:, None])[..., None]
            beta_BTN = beta_BTN * real_BT1
            g_BTN = g_BTN * real_BT1
        state_BNKV = None if read is None else read[1]
        if T == 1 and state_BNKV is not None:
            group = self.num_value_heads // self.num_key_heads
            q_BTNK, k_BTNK = (x.repeat_interleave(group, dim=2) for x in (q_BTMK, k_BTMK))
            out_BTNV, state_BNKV = recurrent_gated_delta_rule(
                q_BTNK, k_BTNK, v_BTNV, g_BTN, beta_BTN, state_BNKV=state_BNKV
            )
        elif fast:
            out_BTNV, state_BNKV = self.kernels.chunk_rule(
                q_BTMK, k_BTMK, v_BTNV, g_BTN, beta_BTN, state_BNKV=state_BNKV
            )
        else:
            # A sampler's prefill may run a short prompt as one smaller chunk; the full-sequence
            # path (training, scoring) keeps whole chunks, so a datum's numbers do not depend
            # on how long the other rows of its batch are.
            out_BTNV, state_BNKV = chunk_gated_delta_rule(
                q_BTMK,
                k_BTMK,
                v_BTNV,
                g_BTN,
                beta_BTN,
                state_BNKV=state_BNKV,
                short_chunk=states is not None,
            )
        if states is not None:
            states.write_states(self.layer_index, conv_BCW=conv_BCW, state_BNKV=state_BNKV)
        z_BTNV = self.in_proj_z(x_BTD).view(B, T, self.num_value_heads, self.value_head_dim)
        return self.out_proj(self.norm(out_BTNV, z_BTNV).reshape(B, T, -1))

    def _causal_conv(self, qkv_BTC: torch.Tensor) -> torch.Tensor:
        """silu(causal depthwise conv) from zero history: [B, T, C]."""
        return CausalConvSilu.apply(qkv_BTC, self._conv_taps(qkv_BTC), 0)

    def _conv_taps(self, qkv_BTC: torch.Tensor) -> torch.Tensor:
        """The conv's weight [C, W + 1] in its inputs' dtype (the class docstring says why)."""
        return self.conv_weight[:, 0].to(qkv_BTC.dtype)

    def _conv_from_state(
        self,
        qkv_BTC: torch.Tensor,
        conv_BCW: torch.Tensor | None,
        *,
        lengths_B: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(silu(conv) [B, T, C] continuing from `conv_BCW` (None: zeros), the conv state after
        each row's last real input [B, C, W])."""
        B, T, C = qkv_BTC.shape
        W = self.conv_weight.shape[-1] - 1
        if conv_BCW is None:
            conv_BCW = qkv_BTC.new_zeros(B, C, W)
        inputs_BXC = torch.cat((conv_BCW.transpose(1, 2).to(qkv_BTC.dtype), qkv_BTC), dim=1)
        out_BTC = CausalConvSilu.apply(inputs_BXC, self._conv_taps(qkv_BTC), W)
        if lengths_B is None:
            return out_BTC, inputs_BXC[:, T:].transpose(1, 2)
        # Row b's last W real inputs sit at [lengths_B[b], lengths_B[b] + W) of inputs_BXC.
        window_BW = lengths_B[:, None] + torch.arange(W, device=qkv_BTC.device)
        last_BWC = inputs_BXC.gather(1, window_BW[:, :, None].expand(B, W, C))
        return out_BTC, last_BWC.transpose(1, 2)
