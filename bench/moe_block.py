"""The MoE block's forward + backward against transformers' Qwen3-MoE block, one config each.

Temper's `MoE` (models/common/moe.py) and transformers' `Qwen3MoeSparseMoeBlock` get the same
weights (the router, and each expert's gate and up concatenated into transformers' fused
`gate_up_proj`), the same [1, N, D] input, which requires grad, and the same output gradient.
A step is the forward and the gradients of the input and every weight
(`torch.autograd.grad`, so neither side accumulates into `.grad`). Before timing, the outputs
and all gradients are checked to agree; a case whose results differ stops the run.

Temper runs twice: `temper`, the block as built (on CPU one matmul per expert on torch's
intra-op threads), and, on CPU with several threads, `temper_expert_threads`: the same block
after `use_expert_threads` (whole experts per thread, one intra-op thread each; what a CPU
trainer opts into, see models/common/sliced_experts.py). Their ratios to transformers come
as a dict per field, one entry per variant.

transformers is timed with each of its expert implementations (`config._experts_implementation`):
`eager`, its default (a Python loop over the experts hit, `index_add_` into the output), and,
where they run, `grouped_mm` (`F.grouped_mm` over expert-sorted rows) and `batched_mm` (each
assignment's expert weights gathered, [N*K, 2F, D], and one `bmm`; skipped where that gather
would pass --batched-mm-max-gib). `speedup_vs_eager` is against the default.

The cases: the default config (D=256, E=8, top-2, F=96: the published Qwen3-MoE models' expert
width over model width, 768/2048 = 0.375, at D=256), a sweep of the expert width F, and a
fine-grained case (E=64, top-8, as the published models route 8 of 128). Each case prints its
FLOPs (18 * N * K * D * F for the experts' six matmuls, forward and backward, plus the
router's) and `matmul_floor_ms`: those FLOPs at the peak rate of one large matmul measured in
the same run, the time no implementation can beat. `max_speedup_vs_eager` is transformers'
time over that floor.

On CUDA in bf16 Temper's block runs `F.grouped_mm`; on CPU one matmul per expert with a
hand-written backward. Rounds alternate the order of the implementations; each reports its
median and best round (the closest to an idle machine) and its median CPU time (all threads
together). Both sides run on the same torch threads (--threads, default torch's). Prints one
JSON line, with the load average before and after.

    OMP_WAIT_POLICY=PASSIVE python bench/moe_block.py [--ffn-dims 128 256 512] [--threads 1]
    python bench/moe_block.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from timing import require_baseline, synchronize

from temper.distributed.thread_shards import ThreadShards
from temper.models.common.moe import MoE, use_expert_threads, use_grouped_mm

HF_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


@dataclass(frozen=True)
class Case:
    """One block configuration, the same on both sides."""

    dim: int
    num_experts: int
    top_k: int
    ffn_dim: int
    tokens: int
    norm_topk_prob: bool = True

    def flops(self) -> int:
        """Multiply-adds x 2 of one forward + backward: three expert matmuls per assignment
        forward, six backward (input and weight gradients), and the router's three."""
        experts = 18 * self.tokens * self.top_k * self.dim * self.ffn_dim
        return experts + 6 * self.tokens * self.dim * self.num_experts


def build_ours(case: Case, *, device: torch.device, dtype: torch.dtype) -> MoE:
    """Temper's block with seeded random weights."""
    torch.manual_seed(0)
    with torch.device(device):
        ours = MoE(
            dim=case.dim,
            hidden_dim=case.ffn_dim,
            num_experts=case.num_experts,
            top_k=case.top_k,
            norm_topk_prob=case.norm_topk_prob,
        )
    with torch.no_grad():
        for parameter in ours.parameters():
            parameter.normal_(0.0, 0.02)  # Qwen3-MoE's initializer_range
    return ours.to(dtype)


def build_theirs(ours: MoE, case: Case, *, implementation: str) -> torch.nn.Module:
    """transformers' block with Temper's weights, running `implementation`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=case.dim,
        moe_intermediate_size=case.ffn_dim,
        num_experts=case.num_experts,
        num_experts_per_tok=case.top_k,
        norm_topk_prob=case.norm_topk_prob,
    )
    config._experts_implementation = implementation
    weight = ours.router.weight
    with torch.device(weight.device):
        theirs = Qwen3MoeSparseMoeBlock(config).to(weight.dtype)
    with torch.no_grad():
        theirs.gate.weight.copy_(weight)
        experts = ours.experts
        theirs.experts.gate_up_proj.copy_(torch.cat((experts.w_gate, experts.w_up), dim=1))
        theirs.experts.down_proj.copy_(experts.w_down)
    return theirs


def gradients(block: torch.nn.Module, x_BND: torch.Tensor, grad_BND: torch.Tensor) -> list:
    """The output and the gradients of the input and of every weight."""
    out_BND = block(x_BND)
    return [out_BND, *torch.autograd.grad(out_BND, [x_BND, *block.parameters()], grad_BND)]


def _as_ours(results: list, case: Case) -> list:
    """transformers' results in Temper's order: (out, d_x, d_router, d_gate, d_up, d_down);
    its parameters come as (gate_up_proj, down_proj, router)."""
    out, d_x, d_gate_up, d_down, d_router = results
    d_gate, d_up = d_gate_up.split(case.ffn_dim, dim=1)
    return [out, d_x, d_router, d_gate, d_up, d_down]


def max_relative_error(ours: list, theirs: list) -> float:
    """The largest |ours - theirs| of any result over that result's largest |theirs|."""
    return max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        for a, b in zip(ours, theirs, strict=True)
    )


