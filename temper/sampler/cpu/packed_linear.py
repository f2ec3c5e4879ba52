"""Decode-time copies of a model's linear weights in oneDNN's blocked layout (CPU only).

Shapes: B rows, D model dim, V vocab; in a MoE block's experts A token-expert assignments
sorted by expert, E experts, F expert hidden width, X = 2F.

At decode batch sizes a linear layer is a matrix-vector product that streams its weight from
memory once per step. On CPU, torch's default kernel for bf16 streams a plain row-major weight
at roughly half the rate oneDNN reaches on the same weight reordered ("prepacked") into its
blocked layout, and the results are bitwise the same (checked in tests/sampler). So decoding
can run the model's own code on a twin of it whose `nn.Linear` leaves read packed weights.

The twin is a shallow copy of the module tree: every other parameter (norms, embedding) is
the model's own tensor, and the model is never modified (the trainer, LoRA and HF export
depend on its structure). The packed weights are a copy: one pass over the weights and as
much memory again. A twin holds the weights as they were when it was made: the CPU wing
(decoding.py) makes a new one whenever the engine's weights generation changes (every
`update_weights`, also the one a trainer sends after an in-place optimizer step).

A MoE block's experts are stacked weights, not `nn.Linear`s: the twin holds `PackedExperts`
in their place, one packed [2F, D] gate/up matrix and one packed [D, F] down matrix per
expert, taking the experts' own call (rows sorted by expert, their per-expert counts). The
block's router (an `nn.Linear`) is packed like any other, and its routing and combining of
the experts' outputs stay the model's own code.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.moe import GroupedExperts


def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack `dtype` weights on this CPU. bf16 needs AVX-512 (or
    AVX-NE-CONVERT); without it oneDNN refuses to pack, and the model decodes as it is."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """F.linear(x, weight, bias) on a copy of `weight` prepacked for about `batch_hint` rows
    (any number of rows works)."""

    def __init__(
        self, weight: torch.Tensor, *, bias: torch.Tensor | None = None, batch_hint: int
    ) -> None:
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class PackedExperts(nn.Module):
    """A `GroupedExperts`' SwiGLU on per-expert copies of its weights prepacked for
    `batch_hint` rows (any number works; the layout barely moves the speed of products this
    small), called as the experts are (CPU: per-expert row counts, router weights applied to
    the activations before the down projection).

    The products are those of the experts' own CPU path (gate and up as one [2F, D] matrix
    per expert, then down), each expert's rows through its packed matrices, and the
    activation runs over all rows at once as there: bitwise the experts' own results in bf16
    (tested)."""

    def __init__(self, experts: GroupedExperts, *, batch_hint: int) -> None:
        super().__init__()
        self.dim, self.hidden_dim = experts.w_down.shape[1:]
        w_gate_up_EXD = torch.cat((experts.w_gate.detach(), experts.w_up.detach()), dim=1)
        self.gate_up = nn.ModuleList(
            PackedLinear(w_XD, batch_hint=batch_hint) for w_XD in w_gate_up_EXD.unbind(0)
        )
        self.down = nn.ModuleList(
            PackedLinear(w_DF, batch_hint=batch_hint) for w_DF in experts.w_down.detach().unbind(0)
        )

    def forward(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert counts_E is not None and offsets_E is None  # the grouped kernel is CUDA's
        ends_E = itertools.accumulate(counts_E)
        ranges = [
            (expert, slice(end - count, end))
            for expert, (count, end) in enumerate(zip(counts_E, ends_E, strict=True))
            if count
        ]
        gate_up_AX = x_AD.new_empty(x_AD.shape[0], 2 * self.hidden_dim)
        for expert, rows in ranges:
            gate_up_AX[rows] = self.gate_up[expert](x_AD[rows])
        act_AF = F.silu(gate_up_AX[:, : self.hidden_dim]) * gate_up_AX[:, self.hidden_dim :]
        if weights_A is not None:  # the router weights, where the experts' own path applies them
            act_AF = act_AF * weights_A.unsqueeze(-1)
        out_AD = x_AD.new_empty(x_AD.shape[0], self.dim)
        for expert, rows in ranges:
            out_AD[rows] = self.down[expert](act_AF[rows])
        return out_AD


def packed_twin(module: nn.Module, *, batch_hint: int) -> nn.Module:
    """A shallow copy of `module` whose `nn.Linear` leaves and MoE experts read packed copies
    of their weights; every other parameter and buffer is the module's own."""
    if isinstance(module, nn.Linear):
        return PackedLinear(module.weight, bias=module.bias, batch_hint=batch_hint)
    if type(module) is GroupedExperts:
        return PackedExperts(module, batch_hint=batch_hint)
    twin = copy.copy(module)  # shares parameters and buffers; children are replaced below
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = {
        name: None if child is None else packed_twin(child, batch_hint=batch_hint)
        for name, child in module._modules.items()
    }
    return twin


class PackedDecoder:
    """A model's decode forward (`hidden_states`, `logits`) on packed linear weights."""

    def __init__(self, model: nn.Module, *, batch_hint: int) -> None:
        self.model = model
        self._twin = packed_twin(model, batch_hint=batch_hint)
        # The output projection is the embedding when tied (not an nn.Linear): pack it too.
        # With an adapter extending it, the model's own `logits` applies the adapter.
        self._output_packed: PackedLinear | None = None
        if getattr(model, "output_adapter", None) is None:
            output = getattr(self._twin, "output", None)
            if not isinstance(output, PackedLinear):
                output = PackedLinear(model.output_weight_VD, batch_hint=batch_hint)
            self._output_packed = output

    def hidden_states(self, tokens_BT: torch.Tensor, **kwargs) -> torch.Tensor:
        return self._twin.hidden_states(tokens_BT, **kwargs)

    def logits(self, hidden_BD: torch.Tensor) -> torch.Tensor:
        if self._output_packed is None:
            return self.model.logits(hidden_BD)
        return self._output_packed(hidden_BD)
