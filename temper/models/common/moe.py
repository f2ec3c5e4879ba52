"""Mixture-of-Experts feed-forward: a softmax top-k router over SwiGLU experts held stacked.

Shapes: N tokens (batch and time flattened), D model dim, F expert hidden width, E experts,
K experts per token (top-k), A token-expert assignments (N * K).

The experts' weights are three stacked parameters ([E, F, D], [E, F, D], [E, D, F]), not E
modules: the assignments are sorted by expert once, and each projection is one grouped matmul
over the sorted rows (`F.grouped_mm` on CUDA in bf16, where a kernel exists) or, elsewhere, one
matmul per expert on contiguous slices of the sorted rows. Either way each token's output is
the sum of its top-k experts' outputs scaled by their router weights, added up in top-k
order without atomics: deterministic on every device, and a token's result does not depend on
which other tokens share its batch (up to the matmul kernels' blocking by row count, as in any
linear layer).

The router's choices are kept on the module when `keep_routing` is set (the trainer sets it to
report router metrics and the load-balancing loss, see moe_stats.py); decode leaves it off. They
are kept per calling thread: the trainer's thread shards run forwards of one module at once,
and an asynchronous run's sampler may decode on the trainer's module while it trains.

Routing replay, per calling thread too: a thread with a `ReplayedRoutes` in `replays` sends
the tokens it names to the experts given there instead of the router's top-k, each weighted by
the router's probability of that expert (renormalized as `norm_topk_prob` says), so the router
still gets gradients (trainer/routing_replay.py). A thread with a list in `tapes` appends every
forward's experts to it (the sampler's route records, sampler/routes.py).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Routing:
    """One forward's routing in one MoE layer, flattened over batch and time."""

    probs_NE: torch.Tensor
    """Router softmax over all experts, fp32 (differentiable: the load-balancing loss uses it)."""
    experts_NK: torch.Tensor
    """The top-k experts each token was sent to."""


