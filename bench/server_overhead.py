"""Seconds per RL step through `temper serve` (the tinker SDK over HTTP) vs the in-process client.

One step, written once against the Tinker API and run on both clients: a sampling client on
the current weights (`save_weights_and_get_sampling_client`), `--prompts` concurrent sample
calls of `--group-size` completions x `--max-tokens` tokens (no stop, so every completion has
the same length), group-relative advantages from a toy reward, then one `importance_sampling`
forward_backward and an AdamW optim_step on all completions. Both sides use the same tiny
model directory (LoRA rank 16) and run in this one invocation, alternating step by step so
that machine noise hits both alike; the server runs in a subprocess on a free port.
Prints one JSON line: median seconds per step on each side, and server / in-process; the
median seconds of each phase of the step on each side (where the overhead sits); also
the mean CPU seconds per step (Linux /proc, a process with its live helper processes; /proc
counts in 10 ms ticks, hence means over all steps):
- `cpu_in_process_s`: this process during an in-process step (the compute);
- `cpu_server_s`: the server process alone during a server step, without the SDK client's
  CPU (on a deployment the SDK runs on another machine), and `cpu_server_over_in_process`,
  its ratio to `cpu_in_process_s`: what serving costs beyond the compute;
- `cpu_sdk_s`: this process during a server step (the SDK's HTTP work; the server, a child
  of this process, is not counted);
- `cpu_server_idle_s`: the server process during an in-process step (its idle event loop).
Temporary directories (model, storage of both sides) are removed at exit.

Both sides compute on the same number of torch threads by default (like for like): the
server's default, one fewer than torch's (`TemperServer.Config.compute_threads`, which keeps a
core for its event loop and the SDK), given to the server as `--compute-threads` and set in
this process for the in-process client. `--server-threads N` changes both;
`--in-process-threads N` changes the in-process side alone, e.g. to torch's default for each
side at its own defaults. Both counts are printed (`server_threads`, `in_process_threads`,
`like_for_like`).

On a machine with two cores or more the server runs on cores of its own (the second half of
this process's cores) and this process, the SDK client and the in-process client, on the others
(`--pin`, the default there; `--no-pin` lets every process use all cores). On a deployment the
SDK runs on another machine: sharing the server's cores, its HTTP work (about a third of a core
during a server step here) also slows the server's compute threads (caches, preemption), which
is the SDK's cost, not the server's. Pinned, each side computes on cores nothing else uses, and
the compute threads are at most the server's cores. The JSON line prints the cores (`pinned`:
null, or `bench_cores` and `server_cores`, the latter read back from every server thread at the
end).

    OMP_WAIT_POLICY=PASSIVE python bench/server_overhead.py [--steps 10] [--server-threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["TINKER_TELEMETRY"] = "0"


def rl_step(
    training,
    types,
    prompts,
    *,
    group_size: int,
    max_tokens: int,
    seed: int,
    learning_rate: float = 1e-3,
) -> tuple[float, dict[str, float]]:
    """One GRPO-style step; returns the mean reward and the seconds of each phase. `types` is
    tinker.types or temper.api.

    Reward: the fraction of completion tokens equal to the prompt's first token. Phases:
    `weights` (save_weights_and_get_sampling_client), `sample` (sample calls until the last
    result), `data` (rewards, advantages, Datums), `train` (forward_backward + optim_step).
    """
    start = time.perf_counter()
    sampler = training.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler  # SDK: a future
    weights_done = time.perf_counter()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    futures = [
        sampler.sample(types.ModelInput.from_ints(prompt), group_size, params) for prompt in prompts
    ]
    results = [future.result() for future in futures]
    sampled = time.perf_counter()
    data, rewards = [], []
    for prompt, result in zip(prompts, results, strict=True):
        sequences = result.sequences
        group = [sum(t == prompt[0] for t in s.tokens) / len(s.tokens) for s in sequences]
        mean = sum(group) / len(group)
        rewards += group
        for sequence, reward in zip(sequences, group, strict=True):
            tokens = [*prompt, *sequence.tokens]
            pad = [0.0] * (len(prompt) - 1)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": pad + list(sequence.logprobs),
                        "advantages": pad + [reward - mean] * len(sequence.tokens),
                    },
                )
            )
    built = time.perf_counter()
    backward = training.forward_backward(data, "importance_sampling")
    step = training.optim_step(types.AdamParams(learning_rate=learning_rate))
    backward.result()
    step.result()
    trained = time.perf_counter()
    return sum(rewards) / len(rewards), {
        "weights": weights_done - start,
        "sample": sampled - weights_done,
        "data": built - sampled,
        "train": trained - built,
    }


def median_phases(steps: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds of each phase over the steps."""
    return {name: round(statistics.median(s[name] for s in steps), 4) for name in steps[0]}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc), NaN elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree_cpu_s(pid: int, *, excluding: int | None = None) -> float:
    """CPU seconds so far of process `pid` and its live descendants (helper processes, e.g. a
    sampler's `cpu.processes`), without process `excluding` and its own, from /proc."""
    tree = [pid, *descendants(pid, excluding=excluding)]
    return sum(process_cpu_s(member) for member in tree)


