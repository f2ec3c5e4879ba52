"""The experts' SwiGLU on CPU (and wherever no grouped kernel runs): one matmul per expert and
projection on rows sorted by expert, with a hand-written backward.

Shapes: A token-expert assignments (rows, sorted by expert), D model dim, F expert hidden
width, X = 2F (gate and up), E experts.

What is unusual here, each for speed:
- Gate and up run as one matmul against their concatenated weights ([E, 2F, D], a copy made
  per call that costs far less than the matmul it saves on small experts), and so do their
  input gradients.
- That matmul writes its result transposed, [2F, A]: gate and up are then each contiguous,
  where the halves of an [A, 2F] row would be strided views, on which CPU SiLU and its
  backward run several times slower. The activations stay [F, A]; the matmuls read them
  transposed at no cost. Their rows are 64 bytes longer than A (`_feature_major`).
- The router weight is folded into the activations before the down projection (F-wide rather
  than D-wide multiplies); its gradient is the activations' dot product with theirs.
- Each expert's gradients are written in place into the [E, ...] gradient tensors; only
  experts without rows are zero-filled.
- With `threads` (a ThreadShards, see `use_expert_threads` in moe.py) the experts are split
  into consecutive groups of about equal rows, one per thread, each group's matmuls and
  element-wise work run on its thread with one intra-op thread. Torch's own intra-op threads
  split each small per-expert matmul in two and wake for every op; whole experts per thread
  keep every core busy (figures: docs/benchmarks.md, moe_block.py). Every group writes
  disjoint rows, columns and expert gradients: no reduction across threads, so the results do
  not depend on the split (they may differ from the calling thread's in rounding, each matmul
  running on one intra-op thread rather than several).

The math is the autograd of `GroupedExperts.reference`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from temper.distributed.thread_shards import ThreadShards

MIN_GROUP_ROWS = 256
"""Fewest rows per thread's group, on average: below that, handing work to a thread costs
more than it saves (decode steps stay on the calling thread)."""


@dataclass(frozen=True)
class ExpertGroup:
    """Consecutive experts (each with rows) and their rows, also consecutive once sorted."""

    experts: list[int]
    counts: list[int]
    rows: slice


def expert_groups(counts_E: list[int], *, num_groups: int) -> list[ExpertGroup]:
    """The experts with rows in at most `num_groups` consecutive groups, each boundary the one
    nearest an even split of the rows; fewer groups where the rows would give a group under
    MIN_GROUP_ROWS on average (one group: all experts)."""
    experts = [e for e, count in enumerate(counts_E) if count]
    if not experts:
        return []
    counts = [counts_E[e] for e in experts]
    ends = list(itertools.accumulate(counts))  # rows up to and including each expert
    num_groups = max(1, min(num_groups, len(experts), ends[-1] // MIN_GROUP_ROWS))
    starts = [0]  # index of each group's first expert
    for boundary in range(1, num_groups):
        target = ends[-1] * boundary / num_groups
        # Leave at least one expert for each group still to come.
        candidates = range(starts[-1] + 1, len(experts) - (num_groups - boundary) + 1)
        starts.append(min(candidates, key=lambda first: abs(ends[first - 1] - target)))
    return [
        ExpertGroup(experts[a:b], counts[a:b], slice(ends[a - 1] if a else 0, ends[b - 1]))
        for a, b in zip(starts, [*starts[1:], len(experts)], strict=True)
    ]


class SlicedSwiGLU(torch.autograd.Function):
    """out[a] = w[a] * down_e(silu(gate_e(x[a])) * up_e(x[a])) for rows a of expert e, the
    rows sorted by expert (`counts_E` each), `weights_A` None for w = 1."""

    @staticmethod
    def forward(ctx, x_AD, weights_A, w_gate_EFD, w_up_EFD, w_down_EDF, counts_E, threads):
        F_ = w_gate_EFD.shape[1]
        w_gate_up_EXD = torch.cat((w_gate_EFD, w_up_EFD), dim=1)
        gate_up_XA = _feature_major(2 * F_, like=x_AD)
        act_FA = _feature_major(F_, like=x_AD)
        out_AD = x_AD.new_empty(x_AD.shape[0], w_down_EDF.shape[1])
        w_gate_up, w_down_t = w_gate_up_EXD.unbind(0), w_down_EDF.transpose(1, 2).unbind(0)

        def forward_group(group: ExpertGroup) -> None:
            rows, counts = group.rows, group.counts
            gate_up = gate_up_XA[:, rows]
            for e, x_cols, gate_up_cols in zip(
                group.experts,
                x_AD[rows].t().split(counts, dim=1),
                gate_up.split(counts, dim=1),
                strict=True,
            ):
                torch.mm(w_gate_up[e], x_cols, out=gate_up_cols)
            act = torch.ops.aten.silu.out(gate_up[:F_], out=act_FA[:, rows]).mul_(gate_up[F_:])
            if weights_A is not None:
                act.mul_(weights_A[rows])
            for e, act_rows, out_rows in zip(
                group.experts, act.t().split(counts), out_AD[rows].split(counts), strict=True
            ):
                torch.mm(act_rows, w_down_t[e], out=out_rows)

        groups = expert_groups(counts_E, num_groups=1 if threads is None else threads.num_threads)
        _run(forward_group, groups, threads)
        ctx.save_for_backward(x_AD, weights_A, w_gate_up_EXD, w_down_EDF, gate_up_XA, act_FA)
        ctx.groups, ctx.threads = groups, threads
        return out_AD

    @staticmethod
    def backward(ctx, d_out_AD):
        x_AD, weights_A, w_gate_up_EXD, w_down_EDF, gate_up_XA, act_FA = ctx.saved_tensors
        need_x, need_weights, need_gate, need_up, need_down, _, _ = ctx.needs_input_grad
        F_, experts = w_down_EDF.shape[2], [e for g in ctx.groups for e in g.experts]
        need_gate_up, d_out_AD = need_gate or need_up, d_out_AD.contiguous()
        d_w_down_EDF = _empty_grad(w_down_EDF, experts) if need_down else None
        d_w_gate_up_EXD = _empty_grad(w_gate_up_EXD, experts) if need_gate_up else None
        d_act_FA = _feature_major(F_, like=x_AD)
        d_gate_up_XA = _feature_major(2 * F_, like=x_AD)
        d_weights_A = x_AD.new_empty(x_AD.shape[0]) if need_weights else None
        d_x_AD = torch.empty_like(x_AD) if need_x else None
        w_gate_up, w_down_t = w_gate_up_EXD.unbind(0), w_down_EDF.transpose(1, 2).unbind(0)

        def backward_group(group: ExpertGroup) -> None:
            rows, counts = group.rows, group.counts
            d_out_cols = d_out_AD[rows].t().split(counts, dim=1)
            d_act = d_act_FA[:, rows]
            for e, d_out, act_rows, d_act_cols in zip(
                group.experts,
                d_out_cols,
                act_FA[:, rows].t().split(counts),
                d_act.split(counts, dim=1),
                strict=True,
            ):
                if need_down:
                    torch.mm(d_out, act_rows, out=d_w_down_EDF[e])
                torch.mm(w_down_t[e], d_out, out=d_act_cols)
            # act = w * silu(gate) * up. Both halves are computed without w, then scaled by
            # it in one pass; d_w = sum_f d_act * silu(gate) * up: the unscaled d_up * up.
            gate, up, d_gate_up = (
                gate_up_XA[:F_, rows],
                gate_up_XA[F_:, rows],
                d_gate_up_XA[:, rows],
            )
            torch.mul(d_act, F.silu(gate), out=d_gate_up[F_:])
            if need_weights:
                torch.sum(d_gate_up[F_:] * up, dim=0, out=d_weights_A[rows])
            torch.ops.aten.silu_backward(d_act.mul_(up), gate, grad_input=d_gate_up[:F_])
            if weights_A is not None:
                d_gate_up.mul_(weights_A[rows])
            d_x_rows = d_x_AD[rows].split(counts) if need_x else [None] * len(counts)
            for e, d_gate_up_cols, d_gate_up_rows, x_rows, d_x in zip(
                group.experts,
                d_gate_up.split(counts, dim=1),
                d_gate_up.t().split(counts),
                x_AD[rows].split(counts),
                d_x_rows,
                strict=True,
            ):
                if need_gate_up:
                    torch.mm(d_gate_up_cols, x_rows, out=d_w_gate_up_EXD[e])
                if need_x:
                    torch.mm(d_gate_up_rows, w_gate_up[e], out=d_x)

        _run(backward_group, ctx.groups, ctx.threads)
        d_w_gate_EFD = d_w_up_EFD = None
        if need_gate_up:
            d_w_gate_EFD, d_w_up_EFD = d_w_gate_up_EXD.split(F_, dim=1)
        return d_x_AD, d_weights_A, d_w_gate_EFD, d_w_up_EFD, d_w_down_EDF, None, None


def _run(
    fn: Callable[[ExpertGroup], None], groups: list[ExpertGroup], threads: ThreadShards | None
) -> None:
    """fn(group) for every group: on the threads when there are several, else here."""
    if len(groups) == 1 or threads is None:
        for group in groups:
            fn(group)
        return

    def on_worker(group: ExpertGroup) -> None:
        # Grad mode is per thread: out= into tensors autograd tracks needs it off.
        with torch.no_grad():
            fn(group)

    threads.map(on_worker, groups)


def _feature_major(num_features: int, *, like: torch.Tensor) -> torch.Tensor:
    """An uninitialized [num_features, A] tensor for rows like [A, ...], each of its rows 64
    bytes longer than A: with A a power of two (batches often are) one expert's [F, count]
    slice would put all its F rows in the same cache sets, and its matmuls run slower."""
    num_rows = like.shape[0]
    return like.new_empty(num_features, num_rows + 64 // like.element_size())[:, :num_rows]


def _empty_grad(weight_E: torch.Tensor, experts: list[int]) -> torch.Tensor:
    """An uninitialized gradient for stacked weights, zeroed only for experts other than
    `experts` (those are overwritten whole by their matmul)."""
    grad_E = torch.empty_like(weight_E)
    used = set(experts)
    for e in range(weight_E.shape[0]):
        if e not in used:
            grad_E[e].zero_()
    return grad_E