def route(
    logits_NE: torch.Tensor, *, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs_NE fp32, weights_NK in the logits' dtype, experts_NK) of a softmax top-k router.

    The softmax is taken in fp32 over all experts; with `norm_topk_prob` the top-k weights are
    renormalized to sum to one, else they keep their share of the full softmax."""
    probs_NE = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    weights_NK, experts_NK = torch.topk(probs_NE, top_k, dim=-1)
    if norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return probs_NE, weights_NK.to(logits_NE.dtype), experts_NK


def topk_weights(
    probs_NE: torch.Tensor, experts_NK: torch.Tensor, *, norm_topk_prob: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The router weights of given experts: their probabilities, renormalized to sum to one
    with `norm_topk_prob`; for the router's own top-k, bitwise `route`'s weights."""
    weights_NK = probs_NE.gather(-1, experts_NK)
    if norm_topk_prob:
        weights_NK = weights_NK / weights_NK.sum(dim=-1, keepdim=True)
    return weights_NK.to(dtype)


@dataclass(frozen=True)
class ReplayedRoutes:
    """Experts to send one forward's tokens to (a row per token of the flattened input)."""

    experts_NK: torch.Tensor
    """int64 expert ids, used where `given_N1` is set."""
    given_N1: torch.Tensor
    """bool [N, 1]: the tokens replayed; the others keep the router's choice (padding)."""


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` has a kernel for x: bf16 on a CUDA device of compute
    capability 8.0 or newer."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device)[0] >= 8
    )


def grouped_linear(
    x_AI: torch.Tensor,
    weight_EOI: torch.Tensor,
    *,
    counts_E: list[int] | None,
    offsets_E: torch.Tensor | None,
) -> torch.Tensor:
    """Rows of x sorted by expert, each multiplied by its expert's weight: [A, O].

    `offsets_E` (int32 cumulative counts) selects the grouped kernel; otherwise `counts_E`
    (host ints) slices the rows, one matmul per expert with any rows."""
    if offsets_E is not None:
        return F.grouped_mm(x_AI, weight_EOI.transpose(-2, -1), offs=offsets_E)
    assert counts_E is not None
    # unbind, not weight_EOI[e]: its backward stacks the E gradients once, where indexing
    # would add each expert's gradient into a zero-filled [E, O, I] tensor.
    pieces = [
        F.linear(rows_I, weight_OI)
        for weight_OI, rows_I in zip(weight_EOI.unbind(0), x_AI.split(counts_E), strict=True)
        if rows_I.shape[0]
    ]
    if not pieces:
        return x_AI.new_zeros(0, weight_EOI.shape[1])
    return torch.cat(pieces)


class _SlicedSwiGLU(torch.autograd.Function):
    """The experts' SwiGLU over rows sorted by expert, one matmul per expert and projection,
    with a hand-written backward.

    Gate and up run as one matmul against their concatenated weights ([E, 2F, D], a copy made
    per call that costs far less than the matmul it saves on small experts), and so do their
    weight and input gradients. Autograd through per-expert slices would also allocate and fill
    a zero gradient for every slice; here each expert's gradients are written in place into the
    [E, ...] gradient tensors. The math is the autograd of `GroupedExperts.reference`."""

    @staticmethod
    def forward(ctx, x_AD, w_gate_EFD, w_up_EFD, w_down_EDF, counts_E):
        F_ = w_gate_EFD.shape[1]
        w_gate_up_EXD = torch.cat((w_gate_EFD, w_up_EFD), dim=1)
        gate_up_AX = x_AD.new_empty(x_AD.shape[0], 2 * F_)
        ranges = _row_ranges(counts_E)
        for e, rows in ranges:
            torch.mm(x_AD[rows], w_gate_up_EXD[e].t(), out=gate_up_AX[rows])
        gate_AF, up_AF = gate_up_AX[:, :F_], gate_up_AX[:, F_:]
        act_AF = F.silu(gate_AF) * up_AF
        out_AD = x_AD.new_empty(x_AD.shape[0], w_down_EDF.shape[1])
        for e, rows in ranges:
            torch.mm(act_AF[rows], w_down_EDF[e].t(), out=out_AD[rows])
        ctx.save_for_backward(x_AD, w_gate_up_EXD, w_down_EDF, gate_up_AX, act_AF)
        ctx.ranges = ranges
        return out_AD

    @staticmethod
    def backward(ctx, d_out_AD):
        x_AD, w_gate_up_EXD, w_down_EDF, gate_up_AX, act_AF = ctx.saved_tensors
        F_ = w_down_EDF.shape[2]
        d_out_AD = d_out_AD.contiguous()
        d_w_down_EDF = torch.zeros_like(w_down_EDF)
        d_act_AF = torch.empty_like(act_AF)
        for e, rows in ctx.ranges:
            torch.mm(d_out_AD[rows].t(), act_AF[rows], out=d_w_down_EDF[e])
            torch.mm(d_out_AD[rows], w_down_EDF[e], out=d_act_AF[rows])
        gate_AF, up_AF = gate_up_AX[:, :F_], gate_up_AX[:, F_:]
        sig_AF = torch.sigmoid(gate_AF)
        d_gate_up_AX = torch.empty_like(gate_up_AX)
        torch.mul(d_act_AF * up_AF, sig_AF * (1 + gate_AF * (1 - sig_AF)), out=d_gate_up_AX[:, :F_])
        torch.mul(d_act_AF, gate_AF * sig_AF, out=d_gate_up_AX[:, F_:])
        d_x_AD = torch.empty_like(x_AD)
        d_w_gate_up_EXD = torch.zeros_like(w_gate_up_EXD)
        for e, rows in ctx.ranges:
            torch.mm(d_gate_up_AX[rows].t(), x_AD[rows], out=d_w_gate_up_EXD[e])
            torch.mm(d_gate_up_AX[rows], w_gate_up_EXD[e], out=d_x_AD[rows])
        d_w_gate_EFD, d_w_up_EFD = d_w_gate_up_EXD.split(F_, dim=1)
        return d_x_AD, d_w_gate_EFD, d_w_up_EFD, d_w_down_EDF, None


def _row_ranges(counts_E: list[int]) -> list[tuple[int, slice]]:
    """(expert, its rows) for every expert with rows, rows sorted by expert."""
    ranges, start = [], 0
    for expert, count in enumerate(counts_E):
        if count:
            ranges.append((expert, slice(start, start + count)))
        start += count
    return ranges


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: down(silu(gate(x)) * up(x)) per expert."""

    def __init__(self, *, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(
        self, x_AD: torch.Tensor, *, counts_E: list[int] | None, offsets_E: torch.Tensor | None
    ) -> torch.Tensor:
        """Expert outputs [A, D] for rows already sorted by expert: the grouped kernel when
        `offsets_E` is given, else one matmul per expert (`counts_E` rows each)."""
        if offsets_E is not None:
            return self.reference(x_AD, counts_E=None, offsets_E=offsets_E)
        assert counts_E is not None
        return _SlicedSwiGLU.apply(x_AD, self.w_gate, self.w_up, self.w_down, counts_E)

    def reference(
        self, x_AD: torch.Tensor, *, counts_E: list[int] | None, offsets_E: torch.Tensor | None
    ) -> torch.Tensor:
        """The same function through `grouped_linear` and autograd (the grouped kernel's path,
        and what the sliced path is tested against)."""
        groups = {"counts_E": counts_E, "offsets_E": offsets_E}
        gate_AF = grouped_linear(x_AD, self.w_gate, **groups)
        up_AF = grouped_linear(x_AD, self.w_up, **groups)
        return grouped_linear(F.silu(gate_AF) * up_AF, self.w_down, **groups)


class MoE(nn.Module):
    """Router + grouped experts; a drop-in for a SwiGLU feed-forward ([B, T, D] -> [B, T, D])."""

    def __init__(
        self, *, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts=num_experts, dim=dim, hidden_dim=hidden_dim)
        self.keep_routing = False
        self.routings: dict[int, Routing] = {}
        """The last kept routing of each thread that ran a forward, by `threading.get_ident()`
        (one thread's write never replaces another's)."""
        self.replays: dict[int, ReplayedRoutes] = {}
        """The routes each thread's next forwards replay, by thread (set and removed by the
        trainer around a micro-batch's forward and backward)."""
        self.tapes: dict[int, list[torch.Tensor]] = {}
        """Threads that record their routes: each forward appends its experts_NK (int64)."""

    @property
    def routing(self) -> Routing | None:
        """The calling thread's last kept routing, if any."""
        return self.routings.get(threading.get_ident())

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        probs_NE, weights_NK, experts_NK = route(
            self.router(x_ND), top_k=self.top_k, norm_topk_prob=self.norm_topk_prob
        )
        thread = threading.get_ident()
        replay = self._replay(thread)
        if replay is not None:
            experts_NK = torch.where(replay.given_N1, replay.experts_NK, experts_NK)
            weights_NK = topk_weights(
                probs_NE, experts_NK, norm_topk_prob=self.norm_topk_prob, dtype=weights_NK.dtype
            )
        tape = self.tapes.get(thread)
        if tape is not None:
            tape.append(experts_NK)
        if self.keep_routing:
            self.routings[thread] = Routing(probs_NE=probs_NE, experts_NK=experts_NK)
        return self.combine(x_ND, weights_NK=weights_NK, experts_NK=experts_NK).view_as(x_BTD)

    def _replay(self, thread: int) -> ReplayedRoutes | None:
        """The calling thread's replay. A forward with gradients on a thread without one,
        while exactly one is set, is a backward's recomputation of a replayed forward
        (activation checkpointing; on CUDA autograd runs it on a thread of its own): it
        replays the same routes (a sampler's decode runs without gradients)."""
        replay = self.replays.get(thread)
        if replay is None and self.replays and torch.is_grad_enabled():
            replays = tuple(self.replays.values())
            replay = replays[0] if len(replays) == 1 else None
        return replay

    def combine(
        self, x_ND: torch.Tensor, *, weights_NK: torch.Tensor, experts_NK: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[n, k] * expert[experts[n, k]](x[n]) for every token n: [N, D]."""
        N, K = experts_NK.shape
        # A stable sort keeps each expert's rows in token order; the outputs go back to their
        # [N, K] places and each token sums its K outputs in top-k order (no atomics).
        order_A = experts_NK.reshape(-1).argsort(stable=True)
        counts_E = torch.bincount(experts_NK.reshape(-1), minlength=self.num_experts)
        if use_grouped_mm(x_ND):
            groups = {"counts_E": None, "offsets_E": counts_E.cumsum(0).to(torch.int32)}
        else:
            groups = {"counts_E": counts_E.tolist(), "offsets_E": None}
        out_AD = self.experts(x_ND.index_select(0, order_A // K), **groups)
        place_A = torch.empty_like(order_A)
        place_A[order_A] = torch.arange(order_A.numel(), device=order_A.device)
        out_NKD = out_AD.index_select(0, place_A).view(N, K, -1)
        return (out_NKD * weights_NK.unsqueeze(-1)).sum(dim=1)
