"""Mixture-of-Experts feed-forward: a softmax top-k router over SwiGLU experts held stacked.

Shapes: N tokens (batch and time flattened), D model dim, F expert hidden width, E experts,
K experts per token (top-k), A token-expert assignments (N * K).

The experts' weights are three stacked parameters ([E, F, D], [E, F, D], [E, D, F]), not E
modules: the assignments are sorted by expert once, and each projection is one grouped matmul
over the sorted rows (`F.grouped_mm` on CUDA in bf16, where a kernel exists) or, elsewhere, one
matmul per expert on contiguous slices of the sorted rows (sliced_experts.py, optionally on
several CPU threads: `use_expert_threads`). Either way each token's output is the sum of its
top-k experts' outputs scaled by their router weights (the weight applied to the expert's
activations before its down projection, which is linear: the same function on F-wide rather
than D-wide rows), the K outputs added up in top-k order without atomics, and the input
gradient summed the same way: forward and backward deterministic on every device, and a
token's result does not depend on which other tokens share its batch (up to the matmul
kernels' blocking by row count, as in any linear layer).

The router's choices are kept on the module when `keep_routing` is set (the trainer sets it to
report router metrics and the load-balancing loss, see moe_stats.py); decode leaves it off. They
are kept per calling thread: the trainer's thread shards run forwards of one module at once,
and an asynchronous run's sampler may decode on the trainer's module while it trains.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from temper.distributed.thread_shards import ThreadShards
from temper.models.common.sliced_experts import SlicedSwiGLU


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


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (bf16-mixed), else x's."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def use_grouped_mm(x: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` has a kernel for x's experts: bf16 compute on a CUDA device of
    compute capability 8.0 or newer."""
    return (
        x.device.type == "cuda"
        and compute_dtype(x) == torch.bfloat16
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


class _GatherRows(torch.autograd.Function):
    """x_AD = x_ND[token_A]: each token's row once per expert it was sent to, in sorted order.

    The backward sums each token's K row gradients in top-k order (`_sum_token_rows`), where
    autograd's would add them into a zero-filled [N, D] with `index_add_` (atomics on CUDA)."""

    @staticmethod
    def forward(ctx, x_ND, token_A, place_NK):
        ctx.save_for_backward(place_NK)
        return x_ND.index_select(0, token_A)

    @staticmethod
    def backward(ctx, d_x_AD):
        (place_NK,) = ctx.saved_tensors
        return _sum_token_rows(d_x_AD, place_NK), None, None


class _SumTokenRows(torch.autograd.Function):
    """y_ND[n] = sum_k y_AD[place_NK[n, k]]: each token's K sorted rows added in top-k order.

    The adjoint of `_GatherRows`: its backward is that gather."""

    @staticmethod
    def forward(ctx, y_AD, place_NK, token_A):
        ctx.save_for_backward(token_A)
        return _sum_token_rows(y_AD, place_NK)

    @staticmethod
    def backward(ctx, d_y_ND):
        (token_A,) = ctx.saved_tensors
        return d_y_ND.index_select(0, token_A), None, None


def _sum_token_rows(y_AD: torch.Tensor, place_NK: torch.Tensor) -> torch.Tensor:
    """sum_k y_AD[place_NK[n, k]] for every token n: [N, D].

    `embedding_bag` in sum mode (one bag of K rows per token, summed in order) reads the rows
    where they lie, where `index_select` + `sum` would first copy them to an [N, K, D]
    tensor: several times faster on CPU, the same bits."""
    return F.embedding_bag(place_NK, y_AD, mode="sum")


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: down(silu(gate(x)) * up(x)) per expert."""

    def __init__(self, *, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_up = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w_down = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.threads: ThreadShards | None = None
        """Threads that run the experts on CPU in parallel, whole experts per thread
        (`use_expert_threads`); None: on the calling thread and torch's intra-op threads."""

    def __deepcopy__(self, memo: dict) -> GroupedExperts:
        # A copy shares the threads (a thread pool does not copy); its tensors are copied as
        # nn.Module's own deepcopy copies them (honouring `memo`).
        threads, self.threads = self.threads, None
        try:
            cls = type(self)
            copied = cls.__new__(cls)
            memo[id(self)] = copied
            for name, value in self.__dict__.items():
                setattr(copied, name, copy.deepcopy(value, memo))
        finally:
            self.threads = threads
        copied.threads = threads
        return copied

    def forward(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Expert outputs [A, D] for rows already sorted by expert, each scaled by its router
        weight when `weights_A` is given: the grouped kernel when `offsets_E` is given, else
        one matmul per expert (`counts_E` rows each).

        Under autocast (bf16-mixed) the rows and weights are cast to autocast's dtype first,
        as autocast casts a linear's: the kernels' own matmuls (`out=` products, the grouped
        kernel) are not on autocast's lists."""
        dtype = compute_dtype(x_AD)
        if dtype != x_AD.dtype or dtype != self.w_gate.dtype:
            with torch.autocast(x_AD.device.type, enabled=False):
                return self._run(
                    x_AD.to(dtype),
                    weights=(self.w_gate.to(dtype), self.w_up.to(dtype), self.w_down.to(dtype)),
                    counts_E=counts_E,
                    offsets_E=offsets_E,
                    weights_A=None if weights_A is None else weights_A.to(dtype),
                )
        weights = (self.w_gate, self.w_up, self.w_down)
        return self._run(
            x_AD, weights=weights, counts_E=counts_E, offsets_E=offsets_E, weights_A=weights_A
        )

    def _run(
        self,
        x_AD: torch.Tensor,
        *,
        weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None,
    ) -> torch.Tensor:
        if offsets_E is not None:
            return swiglu(x_AD, weights, counts_E=None, offsets_E=offsets_E, weights_A=weights_A)
        assert counts_E is not None
        return SlicedSwiGLU.apply(x_AD, weights_A, *weights, counts_E, self.threads)

    def reference(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The same function through `grouped_linear` and autograd (the grouped kernel's path,
        and what the sliced path is tested against)."""
        weights = (self.w_gate, self.w_up, self.w_down)
        return swiglu(x_AD, weights, counts_E=counts_E, offsets_E=offsets_E, weights_A=weights_A)


def swiglu(
    x_AD: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    counts_E: list[int] | None,
    offsets_E: torch.Tensor | None,
    weights_A: torch.Tensor | None,
) -> torch.Tensor:
    """down(silu(gate(x)) * up(x) [* router weight]) per expert through `grouped_linear` and
    autograd; `weights` are the stacked (gate, up, down)."""
    w_gate_EFD, w_up_EFD, w_down_EDF = weights
    groups = {"counts_E": counts_E, "offsets_E": offsets_E}
    gate_AF = grouped_linear(x_AD, w_gate_EFD, **groups)
    up_AF = grouped_linear(x_AD, w_up_EFD, **groups)
    act_AF = F.silu(gate_AF) * up_AF
    if weights_A is not None:
        # The down projection is linear: scaling its input scales its output.
        act_AF = act_AF * weights_A.unsqueeze(-1)
    return grouped_linear(act_AF, w_down_EDF, **groups)


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

    @property
    def routing(self) -> Routing | None:
        """The calling thread's last kept routing, if any."""
        return self.routings.get(threading.get_ident())

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        probs_NE, weights_NK, experts_NK = route(
            self.router(x_ND), top_k=self.top_k, norm_topk_prob=self.norm_topk_prob
        )
        if self.keep_routing:
            self.routings[threading.get_ident()] = Routing(probs_NE=probs_NE, experts_NK=experts_NK)
        return self.combine(x_ND, weights_NK=weights_NK, experts_NK=experts_NK).view_as(x_BTD)

    def combine(
        self, x_ND: torch.Tensor, *, weights_NK: torch.Tensor, experts_NK: torch.Tensor
    ) -> torch.Tensor:
        """sum_k weights[n, k] * expert[experts[n, k]](x[n]) for every token n: [N, D]."""
        N, K = experts_NK.shape
        experts_A = experts_NK.reshape(-1)
        # A stable sort keeps each expert's rows in token order. place_NK is where each
        # (token, k) landed; each token sums its K outputs from there in top-k order.
        order_A = experts_A.argsort(stable=True)
        place_A = torch.empty_like(order_A)
        place_A[order_A] = torch.arange(order_A.numel(), device=order_A.device)
        place_NK, token_A = place_A.view(N, K), order_A // K
        counts_E = torch.bincount(experts_A, minlength=self.num_experts)
        if use_grouped_mm(x_ND):
            groups = {"counts_E": None, "offsets_E": counts_E.cumsum(0).to(torch.int32)}
        else:
            groups = {"counts_E": counts_E.tolist(), "offsets_E": None}
        out_AD = self.experts(
            _GatherRows.apply(x_ND, token_A, place_NK),
            weights_A=weights_NK.reshape(-1).index_select(0, order_A),
            **groups,
        )
        return _SumTokenRows.apply(out_AD, place_NK, token_A)


def use_expert_threads(model: nn.Module, threads: ThreadShards | None) -> None:
    """Every MoE block of `model` runs its experts on `threads` (None: back to the calling
    thread) where no grouped kernel runs: consecutive experts of about equal rows per thread,
    each thread on one intra-op thread (sliced_experts.py). For a CPU model run from a thread
    with several intra-op threads; a thread shard (one intra-op thread, on a core of its own)
    gains nothing from it. A `copy.deepcopy` of the model shares the threads."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.threads = threads
