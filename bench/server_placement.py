"""Sampling throughput of a disaggregated server against the colocated one, side by side.

Two `temper serve` configurations on the same model and workload, one after the other:
- colocated: `--nproc 2` (both ranks train; rank 0 samples every call);
- disaggregated: `--nproc 3 --placement.mode disaggregated --placement.generator_ranks 2`
  (one trainer rank; two generator ranks sample).
Workload: `--clients` official-SDK clients, each with a LoRA model of its own and a snapshot
of it, each keeping `--calls` sample calls of `--samples` sequences in flight (so the same
sequences are in flight on both servers) for `--rounds` rounds after one warm-up round.
Prints one JSON line: both configurations, sampled tokens/s of each and their ratio.

    PYTHONPATH=. python bench/server_placement.py --clients 4 --calls 4 --samples 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

API_KEY = "tml-bench-placement-0"
CONFIGS = {
    "colocated": ["--nproc", "2"],
    "disaggregated": [
        "--nproc",
        "3",
        "--placement.mode",
        "disaggregated",
        "--placement.generator_ranks",
        "2",
    ],
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(model_dir: Path, root: Path, flags: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "temper", "serve", "--model", str(model_dir)]
    command += ["--port", str(port), "--storage", str(root / "storage"), "--log-level", "warning"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    log = (root / "server.log").open("w")
    process = subprocess.Popen(command + flags, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError((root / "server.log").read_text())
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return process, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError("server did not start")


def measure(base_url: str, model_dir: Path, args: argparse.Namespace) -> dict:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    samplers = []
    for index in range(args.clients):
        training = service.create_lora_training_client(str(model_dir), rank=8, seed=index).result()
        samplers.append(training.save_weights_and_get_sampling_client().result())
    prompt = types.ModelInput.from_ints([1, 2, 3, 4])
    params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])

    def one_round() -> int:
        futures = [
            sampler.sample(prompt, args.samples, params)
            for sampler in samplers
            for _ in range(args.calls)
        ]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    one_round()  # warm-up: every snapshot placed, every engine compiled its shapes
    start_time, tokens = time.perf_counter(), 0
    for _ in range(args.rounds):
        tokens += one_round()
    seconds = time.perf_counter() - start_time
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--calls", type=int, default=4, help="sample calls in flight per client")
    parser.add_argument("--samples", type=int, default=4, help="sequences per call")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", default="tiny")
    parser.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="a flag for both servers (repeat), e.g. --server-flag=--multi-lora.no-enabled",
    )
    args = parser.parse_args()
    os.environ["TINKER_TELEMETRY"] = "0"
    os.environ["TINKER_API_KEY"] = API_KEY
    from temper.checkpoint.model_source import init_model_dir

    root = Path(tempfile.mkdtemp(prefix="temper-placement-"))
    model_dir = root / "models" / "bench-model"
    init_model_dir(model_dir, size=args.size, tokenizer="digits", seed=0)
    results = {}
    try:
        for name, flags in CONFIGS.items():
            run_root = root / name
            run_root.mkdir()
            process, base_url = start(model_dir, run_root, [*flags, *args.server_flag])
            try:
                results[name] = {"flags": " ".join(flags), **measure(base_url, model_dir, args)}
            finally:
                process.terminate()
                process.wait(timeout=60)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratio = results["disaggregated"]["tokens_per_s"] / results["colocated"]["tokens_per_s"]
    print(
        json.dumps(
            {
                "bench": "server_placement",
                "model": args.size,
                "clients": args.clients,
                "sequences_in_flight": args.clients * args.calls * args.samples,
                "max_tokens": args.max_tokens,
                "rounds": args.rounds,
                "cpu_count": os.cpu_count(),
                "server_flags": " ".join(args.server_flag),
                **results,
                "disaggregated_over_colocated": round(ratio, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