def matmul_peak_flops(*, device: torch.device, dtype: torch.dtype, size: int) -> float:
    """FLOP/s of one [size, size] x [size, size] matmul, its best of 10 (the closest to an idle
    machine): the rate the floor is taken at."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = timed_rounds({"matmul": lambda: a @ b}, repeats=10, device=device)["matmul"]
    return 2 * size**3 / best["best_ms"] * 1e3


def timed_rounds(steps: dict[str, Callable[[], object]], *, repeats: int, device) -> dict:
    """Each step's median and best wall ms and median CPU ms (all threads) over `repeats`
    rounds that run every step once, the order alternating between rounds, so that a shared
    machine's drift hits all alike."""
    for step in steps.values():
        step()  # warm-up: allocator, kernel selection, lazy initialization
    wall: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for round_index in range(repeats):
        for name in list(steps) if round_index % 2 == 0 else list(reversed(steps)):
            synchronize(device)
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            steps[name]()
            synchronize(device)
            wall[name].append(time.perf_counter() - wall_start)
            cpu[name].append(time.process_time() - cpu_start)
    return {
        name: {
            "median_ms": round(statistics.median(wall[name]) * 1e3, 2),
            "best_ms": round(min(wall[name]) * 1e3, 2),
            "cpu_ms": round(statistics.median(cpu[name]) * 1e3, 2),
        }
        for name in steps
    }


def run_case(
    case: Case,
    *,
    device,
    dtype,
    repeats: int,
    peak: float,
    batched_mm_max_gib: float,
    threads: ThreadShards | None,
) -> dict:
    """One case: results checked to agree, then each implementation timed in the same rounds.
    Temper runs as built and, given `threads`, with its experts on them."""
    x_BND = torch.randn(1, case.tokens, case.dim, device=device, dtype=dtype, requires_grad=True)
    grad_BND = torch.randn_like(x_BND)
    ours = build_ours(case, device=device, dtype=dtype)
    variants = {"temper": ours}
    if threads is not None:
        variants["temper_expert_threads"] = copy.deepcopy(ours)
        use_expert_threads(variants["temper_expert_threads"], threads)
    tolerance = 1e-4 if dtype == torch.float32 else 1e-1
    expected = gradients(ours, x_BND, grad_BND)
    steps, errors, skipped = {}, {}, {}
    for name, block in variants.items():
        errors[name] = max_relative_error(gradients(block, x_BND, grad_BND), expected)
        steps[name] = lambda block=block: gradients(block, x_BND, grad_BND)
    gathered_gib = case.tokens * case.top_k * 3 * case.ffn_dim * case.dim * dtype.itemsize / 2**30
    for implementation in HF_IMPLEMENTATIONS:
        if implementation == "batched_mm" and gathered_gib > batched_mm_max_gib:
            skipped[implementation] = f"gathers {gathered_gib:.1f} GiB of expert weights"
            continue
        theirs = build_theirs(ours, case, implementation=implementation)
        try:
            results = _as_ours(gradients(theirs, x_BND, grad_BND), case)
        except (RuntimeError, NotImplementedError) as failure:
            skipped[implementation] = f"{type(failure).__name__}: {str(failure).splitlines()[0]}"
            continue
        errors[implementation] = max_relative_error(expected, results)
        steps[implementation] = lambda block=theirs: gradients(block, x_BND, grad_BND)
    if max(errors.values()) > tolerance:
        raise RuntimeError(f"{case}: results differ (relative to Temper's): {errors}")
    times = timed_rounds(steps, repeats=repeats, device=device)
    ours_ms = {name: times.pop(name) for name in variants}
    eager_ms, floor_ms = times["eager"], case.flops() / peak * 1e3
    fastest = min(times, key=lambda name: times[name]["median_ms"])

    def ratios(theirs: dict, field: str) -> dict:
        return {name: round(theirs[field] / ms[field], 2) for name, ms in ours_ms.items()}

    return {
        **asdict(case),
        **ours_ms,
        "transformers": times,
        "transformers_skipped": skipped,
        "speedup_vs_eager": ratios(eager_ms, "median_ms"),
        "best_round_speedup_vs_eager": ratios(eager_ms, "best_ms"),
        "cpu_time_speedup_vs_eager": ratios(eager_ms, "cpu_ms"),
        "fastest_transformers": fastest,
        "speedup_vs_fastest": ratios(times[fastest], "median_ms"),
        "gflop": round(case.flops() / 1e9, 3),
        "gflop_per_s": {
            name: round(case.flops() / ms["median_ms"] / 1e6, 1) for name, ms in ours_ms.items()
        },
        "matmul_floor_ms": round(floor_ms, 2),
        "max_speedup_vs_eager": round(eager_ms["median_ms"] / floor_ms, 2),
        "max_relative_error": {name: float(f"{e:.2e}") for name, e in errors.items()},
    }


