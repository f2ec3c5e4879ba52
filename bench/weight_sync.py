"""Weight sync side by side: colocated (whole dict vs streamed), disaggregated in buckets, and a
plain broadcast of the same bytes.

Per shape (--shapes, default tiny and 0.6B), one world of T + 1 ranks (--trainer-ranks T,
default 2): the trainer ranks hold a model of the shape in --dtype (default float32), FSDP-
sharded over them when T > 1; the last rank is a generator with a plain model of the same
shape and dtype. Weights are constants per tensor (values do not matter for timing; the
generators' copies are checked against them at the end). The groups are Placement.split's.
Cases, all on the same trainer model:

- colocated (the trainer ranks, each loading its own plain generator model, as SPMD RL does):
  `whole_dict`: `sampler_state_dict(model)` then `WeightSource.update(dict)`, a whole copy
  gathered first; `streamed`: `WeightSource.update(sampler_stream(model, bucket_bytes=...))`, the
  job's path: FSDP rows all-gathered a bucket at a time (at most --bucket-mb gathered at once);
  `gather_only`: that stream drained (the gather alone).
- disaggregated: every trainer rank sends its share in buckets (`sampler_share`: its own FSDP
  rows, nothing gathered; rank 0 also what is not split by rows) on its own channel
  (`BucketSender`, --bucket-mb), the generator rank receives the channels in turn into its
  `WeightSource` (`BucketReceiver`). Senders and receiver live across syncs, as in the job.
- overlap: the same transfer into a second generator model (`overlap_sync`: the generator
  samples the current version meanwhile), then copied into the one it samples from. A plain
  disaggregated sync keeps the generator from sampling for the whole transfer; with overlap,
  only for the copy (`generator_blocked_s`).
- plain_broadcast: one `dist.broadcast` of a flat tensor of the model's bytes, pre-allocated
  on both sides, trainer rank 0 -> generator, on the same data group.

Time: each rank leaves a barrier, then runs its part. A colocated case takes its slowest rank;
disaggregated and plain_broadcast take the generator's time to its last copy (the trainer's
gather is in it), trainer rank 0's `send` is printed beside it. Medians over --repeats rounds
after --warmup, the cases of a group alternating their order each round. Peak extra memory:
per rank, the most resident memory (VmHWM) during a sync beyond the RSS before that case's
first sync (freed heap returned to the system first), so the buffers a sender or receiver
keeps between syncs count; the max over the timed rounds. Targets: bucketed peak extra <= 2
buckets (a tensor larger than a bucket is split by rows); disaggregated time <= 2x the plain
broadcast.

--device cuda: one GPU per rank, NCCL for the trainer and the bucket data (gloo for headers),
peak extra from torch.cuda's allocator, and the anchors' published 0.6B sync times beside.

Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD python bench/weight_sync.py [--shapes tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from temper.checkpoint.gather import sampler_share, sampler_state_dict, sampler_stream
from temper.distributed.parallel_dims import MeshDegrees, ParallelDims
from temper.distributed.placement import Placement, Roles
from temper.distributed.weight_pieces import rows_of
from temper.distributed.weight_transfer import BucketReceiver, BucketSender, drain
from temper.distributed.world import using_trainer_world
from temper.models import materialize, qwen3_size
from temper.models.build import parse_dtype
from temper.observability.process_memory import PeakRss
from temper.sampler.weight_source import WeightSource
from temper.trainer.sharding import Sharding

MIB = 2**20
ANCHORS_0_6B_S = {"torchstore": 0.067, "trl": 0.18}
"""Published 0.6B weight sync times on GPU (the comparison for --device cuda)."""


@dataclasses.dataclass(frozen=True)
class Case:
    shape: str
    dtype: str
    device: str
    trainer_ranks: int
    bucket_mb: float
    warmup: int
    repeats: int
    threads: int


@dataclasses.dataclass
class Sample:
    seconds: float
    before_mib: float
    """Memory held just before (RSS, or CUDA memory allocated)."""
    peak_mib: float
    """The most held during the sync."""


# -- one rank ------------------------------------------------------------------------------


def fill_value(index: int) -> float:
    """The constant of the index-th tensor (exact in bfloat16 too)."""
    return (index % 64 + 1) / 64


@torch.no_grad()
def filled(model: nn.Module, *, zero: bool) -> nn.Module:
    """Every tensor written (so resident): zeros, or its `fill_value`."""
    for index, tensor in enumerate(model.state_dict().values()):
        tensor.fill_(0.0 if zero else fill_value(index))
    return model


@torch.no_grad()
def holds_the_trainer_weights(model: nn.Module) -> bool:
    tensors = model.state_dict().values()
    return all(bool((t == fill_value(i)).all()) for i, t in enumerate(tensors))


def measure(fn: Callable[[], object], *, group, device: torch.device) -> Sample:
    """Time `fn` from a barrier on `group`, and the memory held before it and at its peak."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        return Sample(seconds, before / MIB, torch.cuda.max_memory_allocated(device) / MIB)
    # gloo's worker threads drop their reference to the last collective's tensors a moment
    # after it returns: let them, so that memory is not counted as held before.
    time.sleep(0.1)
    with PeakRss() as peak:
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return Sample(seconds, peak.before_mib, peak.peak_mib)