def descendants(pid: int, *, excluding: int | None = None) -> list[int]:
    """The live descendants of `pid` (Linux: /proc/<pid>/task/<tid>/children), without
    `excluding` and its descendants."""
    found, pending = [], [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            children = [child for child in children if child != excluding]
            found += children
            pending += children
    return found


def split_cores() -> tuple[set[int], set[int]] | None:
    """(this process's cores, the server's): the cores this process may use, in two halves;
    None with fewer than two, or where the OS has no CPU affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return set(cores[:half]), set(cores[half:])


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` onto `cores` (Linux keeps an affinity per thread; a
    thread started later inherits its creator's, a child process its parent thread's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)


def thread_cores(pid: int) -> list[int]:
    """The cores any thread of process `pid` may run on."""
    cores: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            cores |= os.sched_getaffinity(int(tid))
    return sorted(cores)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model_dir: Path, storage: Path, *, compute_threads: int
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "temper", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--storage", str(storage)]
    command += ["--compute-threads", str(compute_threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--server-threads",
        type=int,
        default=None,
        help="the server's --compute-threads (default: the server's default, one fewer than "
        "torch's); also the in-process side's, unless --in-process-threads",
    )
    parser.add_argument(
        "--in-process-threads",
        type=int,
        default=None,
        help="torch threads of the in-process client (default: the server's, like for like)",
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the server on cores of its own, this process (SDK and in-process client) on the "
        "others (default: on with two cores or more)",
    )
    args = parser.parse_args()
    for name in ("server_threads", "in_process_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")

    cores = split_cores() if args.pin is not False else None
    if args.pin and cores is None:
        parser.error("--pin needs two cores or more and CPU affinity (Linux)")

    import tinker
    import torch
    from tinker import types as tinker_types

    from temper import api as temper_types
    from temper.checkpoint.model_source import init_model_dir
    from temper.client.service_client import ServiceClient
    from temper.server.state.server import TemperServer

    load_before = round(os.getloadavg()[0], 2)
    root = Path(tempfile.mkdtemp(prefix="temper-bench-"))
    process = None
    try:
        model_dir = root / "models" / "tiny-digits"
        tokenizer = init_model_dir(model_dir, size="tiny", tokenizer="digits", seed=0)
        server_config = TemperServer.Config(
            model=[str(model_dir)], compute_threads=args.server_threads
        )
        server_threads = server_config.cpu_threads()
        if cores is not None:
            pin(os.getpid(), cores[0])  # before the server and the SDK start their threads
            if args.server_threads is None:
                server_threads = min(server_threads, len(cores[1]))
        # Before the in-process client starts its workers: they read this once.
        torch.set_num_threads(args.in_process_threads or server_threads)
        prompts = [tokenizer.encode(f"{i % 10}{(3 * i) % 10}=") for i in range(args.prompts)]
        process, base_url = start_server(
            model_dir, root / "server-storage", compute_threads=server_threads
        )
        if cores is not None:
            pin(process.pid, cores[1])
        service = tinker.ServiceClient(base_url=base_url, api_key="tml-bench")
        remote = service.create_lora_training_client(str(model_dir), rank=16, seed=0).result()
        local = ServiceClient(storage_dir=root / "local-storage").create_lora_training_client(
            str(model_dir.resolve()), rank=16, seed=0
        )
        sides = {"in_process": (local, temper_types), "server": (remote, tinker_types)}
        times: dict[str, list[float]] = {name: [] for name in sides}
        phases: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
        cpu: dict[str, list[float]] = {"in_process": [], "server": [], "sdk": [], "server_idle": []}
        for step in range(args.steps + 1):  # step 0 warms up both sides
            for name, (training, types) in sides.items():
                own_cpu = process_tree_cpu_s(os.getpid(), excluding=process.pid)
                server_cpu = process_tree_cpu_s(process.pid)
                start = time.perf_counter()
                _, step_phases = rl_step(
                    training,
                    types,
                    prompts,
                    group_size=args.group_size,
                    max_tokens=args.max_tokens,
                    seed=step,
                )
                if not step:
                    continue
                times[name].append(time.perf_counter() - start)
                phases[name].append(step_phases)
                own_cpu = process_tree_cpu_s(os.getpid(), excluding=process.pid) - own_cpu
                server_cpu = process_tree_cpu_s(process.pid) - server_cpu
                if name == "server":
                    cpu["server"].append(server_cpu)  # the server process alone
                    cpu["sdk"].append(own_cpu)  # the SDK client's HTTP work, in this process
                else:
                    cpu["in_process"].append(own_cpu)
                    cpu["server_idle"].append(server_cpu)  # the server's event loop, idle
        service.close("success").result()
        pinned = None
        if cores is not None:
            pinned = {"bench_cores": sorted(cores[0]), "server_cores": thread_cores(process.pid)}
    finally:
        if process is not None:
            process.terminate()
            process.wait()
        shutil.rmtree(root, ignore_errors=True)
    in_process, server = (statistics.median(times[name]) for name in ("in_process", "server"))
    print(
        json.dumps(
            {
                "bench": "server_overhead",
                "step": f"{args.prompts} prompts x {args.group_size} samples x "
                f"{args.max_tokens} tokens + importance_sampling fwd/bwd + optim_step",
                "steps": args.steps,
                "server_threads": server_threads,
                "in_process_threads": torch.get_num_threads(),
                "like_for_like": server_threads == torch.get_num_threads(),
                "pinned": pinned,
                "load_average": round(os.getloadavg()[0], 2),
                "load_average_before": load_before,
                "in_process_s": round(in_process, 4),
                "server_s": round(server, 4),
                "ratio": round(server / in_process, 3),
                "overhead_pct": round(100 * (server / in_process - 1), 1),
                **{f"cpu_{name}_s": round(statistics.mean(v), 4) for name, v in cpu.items()},
                # What the server itself costs per step (its SDK client runs elsewhere in a
                # deployment) against the in-process client's compute.
                "cpu_server_over_in_process": round(
                    statistics.mean(cpu["server"]) / statistics.mean(cpu["in_process"]), 3
                ),
                **{f"phases_{name}_s": median_phases(steps) for name, steps in phases.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