def configs(case: Case, *, device: torch.device, dtype: torch.dtype) -> dict:
    """Both sides' configurations of the default case, as each library spells them."""
    import transformers

    probe = torch.empty(0, device=device, dtype=dtype)
    return {
        "temper_config": {
            "block": "temper.models.common.moe.MoE",
            "dim": case.dim,
            "hidden_dim": case.ffn_dim,
            "num_experts": case.num_experts,
            "top_k": case.top_k,
            "norm_topk_prob": case.norm_topk_prob,
            "experts_path": "F.grouped_mm" if use_grouped_mm(probe) else "per-expert matmuls",
            "expert_threads": "temper_expert_threads: use_expert_threads(ThreadShards(threads))",
        },
        "transformers_config": {
            "block": "Qwen3MoeSparseMoeBlock",
            "version": transformers.__version__,
            "hidden_size": case.dim,
            "moe_intermediate_size": case.ffn_dim,
            "num_experts": case.num_experts,
            "num_experts_per_tok": case.top_k,
            "norm_topk_prob": case.norm_topk_prob,
            "_experts_implementation": list(HF_IMPLEMENTATIONS),
        },
    }


def run(
    *,
    device: str = "cpu",
    dtype: str = "float32",
    dim: int = 256,
    experts: int = 8,
    top_k: int = 2,
    ffn_dim: int = 96,
    tokens: int = 2048,
    ffn_dims: tuple[int, ...] = (128, 256, 512),
    fine_grained: tuple[int, int] | None = (64, 8),
    repeats: int = 15,
    batched_mm_max_gib: float = 1.2,
) -> dict:
    """The report: the default case, the F sweep and the fine-grained case."""
    require_baseline("transformers")
    torch_device, torch_dtype = torch.device(device), getattr(torch, dtype)
    load_before = os.getloadavg()[0]
    peak = matmul_peak_flops(
        device=torch_device, dtype=torch_dtype, size=8192 if device == "cuda" else 2048
    )
    default = Case(dim=dim, num_experts=experts, top_k=top_k, ffn_dim=ffn_dim, tokens=tokens)
    cases = [default]
    cases += [Case(dim, experts, top_k, width, tokens) for width in ffn_dims if width != ffn_dim]
    if fine_grained is not None:
        cases.append(Case(dim, fine_grained[0], fine_grained[1], ffn_dim, tokens))
    settings = {"device": torch_device, "dtype": torch_dtype, "repeats": repeats}
    # Expert threads apply where experts run one matmul at a time: on CPU, with several cores.
    expert_threads = torch.get_num_threads() if device == "cpu" else 1
    threads = ThreadShards(expert_threads) if expert_threads > 1 else None
    try:
        rows = [
            run_case(
                case, **settings, peak=peak, batched_mm_max_gib=batched_mm_max_gib, threads=threads
            )
            for case in cases
        ]
    finally:
        if threads is not None:
            threads.close()
    return {
        "bench": "moe_block",
        "device": device,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "expert_threads": expert_threads if threads is not None else None,
        **configs(default, device=torch_device, dtype=torch_dtype),
        "matmul_peak_gflop_per_s": round(peak / 1e9, 1),
        "speedup_vs_eager": rows[0]["speedup_vs_eager"],
        "cases": rows,
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dim", type=int, default=256, help="model width D")
    parser.add_argument("--experts", type=int, default=8, help="experts E")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token K")
    parser.add_argument("--ffn-dim", type=int, default=96, help="expert width F")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens N")
    parser.add_argument(
        "--ffn-dims", type=int, nargs="*", default=[128, 256, 512], help="the F sweep"
    )
    parser.add_argument(
        "--fine-grained", type=int, nargs=2, default=[64, 8], metavar=("E", "K"), help="or none"
    )
    parser.add_argument("--no-fine-grained", action="store_true", help="skip that case")
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds")
    parser.add_argument("--threads", type=int, help="torch threads for both (default: torch's)")
    parser.add_argument("--batched-mm-max-gib", type=float, default=1.2)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.dim, args.experts, args.ffn_dim, args.tokens, args.repeats = 32, 4, 16, 64, 2
        args.ffn_dims, args.fine_grained = [], [8, 4]
    report = run(
        device=args.device,
        dtype=args.dtype,
        dim=args.dim,
        experts=args.experts,
        top_k=args.top_k,
        ffn_dim=args.ffn_dim,
        tokens=args.tokens,
        ffn_dims=tuple(args.ffn_dims),
        fine_grained=None if args.no_fine_grained else tuple(args.fine_grained),
        repeats=args.repeats,
        batched_mm_max_gib=args.batched_mm_max_gib,
    )
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
