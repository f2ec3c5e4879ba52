"""A weight update into vLLM: through the weight-transfer protocol vs `reload_weights`.

One inline vLLM engine (this process) on a Qwen3 shape (--shape, default 0.6B) with random
weights in --dtype (default bfloat16; the same dtype both ways). Cases, alternating their
order each round, on the same engine and the same new weights:
- `transfer`: `VllmGenerator.update_weights(state_dict, version=...)`, the backend's path:
  names and shapes checked, Temper -> HF names, vLLM's four phases in buckets of
  `vllm_transfer.BUCKET_BYTES` (inline transport), the CPU fix-ups at finish.
- `reload_weights`: the same HF-named tensors (converted before the clock starts) through
  `collective_rpc("reload_weights", weights_iterator=...)` and the same fix-ups.
With --separate, also an engine in vLLM's own process, updated over the ipc transport
(`transfer_engine_process_ipc`: buckets in shared memory) and, on a second such engine, over
the gloo transport (`transfer_engine_process_gloo`), beside `plain_gloo_broadcast` (the same
bytes in one gloo broadcast between two processes, buffers allocated before the clock starts).
Targets (CPU): transfer <= reload_weights and <= 0.5 s (0.6B).

Medians over --repeats after --warmup. Prints one JSON line with both configs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.distributed as dist

from temper.generator import vllm_reload, vllm_transfer
from temper.generator.vllm import VllmGenerator
from temper.models import materialize, qwen3_size
from temper.models.registry import family_of_model


def _timed(run, *, repeats: int, warmup: int) -> list[float]:
    times = []
    for index in range(warmup + repeats):
        started = time.perf_counter()
        run(index)
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return times


def _broadcast_peer(port: int, nbytes: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, False)
    group = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=600))
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    while True:
        group.broadcast([buffer], options).wait()
        if buffer[0].item() == 255:
            return


def _plain_broadcast(nbytes: int, *, repeats: int, warmup: int) -> list[float]:
    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    peer = multiprocessing.get_context("spawn").Process(
        target=_broadcast_peer, args=(store.port, nbytes)
    )
    peer.start()
    group = dist.ProcessGroupGloo(store, 0, 2, datetime.timedelta(seconds=600))
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    options = dist.BroadcastOptions()
    options.rootRank = 0
    # The peer's receive of round i ends with the broadcast of round i+1 starting; the last
    # round's end is when the stop message goes through.
    times = _timed(
        lambda _: group.broadcast([buffer], options).wait(), repeats=repeats, warmup=warmup
    )
    buffer[0] = 255
    group.broadcast([buffer], options).wait()
    peer.join()
    return times


def _separate(model, *, states: list, nbytes: int, args) -> dict[str, float]:
    """The same updates into vLLM's own engine process, over each transport, and one plain
    gloo broadcast of the same bytes (medians in seconds)."""
    found: dict[str, float] = {}
    for transport in ("ipc", "gloo"):
        separate = VllmGenerator.Config(
            kv_cache_mib=64,
            max_model_len=256,
            max_num_seqs=8,
            engine_process="separate",
            transport=transport,
        ).build(model=model)
        times = _timed(
            lambda i, engine=separate: engine.update_weights(states[i % 2], version=i + 1),
            repeats=args.repeats,
            warmup=args.warmup,
        )
        separate.close()
        found[f"transfer_engine_process_{transport}_s"] = round(statistics.median(times), 4)
    plain = _plain_broadcast(nbytes, repeats=args.repeats, warmup=args.warmup)
    found["plain_gloo_broadcast_s"] = round(statistics.median(plain), 4)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="0.6B")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--separate", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=vllm_transfer.BUCKET_BYTES / 2**20)
    args = parser.parse_args()
    vllm_transfer.BUCKET_BYTES = int(args.bucket_mb * 2**20)

    model = materialize(qwen3_size(args.shape), seed=0, dtype=args.dtype, init="empty").eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.02)
    states = [
        {k: v + 0.001 * i for k, v in model.state_dict().items()} for i in range(2)
    ]  # two versions, alternated
    nbytes = sum(value.nbytes for value in states[0].values())
    config = VllmGenerator.Config(kv_cache_mib=64, max_model_len=256, max_num_seqs=8)
    vllm = config.build(model=model)
    family = family_of_model(model)
    hf_states = [
        [pair for k, v in state.items() for pair in family.tensors_to_hf(k, v)] for state in states
    ]
    tied = bool(model.config.tie_embeddings)

    def reload(index: int) -> None:
        pairs = iter(hf_states[index % 2])
        vllm._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        if tied:
            vllm._llm.collective_rpc(lambda w: vllm_reload.process_in_place(w.get_model().lm_head))
        vllm._llm.collective_rpc(lambda w: vllm_reload.refresh_moe_experts(w.get_model()))

    cases = {
        "transfer": lambda i: vllm.update_weights(states[i % 2], version=i + 1),
        "reload_weights": reload,
    }
    results: dict[str, list[float]] = {name: [] for name in cases}
    for round_index in range(args.warmup + args.repeats):
        order = list(cases) if round_index % 2 == 0 else list(reversed(cases))
        for name in order:
            started = time.perf_counter()
            cases[name](round_index)
            if round_index >= args.warmup:
                results[name].append(time.perf_counter() - started)
    vllm.close()
    medians = {f"{name}_s": round(statistics.median(t), 4) for name, t in results.items()}
    if args.separate:
        medians |= _separate(model, states=states, nbytes=nbytes, args=args)
    print(
        json.dumps(
            {
                "bench": "vllm_weight_update",
                "shape": args.shape,
                "dtype": args.dtype,
                "bytes": nbytes,
                "bucket_bytes": vllm_transfer.BUCKET_BYTES,
                "config": {
                    "transfer": "inline transport",
                    "reload_weights": "in-process",
                    "transfer_engine_process_ipc": "engine_process=separate, ipc transport",
                    "transfer_engine_process_gloo": "engine_process=separate, gloo transport",
                    "plain_gloo_broadcast": "the same bytes, one gloo broadcast, 2 processes",
                },
                "repeats": args.repeats,
                **medians,
                "transfer_over_reload": round(
                    medians["transfer_s"] / medians["reload_weights_s"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
