"""Expert parallelism: a layer's stacked experts split over the ranks of an expert-parallel
group, each token's rows sent to the rank that holds its experts and back with all-to-all.

Shapes: A token-expert assignments on this rank (rows sorted by expert), R rows this rank's
experts receive from every rank of the group, D row width, E experts, L = E / P experts per
rank, P ranks in the group, X = L x P runs of received rows (one per local expert and source).

The seam is the experts module's call, not the MoE block: `experts(x_AD, *, counts_E,
offsets_E, weights_A=None)` on the rows of all E experts sorted by expert (as `MoE.combine`
makes them), with every parameter of the module and its children stacked by expert on dim 0
(the experts' weights, and any LoRA factors on them). `apply_expert_parallel` makes each
parameter a DTensor `Shard(0)` over the ep mesh (rank r holds experts r*L .. r*L + L - 1) and
wraps the module's forward:

1. the row counts are exchanged (one all-to-all of each rank's [P, L] counts);
2. rows sorted by expert are already grouped by destination rank: one all-to-all sends them,
   and the router weights of the rows with them;
3. the received rows (source rank major) are reordered expert major, each expert's rows in
   source rank order and, within a source, in that rank's order;
4. the module's own forward runs on them with its parameters' local shards swapped in (model
   code never sees a DTensor);
5. steps 3 and 2 are undone for the outputs.

Autograd runs through every step: each all-to-all's backward is the reverse all-to-all, each
reordering's backward the inverse reordering (a gather, no atomics), and the local shards'
gradients reach the DTensor parameters as `Shard(0)` gradients: each rank's experts get the
gradients of every rank's tokens routed to them. A rank's experts see more rows than they would
on their own, summed in one matmul, so gradients equal one process's up to the order of float
sums (fp32: a few ulps).

Every rank of an ep group must run the experts of every layer the same number of times (the
trainer's empty passes see to it, as for FSDP). What it does not do: drop or pad tokens to a
capacity (every routed row is computed), overlap the exchange with compute, or split tokens
over tensor-parallel ranks (they hold the same tokens).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


def apply_expert_parallel(experts: nn.Module, *, mesh: DeviceMesh) -> None:
    """Split `experts` (see the module docstring for the call it must have) over the 1-D ep
    `mesh`, in place: its parameters become DTensors sharded on dim 0 and its forward
    exchanges rows with the other ranks. Every rank must hold the same values before (each
    keeps its own part; nothing is sent)."""
    assert mesh.ndim == 1, "expert parallelism takes the 1-D ep sub-mesh"
    for module in experts.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            assert parameter.shape[0] % mesh.size() == 0, (name, tuple(parameter.shape))
            sharded = distribute_tensor(parameter.detach(), mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(
                name, nn.Parameter(sharded, requires_grad=parameter.requires_grad)
            )
    experts.__class__ = _expert_parallel_class(type(experts))
    experts.ep_mesh = mesh


class ExpertParallel:
    """Mixed into an experts module's class by `apply_expert_parallel` (as FSDP's
    `fully_shard` mixes in its own): the forward of the module docstring around the class's
    own forward."""

    ep_mesh: DeviceMesh

    def forward(
        self,
        x_AD: torch.Tensor,
        *,
        counts_E: list[int] | None,
        offsets_E: torch.Tensor | None,
        weights_A: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if counts_E is None:
            assert offsets_E is not None
            counts_E = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
        routes = Routes.exchange(counts_E, mesh=self.ep_mesh, device=x_AD.device)
        kwargs = {}
        if weights_A is not None:
            kwargs["weights_A"] = routes.dispatch(weights_A)
        if offsets_E is not None:  # the grouped kernel's form, for the local experts
            offsets_L = torch.tensor(routes.counts_L, device=offsets_E.device).cumsum(0)
            kwargs |= {"counts_E": None, "offsets_E": offsets_L.to(offsets_E.dtype)}
        else:
            kwargs |= {"counts_E": routes.counts_L, "offsets_E": None}
        x_RD = routes.dispatch(x_AD)
        with local_parameters(self):
            out_RD = super().forward(x_RD, **kwargs)
        return routes.combine(out_RD)


@functools.cache
def _expert_parallel_class(cls: type) -> type:
    """`cls` with `ExpertParallel` mixed in: one class per experts class, made once (as FSDP
    makes its own), so every layer's experts share it."""
    return type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})


