"""A MoE training step on 2 ranks: expert parallelism (ep=2) against FSDP alone on the same
ranks.

The model is a Qwen3-MoE shape with every layer sparse (--experts routed experts of width
--expert-width, top 2, --layers layers of width --dim), random weights in fp32. Each mode runs
on the same 2 ranks (torch.multiprocessing.spawn; gloo on CPU, NCCL with --device cuda): a
`TrainerEngine` sharded dp_shard=2, with ep=2 or ep=1 (FSDP alone), both built in each rank's
process, on --sequences random sequences of --seq-len tokens per rank a step
(`forward_backward` cross entropy + `optim_step`). --warmup untimed steps of each first (they
also create the AdamW moments), then --steps timed rounds, one step of each mode a round, in
alternating order, so that load from other processes hits both alike.

Reported per mode and rank:
- `experts_held_mib`: the routed experts' local shards between steps (measured), beside the
  row `temper plan` prints for them (`plan_experts_held_mib`), and their ratio;
- `experts_gathered_mib`: the experts' bytes one sparse layer runs on (what FSDP gathers: a
  forward pre-hook reads the gathered parameters), beside the plan's share of a gathered block;
- `step_s`: the median of the timed steps (each rank's);
- `peak_extra_mib`: the most memory a rank held during a step beyond what it held before it
  (CPU: resident memory, VmHWM after giving freed heap back, with blocks of
  --mmap-threshold-kib or more mapped and unmapped on their own so that freed ones do not
  stay resident; CUDA: the allocator's peak), the largest over the timed steps: what FSDP
  gathers, activations, gradients and all-to-all buffers (the other mode's engine is held
  throughout, and not counted). Fresh mappings cost page faults: the steps are slower than
  with glibc's default (--mmap-threshold-kib 0), the more so the more a mode allocates.
Targets: with ep=2 each rank holds half of the expert bytes and the plan agrees within 5%.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD python bench/moe_ep.py [--steps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from temper.api import AdamParams, Datum, ModelInput
from temper.distributed.local_shard import local_part
from temper.distributed.parallel_dims import ParallelDims
from temper.job.memory_plan import PlanSettings, plan_memory
from temper.job.model_bytes import ModelShapes, is_expert
from temper.models import materialize, qwen3_moe_size
from temper.models.common.moe import MoE
from temper.observability.process_memory import PeakRss
from temper.trainer import TrainerEngine
from temper.trainer.sharding import Sharding

MIB = 2**20
ADAM = AdamParams(learning_rate=1e-4)
MODES = {"ep2": 2, "fsdp": 1}
WORLD_SIZE = 2
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


@dataclasses.dataclass(frozen=True)
class Case:
    device: str
    layers: int
    dim: int
    experts: int
    expert_width: int
    vocab: int
    sequences: int
    seq_len: int
    warmup: int
    steps: int
    mmap_threshold_kib: int


def model_config(case: Case):
    return dataclasses.replace(
        qwen3_moe_size("tiny", vocab_size=case.vocab),
        num_layers=case.layers,
        dim=case.dim,
        num_heads=4,
        num_kv_heads=2,
        head_dim=case.dim // 4,
        num_experts=case.experts,
        top_k=2,
        moe_ffn_dim=case.expert_width,
    )


def batch(case: Case, *, rank: int, step: int) -> list[Datum]:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    tokens = torch.randint(0, case.vocab, (case.sequences, case.seq_len + 1), generator=generator)
    return [
        Datum(
            model_input=ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:], "weights": torch.ones(case.seq_len)},
        )
        for row in tokens
    ]


class Mode:
    """One mode's engine on this rank and what it measured."""

    def __init__(self, case: Case, *, ep: int, device: torch.device) -> None:
        dims = ParallelDims.Config(dp_shard=WORLD_SIZE, ep=ep)
        config = TrainerEngine.Config(
            max_tokens_per_microbatch=case.sequences * case.seq_len,
            sharding=Sharding.Config(dims=dims),
        )
        model = materialize(model_config(case), seed=0, device=device)
        self.engine = config.build(model=model, lora=None)
        self.device = device
        self.held = sum(
            local_part(p).numel() * p.element_size()
            for name, p in self.engine.model.named_parameters()
            if is_expert(name)
        )
        self.gathered: list[int] = []
        self.times: list[float] = []
        self.extra_mib: list[float] = []
        for block in self.engine.model.blocks:
            if isinstance(block.feed_forward, MoE):
                block.feed_forward.experts.register_forward_pre_hook(self._record)

    def _record(self, module: torch.nn.Module, args: tuple) -> None:
        """After FSDP's pre-forward hook: the bytes it gathered to run the experts."""
        self.gathered.append(
            sum(local_part(p).numel() * p.element_size() for p in module.parameters())
        )

    def step(self, case: Case, *, rank: int, step: int, timed: bool) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
        with PeakRss() as peak:
            start = time.perf_counter()
            data = batch(case, rank=rank, step=step)
            self.engine.forward_backward(data, "cross_entropy")
            self.engine.optim_step(ADAM)
            if cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
        if timed:
            self.times.append(seconds)
            if cuda:
                peak_bytes = torch.cuda.max_memory_allocated(self.device) - before
                self.extra_mib.append(peak_bytes / MIB)
            else:
                self.extra_mib.append(peak.extra_mib)

    def report(self) -> dict:
        return {
            "experts_held_mib": round(self.held / MIB, 4),
            "experts_gathered_mib": round(max(self.gathered) / MIB, 4),
            "step_s": round(statistics.median(self.times), 4),
            "peak_extra_mib": round(max(self.extra_mib), 1),
        }