def rounds(case: Case, fns: dict[str, Callable[[], Sample]]) -> dict[str, list[dict[str, float]]]:
    """`case.warmup` untimed rounds, then `case.repeats` timed ones; each round runs every
    function once, the order alternating between rounds. A round's `extra_mib` is its peak
    beyond the memory held before the function's first round (so what a sender or receiver
    keeps between syncs counts)."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in fns}
    first: dict[str, Sample] = {}
    for index in range(case.warmup + case.repeats):
        names = list(fns) if index % 2 == 0 else list(reversed(fns))
        for name in names:
            sample = first.setdefault(name, fns[name]()) if index == 0 else fns[name]()
            if index >= case.warmup:
                extra_mib = sample.peak_mib - first[name].before_mib
                samples[name].append({"seconds": sample.seconds, "extra_mib": extra_mib})
    return samples


def trainer_model(case: Case, roles: Roles, device: torch.device) -> nn.Module:
    config = qwen3_size(case.shape)
    model = filled(materialize(config, device=device, dtype=case.dtype, init="empty"), zero=False)
    if case.trainer_ranks > 1:
        with using_trainer_world(roles.trainer_world):
            dims = ParallelDims.Config(dp_shard=case.trainer_ranks)
            Sharding.Config(dims=dims).build(model=model)
    return model


def generator_model(case: Case, device: torch.device) -> nn.Module:
    config = qwen3_size(case.shape)
    return filled(materialize(config, device=device, dtype=case.dtype, init="empty"), zero=True)


def colocated(case: Case, model: nn.Module, roles: Roles, device: torch.device) -> dict:
    """A trainer rank: load its own generator model, whole dict and streamed; and the gather
    alone (what a disaggregated sync does before it sends)."""
    source = WeightSource(generator_model(case, device))
    where = dict(group=roles.trainer_world.loop_group, device=device)

    def whole_dict() -> Sample:
        return measure(lambda: source.update(sampler_state_dict(model), version=0), **where)

    bucket_bytes = Placement.Config(bucket_mb=case.bucket_mb).bucket_bytes
    stream = lambda: sampler_stream(model, bucket_bytes=bucket_bytes)  # noqa: E731

    def streamed() -> Sample:
        return measure(lambda: source.update(stream(), version=0), **where)

    def gather_only() -> Sample:
        return measure(lambda: drain(stream()), **where)

    fns = {"whole_dict": whole_dict, "streamed": streamed, "gather_only": gather_only}
    samples = rounds(case, fns)
    return {**samples, "weights_exact": holds_the_trainer_weights(source.model)}


def disaggregated_trainer(
    case: Case, model: nn.Module, roles: Roles, device: torch.device, everyone
) -> dict:
    """A trainer rank: each sends its share in buckets on its channel (rank 0 also broadcasts
    the plain bytes)."""
    first = roles.rank == roles.trainer_ranks[0]
    stats: list = []
    flat = torch.ones(model_bytes(case), dtype=torch.uint8, device=device) if first else None
    sender = BucketSender(
        channel=roles.weight_channels[roles.trainer_world.rank],
        bucket_bytes=Placement.Config(bucket_mb=case.bucket_mb).bucket_bytes,
        dtype=None,
        device=device,
    )

    def send() -> None:
        stats.append(sender.send(sampler_share(model, lead=first)))

    def disaggregated() -> Sample:
        return measure(send, group=everyone, device=device)

    def plain_broadcast() -> Sample:
        if not first:
            return Sample(0.0, 0.0, 0.0)
        work = lambda: dist.broadcast(flat, group=roles.weight_channels[0].data, group_src=0)  # noqa: E731
        return measure(work, group=roles.sync_control, device=device)

    fns = {"disaggregated": disaggregated, "overlap": disaggregated}
    samples = rounds(case, fns | {"plain_broadcast": plain_broadcast})
    samples["transfer"] = dataclasses.asdict(stats[-1])
    return samples


def disaggregated_generator(case: Case, roles: Roles, device: torch.device, everyone) -> dict:
    source = WeightSource(generator_model(case, device))
    flat = torch.zeros(model_bytes(case), dtype=torch.uint8, device=device)
    receiver = BucketReceiver(channels=roles.weight_channels, device=device)

    def receive() -> None:  # large pieces straight into the model, as a generator rank does
        source.update(receiver.receive(into=rows_of(source.model.state_dict())), version=0)

    def disaggregated() -> Sample:
        return measure(receive, group=everyone, device=device)

    staged, copy_s = WeightSource(generator_model(case, device)), []

    def receive_then_copy() -> None:  # overlap_sync: into the second copy, then copied in
        staged.update(receiver.receive(into=rows_of(staged.model.state_dict())), version=0)
        synchronize(device)
        start = time.perf_counter()
        source.update(staged.model.state_dict(), version=0)
        synchronize(device)
        copy_s.append(time.perf_counter() - start)

    def overlap() -> Sample:
        return measure(receive_then_copy, group=everyone, device=device)

    def plain_broadcast() -> Sample:
        work = lambda: dist.broadcast(flat, group=roles.weight_channels[0].data, group_src=0)  # noqa: E731
        return measure(work, group=roles.sync_control, device=device)

    fns = {"disaggregated": disaggregated, "overlap": overlap, "plain_broadcast": plain_broadcast}
    samples = rounds(case, fns)
    exact = holds_the_trainer_weights(source.model) and holds_the_trainer_weights(staged.model)
    return {**samples, "copy_s": copy_s[case.warmup :], "weights_exact": exact}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_bytes(case: Case) -> int:
    with torch.device("meta"):
        model = qwen3_size(case.shape).build()
    itemsize = parse_dtype(case.dtype).itemsize
    return sum(t.numel() * itemsize for t in model.state_dict().values())


def run_rank(rank: int, case: Case) -> dict:
    device = torch.device("cuda", rank) if case.device == "cuda" else torch.device("cpu")
    placement = Placement(
        Placement.Config(mode="disaggregated", generator_ranks=1, bucket_mb=case.bucket_mb),
        world_size=case.trainer_ranks + 1,
    )
    mesh = None
    if case.trainer_ranks > 1:
        mesh = MeshDegrees(dp_replicate=1, dp_shard=case.trainer_ranks, tp=1)
    roles = placement.split(trainer_mesh=mesh, device_type=device.type)
    everyone = dist.new_group(backend="gloo")
    if roles.is_generator:
        dist.barrier(group=everyone)  # the trainer ranks run the colocated cases first
        return {"role": "generator", **disaggregated_generator(case, roles, device, everyone)}
    model = trainer_model(case, roles, device)
    result = {"role": f"trainer_{roles.trainer_world.rank}"}
    result["colocated"] = colocated(case, model, roles, device)
    gc.collect()  # the colocated generator model goes before the disaggregated cases
    dist.barrier(group=everyone)
    result |= disaggregated_trainer(case, model, roles, device, everyone)
    return result


def rank_entry(rank: int, case: Case, port: int, out_dir: str) -> None:
    torch.set_num_threads(case.threads)
    backend = "gloo"
    if case.device == "cuda":
        torch.cuda.set_device(rank)
        backend = "nccl"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=case.trainer_ranks + 1,
    )
    try:
        result = run_rank(rank, case)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        gc.collect()  # FSDP modules alive at destroy_process_group crash the process
        dist.destroy_process_group()


# -- the report ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_shape(case: Case) -> dict:
    world_size = case.trainer_ranks + 1
    with tempfile.TemporaryDirectory(prefix="temper-weight-sync-") as out_dir:
        mp.spawn(rank_entry, args=(case, free_port(), out_dir), nprocs=world_size, join=True)
        ranks = [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(world_size)]
    return summarize(case, ranks)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def peak(samples: list[dict[str, float]]) -> float:
    return round(max(sample["extra_mib"] for sample in samples), 1)


def summarize(case: Case, ranks: list[dict]) -> dict:
    trainers, generator = ranks[:-1], ranks[-1]
    report: dict = {"model": model_summary(case)}
    report["colocated"] = {
        name: colocated_summary(trainers, name) for name in ("whole_dict", "streamed")
    }
    report["gather_only"] = colocated_summary(trainers, "gather_only")
    report["disaggregated"] = disaggregated_summary(case, ranks)
    report["disaggregated"]["generator_blocked_s"] = report["disaggregated"]["time_s"]
    report["overlap"] = {
        "time_s": median([s["seconds"] for s in generator["overlap"]]),
        "generator_blocked_s": median(generator["copy_s"]),
        "peak_extra_mib": {r["role"]: peak(r["overlap"]) for r in ranks},
    }
    broadcast_s = median([s["seconds"] for s in generator["plain_broadcast"]])
    report["plain_broadcast"] = {
        "time_s": broadcast_s,
        "mib": round(model_bytes(case) / MIB, 1),
        "gib_per_s": round(model_bytes(case) / 2**30 / broadcast_s, 2),
    }
    disaggregated_s = report["disaggregated"]["time_s"]
    ratio = disaggregated_s / broadcast_s
    report["disaggregated_over_plain_broadcast"] = round(ratio, 2)
    disaggregated = max(report["disaggregated"]["peak_extra_mib"].values())
    streamed = max(report["colocated"]["streamed"]["peak_extra_mib"].values())
    report["targets"] = {
        "disaggregated_peak_extra_le_2_buckets": disaggregated <= 2 * case.bucket_mb,
        "colocated_streamed_peak_extra_le_2_buckets": streamed <= 2 * case.bucket_mb,
        "disaggregated_le_2x_plain_broadcast": ratio <= 2,
    }
    if case.device == "cuda" and case.shape == "0.6B":
        report["anchors_s"] = ANCHORS_0_6B_S
    exact = [r["colocated"]["weights_exact"] for r in trainers] + [generator["weights_exact"]]
    report["weights_exact"] = all(exact)
    return report


def colocated_summary(trainers: list[dict], name: str) -> dict:
    """The slowest trainer rank's time (median over rounds) and each rank's peak extra."""
    per_rank = [[s["seconds"] for s in r["colocated"][name]] for r in trainers]
    return {
        "time_s": median([max(times) for times in zip(*per_rank, strict=True)]),
        "peak_extra_mib": {r["role"]: peak(r["colocated"][name]) for r in trainers},
    }


def disaggregated_summary(case: Case, ranks: list[dict]) -> dict:
    first, generator = ranks[0], ranks[-1]
    transfers = [r["transfer"] for r in ranks[:-1]]  # each trainer rank's share
    peak_extra = {r["role"]: peak(r["disaggregated"]) for r in ranks}
    return {
        "time_s": median([s["seconds"] for s in generator["disaggregated"]]),
        "send_s": median([s["seconds"] for s in first["disaggregated"]]),
        "peak_extra_mib": peak_extra,
        "peak_extra_over_bucket": {
            role: round(extra / case.bucket_mb, 2) for role, extra in peak_extra.items()
        },
        "buckets": [t["buckets"] for t in transfers],
        "pieces": [t["tensors"] for t in transfers],
        "mib": [round(t["bytes"] / MIB, 1) for t in transfers],
        "largest_bucket_mib": round(max(t["largest_bucket_bytes"] for t in transfers) / MIB, 1),
    }


def model_summary(case: Case) -> dict:
    with torch.device("meta"):
        model = qwen3_size(case.shape).build()
    itemsize = parse_dtype(case.dtype).itemsize
    sizes = [t.numel() * itemsize for t in model.state_dict().values()]
    return {
        "tensors": len(sizes),
        "mib": round(sum(sizes) / MIB, 1),
        "largest_tensor_mib": round(max(sizes) / MIB, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "0.6B"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--trainer-ranks", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.trainer_ranks < 1:
        parser.error(f"--trainer-ranks must be >= 1, got {args.trainer_ranks}")
    world_size = args.trainer_ranks + 1
    threads = max(1, (os.cpu_count() or 1) // world_size)
    config = vars(args) | {
        "world_size": world_size,
        "trainer": f"{args.dtype}, FSDP over {args.trainer_ranks} ranks"
        if args.trainer_ranks > 1
        else f"{args.dtype}, one rank (unsharded)",
        "generator_dtype": args.dtype,
        "transfer_dtype": args.dtype,
        "backends": "gloo" if args.device == "cpu" else "nccl (trainer, data), gloo (headers)",
        "threads_per_rank": threads,
    }
    report: dict = {"bench": "weight_sync", "config": config, "shapes": {}}
    if args.device == "cuda" and torch.cuda.device_count() < world_size:
        report["skipped"] = (
            f"--device cuda needs one GPU per rank ({world_size}), found "
            f"{torch.cuda.device_count()}"
        )
        print(json.dumps(report))
        return
    report["load_before"] = os.getloadavg()[0]
    for shape in args.shapes:
        case = Case(
            shape=shape,
            dtype=args.dtype,
            device=args.device,
            trainer_ranks=args.trainer_ranks,
            bucket_mb=args.bucket_mb,
            warmup=args.warmup,
            repeats=args.repeats,
            threads=threads,
        )
        report["shapes"][shape] = run_shape(case)
        print(json.dumps({shape: report["shapes"][shape]}), file=sys.stderr)
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