@contextlib.contextmanager
def local_parameters(module: nn.Module) -> Iterator[None]:
    """Inside, every DTensor parameter of `module` and its children reads as its local shard
    (`to_local`, through which gradients flow back to the DTensor)."""
    swapped = []
    for child in module.modules():
        for name, parameter in child._parameters.items():
            if isinstance(parameter, DTensor):
                swapped.append((child, name, parameter))
    try:
        for child, name, parameter in swapped:
            # Straight into _parameters: a plain tensor may not be assigned as a parameter
            # (FSDP swaps its gathered parameters in the same way).
            child._parameters[name] = parameter.to_local()
        yield
    finally:
        for child, name, parameter in swapped:
            child._parameters[name] = parameter


@dataclass(frozen=True, kw_only=True)
class Routes:
    """Where one call's rows go and come back from: the all-to-all splits and the reordering
    between source-major and expert-major rows."""

    group: dist.ProcessGroup
    send_P: list[int]
    """Rows this rank sends to each rank of the group (its rows of that rank's experts)."""
    receive_P: list[int]
    """Rows this rank receives from each rank."""
    counts_L: list[int]
    """Rows of each of this rank's experts, from all ranks."""
    expert_major_R: torch.Tensor
    """Received row (source major) that comes i-th in expert-major order."""
    source_major_R: torch.Tensor
    """The inverse reordering."""

    @classmethod
    def exchange(cls, counts_E: list[int], *, mesh: DeviceMesh, device: torch.device) -> Routes:
        """Exchange this rank's rows per expert with the group (collective)."""
        group, num_ranks = mesh.get_group(), mesh.size()
        num_local = len(counts_E) // num_ranks
        send_PL = torch.tensor(counts_E, dtype=torch.int64).view(num_ranks, num_local)
        receive_PL = torch.empty_like(send_PL, device=device)
        # On the group's device: NCCL exchanges only CUDA tensors.
        dist.all_to_all_single(receive_PL, send_PL.to(device), group=group)
        receive_PL = receive_PL.cpu()
        # Received rows come source by source, each source's expert by expert. Expert-major
        # order takes, for each local expert, each source's rows of it in turn.
        starts_PL = (receive_PL.flatten().cumsum(0) - receive_PL.flatten()).view_as(receive_PL)
        counts_X, starts_X = receive_PL.t().flatten(), starts_PL.t().flatten()
        first_X = counts_X.cumsum(0) - counts_X  # each run's first place in expert order
        total = int(counts_X.sum())
        offset_R = torch.repeat_interleave(starts_X - first_X, counts_X, output_size=total)
        expert_major_R = torch.arange(total) + offset_R
        source_major_R = torch.empty_like(expert_major_R)
        source_major_R[expert_major_R] = torch.arange(total)
        return cls(
            group=group,
            send_P=send_PL.sum(1).tolist(),
            receive_P=receive_PL.sum(1).tolist(),
            counts_L=receive_PL.sum(0).tolist(),
            expert_major_R=expert_major_R.to(device),
            source_major_R=source_major_R.to(device),
        )

    def dispatch(self, rows_A: torch.Tensor) -> torch.Tensor:
        """This rank's rows (sorted by expert) -> its experts' rows from every rank, expert
        major: [A, ...] -> [R, ...]."""
        received_R = _AllToAll.apply(rows_A, self.receive_P, self.send_P, self.group)
        return _Reorder.apply(received_R, self.expert_major_R, self.source_major_R)

    def combine(self, out_R: torch.Tensor) -> torch.Tensor:
        """The experts' outputs back to the ranks their rows came from: [R, ...] -> [A, ...]."""
        by_source_R = _Reorder.apply(out_R, self.source_major_R, self.expert_major_R)
        return _AllToAll.apply(by_source_R, self.send_P, self.receive_P, self.group)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with splits on dim 0; its backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


class _Reorder(torch.autograd.Function):
    """rows[order]; its backward is the gather by the inverse order (a permutation: every
    row is read once, so no zero-filled buffer and no accumulation)."""

    @staticmethod
    def forward(ctx, rows, order, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None