def run_rank(rank: int, case: Case, device: torch.device) -> dict:
    modes = {name: Mode(case, ep=ep, device=device) for name, ep in MODES.items()}
    for step in range(case.warmup):
        for mode in modes.values():
            mode.step(case, rank=rank, step=step, timed=False)
    for index in range(case.steps):
        order = list(modes.values())
        for mode in order if index % 2 == 0 else order[::-1]:
            mode.step(case, rank=rank, step=case.warmup + index, timed=True)
    results = {name: mode.report() for name, mode in modes.items()}
    del modes
    return results


def rank_entry(rank: int, case: Case, port: int, out_dir: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // WORLD_SIZE))
    device = torch.device("cpu")
    backend = "gloo"
    if case.device == "cpu" and case.mmap_threshold_kib:
        # Blocks this large get mappings of their own, unmapped when freed: otherwise glibc's
        # adaptive threshold serves the gathered weights and gradients (MiBs each) from the
        # heap, whose freed holes stay resident and add up in the peak.
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, case.mmap_threshold_kib * 1024)
    if case.device == "cuda":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        result = run_rank(rank, case, device)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        gc.collect()  # FSDP modules alive at destroy_process_group crash the process
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def planned(case: Case, *, ep: int) -> dict:
    """`temper plan`'s routed-expert row, and the experts' part of a gathered sparse block."""
    config = model_config(case)
    settings = PlanSettings(
        model="qwen3_moe/tiny",
        nproc_per_node=WORLD_SIZE,
        dtype="float32",
        ep=ep,
        batch=WORLD_SIZE * case.sequences,
        max_seq_len=case.seq_len + 1,
        device=case.device,
    )
    rows = plan_memory(settings, decoder=config).role("colocated").rows
    held = next(row for row in rows if row.item.startswith("weights: routed experts"))
    shapes = ModelShapes.of(config, lora_rank=None)
    layer_experts = config.expert_params // config.num_sparse_layers
    rest = shapes.largest_block_numel - layer_experts
    gathered = (shapes.gathered_block_numel(ep=ep) - rest) * 4
    return {"held_mib": held.num_bytes / MIB, "gathered_mib": gathered / MIB}


def summarize(case: Case, ranks: list[dict]) -> dict:
    config = model_config(case)
    report: dict = {
        "bench": "moe_ep",
        "device": case.device,
        "model": {
            "layers": case.layers,
            "dim": case.dim,
            "experts": case.experts,
            "expert_width": case.expert_width,
            "params_m": round(config.num_params / 1e6, 1),
            "expert_mib": round(config.expert_params * 4 / MIB, 1),
        },
        "tokens_per_rank": case.sequences * case.seq_len,
        "mmap_threshold_kib": case.mmap_threshold_kib,
        "load_average": round(os.getloadavg()[0], 2),
    }
    for name, ep in MODES.items():
        plan = planned(case, ep=ep)
        mode = {key: [rank[name][key] for rank in ranks] for key in ranks[0][name]}
        mode["plan_experts_held_mib"] = round(plan["held_mib"], 2)
        mode["plan_experts_gathered_mib"] = round(plan["gathered_mib"], 2)
        mode["held_over_plan"] = [
            round(held / plan["held_mib"], 3) for held in mode["experts_held_mib"]
        ]
        report[name] = mode
    whole = config.expert_params * 4 / MIB
    ep2 = report["ep2"]
    report["targets"] = {
        "ep2_holds_half_the_expert_bytes": all(
            abs(held / whole - 0.5) < 0.01 for held in ep2["experts_held_mib"]
        ),
        "plan_within_5_percent": all(abs(ratio - 1) <= 0.05 for ratio in ep2["held_over_plan"]),
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--mmap-threshold-kib",
        type=int,
        default=64,
        help="CPU: glibc's mmap threshold for the ranks (0: glibc's adaptive default)",
    )
    args = parser.parse_args()
    case = Case(**{key: value for key, value in vars(args).items()})
    if case.device == "cuda" and torch.cuda.device_count() < WORLD_SIZE:
        raise SystemExit(f"--device cuda needs {WORLD_SIZE} GPUs")
    with tempfile.TemporaryDirectory(prefix="temper-moe-ep-") as out_dir:
        mp.spawn(rank_entry, args=(case, free_port(), out_dir), nprocs=WORLD_SIZE, join=True)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    print(json.dumps(summarize(case, ranks)))


if __name__ == "__main__":
    main()
