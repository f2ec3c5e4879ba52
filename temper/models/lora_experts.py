"""LoRA on routed experts: one low-rank pair per expert and projection, held stacked.

Shapes: A token-expert assignments (rows sorted by expert), E experts, R LoRA rank, I/O a
projection's in/out features, D model dim, F expert hidden width.

A MoE block's experts are three stacked weights (gate and up [E, F, D], down [E, D, F]), not
linears, so an adapter cannot wrap one module per projection as `LoraLinear` does. An
`ExpertsLora` holds one projection's pairs for every expert (A [E, R, I], B [E, O, R]; expert e
adds scale * B[e] @ A[e] to its [O, I] weight). `LoraGroupedExperts` is the experts module
with the very same stacked Parameters (state-dict keys unchanged) and the three adapters as
children `w_gate_adapter`, `w_up_adapter`, `w_down_adapter`. It runs on the rows `MoE.combine`
sorted by expert, like the plain experts, but each projection is the base grouped matmul plus
the low-rank term, through `grouped_linear` and autograd: the plain experts' hand-written
backward knows nothing of adapters, and stays the path of every model without them.

The router is never adapted and stays frozen: adapters change what each expert computes; the
choice of experts changes only through the inputs the adapted layers below it produce.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from temper.models.common.moe import GroupedExperts, grouped_linear

EXPERT_TARGETS = ("w_gate", "w_up", "w_down")
"""The stacked expert weights an adapter can target, by their attribute on `GroupedExperts`."""
ADAPTER_SUFFIX = "_adapter"
"""The adapter of expert weight `w_gate` is the child module `w_gate_adapter`."""

LowRank = Callable[[str, torch.Tensor], torch.Tensor | None]
"""(expert weight name, rows sorted by expert [A, I]) -> the low-rank term [A, O], or None."""


def grouped_low_rank(
    x_AI: torch.Tensor,
    lora_A_ERI: torch.Tensor,
    lora_B_EOR: torch.Tensor,
    *,
    counts_E: list[int] | None,
    offsets_E: torch.Tensor | None,
) -> torch.Tensor:
    """Rows sorted by expert, each through its expert's B @ A (unscaled): [A, O].

    The factors are cast to the rows' dtype (autocast does not cover the grouped kernel). The
    grouped kernel needs 16-byte strides, which a rank that is not a multiple of 8 (bf16) does
    not give: such ranks go through per-expert slices, with counts read from the offsets."""
    lora_A_ERI, lora_B_EOR = lora_A_ERI.to(x_AI.dtype), lora_B_EOR.to(x_AI.dtype)
    if offsets_E is not None:
        if lora_A_ERI.shape[1] % 8 == 0:
            lora_A_ERI, lora_B_EOR = lora_A_ERI.contiguous(), lora_B_EOR.contiguous()
        else:
            counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
            offsets_E = None
    low_AR = grouped_linear(x_AI, lora_A_ERI, counts_E=counts_E, offsets_E=offsets_E)
    return grouped_linear(low_AR, lora_B_EOR, counts_E=counts_E, offsets_E=offsets_E)


def swiglu_with_low_rank(
    experts: GroupedExperts,
    x_AD: torch.Tensor,
    *,
    low_rank: LowRank,
    counts_E: list[int] | None,
    offsets_E: torch.Tensor | None,
    weights_A: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' SwiGLU [A, D] on rows sorted by expert, each projection's output plus
    `low_rank` of its input (`GroupedExperts.reference` with adapters); each row scaled by its
    router weight `weights_A` when given (applied before the down projection, which is linear
    with its adapter too)."""
    groups = {"counts_E": counts_E, "offsets_E": offsets_E}

    def project(name: str, x_AI: torch.Tensor) -> torch.Tensor:
        out_AO = grouped_linear(x_AI, getattr(experts, name), **groups)
        delta_AO = low_rank(name, x_AI)
        return out_AO if delta_AO is None else out_AO + delta_AO

    act_AF = F.silu(project("w_gate", x_AD)) * project("w_up", x_AD)
    if weights_A is not None:
        act_AF = act_AF * weights_A.unsqueeze(-1)
    return project("w_down", act_AF)


class ExpertsLora(nn.Module):
    """One expert projection's adapters: expert e's weight [O, I] plus scale * B[e] @ A[e].

    `lora_A_ERI` is the initial A (fp32), cast to the weight's dtype and device; B starts at
    zero."""

    def __init__(self, weight_EOI: torch.Tensor, *, lora_A_ERI: torch.Tensor, alpha: float):
        super().__init__()
        num_experts, out_features, _ = weight_EOI.shape
        rank = lora_A_ERI.shape[1]
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_A = nn.Parameter(lora_A_ERI.to(device=weight_EOI.device, dtype=weight_EOI.dtype))
        self.lora_B = nn.Parameter(weight_EOI.new_zeros(num_experts, out_features, rank))

    def low_rank(
        self, x_AI: torch.Tensor, *, counts_E: list[int] | None, offsets_E: torch.Tensor | None
    ) -> torch.Tensor:
        """scale * B[e] @ A[e] applied to each row of expert e: [A, O]."""
        delta_AO = grouped_low_rank(
            x_AI, self.lora_A, self.lora_B, counts_E=counts_E, offsets_E=offsets_E
        )
        return self.scale * delta_AO

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A per expert [E, O, I] in fp32 (what merging adds to the weight)."""
        return self.scale * (self.lora_B.float() @ self.lora_A.float())  # batched over E

    def extra_repr(self) -> str:
        return f"num_experts={self.lora_A.shape[0]}, rank={self.rank}, alpha={self.alpha}"


class LoraGroupedExperts(GroupedExperts):
    """`GroupedExperts` on `base`'s own stacked weights, plus an optional `ExpertsLora` per
    weight (`w_gate_adapter`, ...; set by `apply_lora`)."""

    def __init__(self, base: GroupedExperts) -> None:
        num_experts, hidden_dim, dim = base.w_gate.shape
        with torch.device("meta"):  # the weights it allocates are replaced by base's below
            super().__init__(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim)
        self.w_gate, self.w_up, self.w_down = base.w_gate, base.w_up, base.w_down
        for name in EXPERT_TARGETS:
            setattr(self, f"{name}{ADAPTER_SUFFIX}", None)

    def forward(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.reference(x_AD, counts_E=counts_E, offsets_E=offsets_E, weights_A=weights_A)

    def reference(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Base experts plus each adapter's low-rank term, through `grouped_linear` and
        autograd (on either device; the forward is this too)."""

        def low_rank(name: str, x_AI: torch.Tensor) -> torch.Tensor | None:
            adapter = getattr(self, f"{name}{ADAPTER_SUFFIX}")
            if adapter is None:
                return None
            return adapter.low_rank(x_AI, counts_E=counts_E, offsets_E=offsets_E)

        return swiglu_with_low_rank(
            self,
            x_AD,
            low_rank=low_rank,
            counts_E=counts_E,
            offsets_E=offsets_E,
            weights_A=weights_A,
        )
