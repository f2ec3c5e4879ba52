"""A disaggregated weight sync into vLLM: 2 FSDP trainer ranks + 1 vLLM generator rank (gloo).

Three gloo ranks on this machine, the channels of a disaggregated placement: each trainer
rank sends its share of a Qwen3 shape (--shape, random weights, --dtype) in --bucket-mb
buckets (`sampler_share`: its own rows of the FSDP-sharded tensors; rank 0 the rest whole),
and the generator rank loads them into vLLM in its own engine process the way a generator
rank does (generator_rank.py `_load_whole`: the channels drawn in step, whole tensors
assembled as their rows arrive, vLLM's weight-transfer protocol over --transport: ipc, the
CPU default, or the streamed gloo transport). Beside it, in the same run, the baseline: one
plain gloo broadcast of the same bytes from trainer rank 0 to the generator rank (buffers
allocated before the clock starts),
and the sync with every piece copied out of the receivers' buffers (`sync_copied`).
Each round starts at a barrier and ends when the generator's update has returned.

Target (CPU): the sync within 1.5x the plain broadcast. Medians over --repeats after --warmup;
one JSON line with both configs and the generator's peak staged bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from temper.checkpoint.gather import sampler_share
from temper.distributed.parallel_dims import MeshDegrees
from temper.distributed.placement import Placement
from temper.distributed.weight_transfer import BucketReceiver, BucketSender, drain
from temper.distributed.whole_tensors import WholeTensors, interleave
from temper.distributed.world import using_trainer_world
from temper.generator import vllm_transfer
from temper.generator.vllm import VllmGenerator
from temper.models import materialize, qwen3_size
from temper.trainer.sharding import Sharding
from tests.distributed.spawn import spawn

SYNC_CASES = ("sync", "sync_copied")
"""Alternating per round: large pieces received in place (the generator rank's path), and
every piece copied out of the receivers' buffers."""


def _generator(roles, args, rounds: int, pair) -> dict:
    model = materialize(qwen3_size(args.shape), dtype=args.dtype, init="empty").eval()
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    config = VllmGenerator.Config(
        kv_cache_mib=64,
        max_model_len=256,
        max_num_seqs=8,
        engine_process="separate",
        transport=args.transport,
    )
    vllm = config.build(model=model)
    transport = vllm.transport
    del model
    whole = WholeTensors(shapes=shapes)
    sync_times: dict[str, list[float]] = {case: [] for case in SYNC_CASES}
    peaks = []
    for version in range(1, rounds + 1):
        for case in SYNC_CASES if version % 2 else reversed(SYNC_CASES):
            dist.barrier()
            started = time.perf_counter()
            into = whole.into if case == "sync" else None
            streams = [
                BucketReceiver(channels=[channel], device=torch.device("cpu")).receive(into=into)
                for channel in roles.weight_channels
            ]
            vllm.update_weights(whole(interleave(streams, shapes=shapes)), version=version)
            for stream in streams:
                drain(stream)
            sync_times[case].append(time.perf_counter() - started)
            peaks.append(whole.peak_staged_bytes)
    vllm.close()
    nbytes = sum(torch.Size(shape).numel() for shape in shapes.values())
    buffer = torch.empty(nbytes * getattr(torch, args.dtype).itemsize, dtype=torch.uint8)
    broadcast_times = []
    for _ in range(rounds):
        dist.barrier()
        started = time.perf_counter()
        dist.broadcast(buffer, group=pair, group_src=0)
        broadcast_times.append(time.perf_counter() - started)
    return {
        "sync": sync_times,
        "broadcast": broadcast_times,
        "peak_staged": max(peaks),
        "transport": transport,
    }


def _trainer(rank: int, roles, args, rounds: int, pair) -> dict:
    torch.manual_seed(rank)
    trainer = materialize(qwen3_size(args.shape), dtype=args.dtype, init="empty")
    with torch.no_grad():
        for parameter in trainer.parameters():
            parameter.normal_(0, 0.02)
    with using_trainer_world(roles.trainer_world):
        Sharding(Sharding.Config(), model=trainer)
        sender = BucketSender(
            channel=roles.weight_channels[rank],
            bucket_bytes=int(args.bucket_mb * 2**20),
            dtype=None,
            device=torch.device("cpu"),
        )
        for _ in range(rounds * len(SYNC_CASES)):
            dist.barrier()
            sender.send(sampler_share(trainer, lead=rank == 0))
    nbytes = sum(value.numel() * value.element_size() for value in trainer.state_dict().values())
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        dist.barrier()
        if rank == 0:
            dist.broadcast(buffer, group=pair, group_src=0)
    return {}


def _rank_main(rank: int, args) -> dict:
    placement = Placement(
        Placement.Config(mode="disaggregated", generator_ranks=1, bucket_mb=args.bucket_mb),
        world_size=3,
    )
    roles = placement.split(
        trainer_mesh=MeshDegrees(dp_replicate=1, dp_shard=2, tp=1), device_type="cpu"
    )
    rounds = args.warmup + args.repeats
    pair = dist.new_group([0, 2], backend="gloo")  # the baseline: trainer 0 -> generator
    if roles.is_generator:
        return _generator(roles, args, rounds, pair)
    return _trainer(rank, roles, args, rounds, pair)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "ipc", "gloo"],
        help="into vLLM's engine process (VllmGenerator.Config.transport; auto: ipc on CPU)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    vllm_transfer.BUCKET_BYTES = int(args.bucket_mb * 2**20)
    with tempfile.TemporaryDirectory() as directory:
        results = spawn(
            _rank_main, world_size=3, out_dir=Path(directory), args=(args,), timeout_s=3600
        )
    generator = results[2]
    model = materialize(qwen3_size(args.shape), dtype=args.dtype, init="empty")
    nbytes = sum(value.numel() * value.element_size() for value in model.state_dict().values())
    syncs = {
        f"{case}_s": round(statistics.median(generator["sync"][case][args.warmup :]), 4)
        for case in SYNC_CASES
    }
    broadcast = statistics.median(generator["broadcast"][args.warmup :])
    print(
        json.dumps(
            {
                "bench": "vllm_disaggregated_update",
                "shape": args.shape,
                "dtype": args.dtype,
                "bytes": nbytes,
                "bucket_mb": args.bucket_mb,
                "config": {
                    "sync": "2 FSDP trainer ranks -> 1 generator rank -> vLLM engine process "
                    "(gloo channels, in-step draw, large pieces received into the whole "
                    f"tensors, {generator['transport']} transport)",
                    "sync_copied": "the same, every piece received into the receivers' "
                    "buffers and copied out",
                    "plain_gloo_broadcast": "trainer rank 0 -> generator rank, one broadcast",
                },
                "repeats": args.repeats,
                **syncs,
                "plain_gloo_broadcast_s": round(broadcast, 4),
                "sync_over_broadcast": round(syncs["sync_s"] / broadcast, 3),
                "peak_staged_mib": round(generator["peak_staged"] / 2**20, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
