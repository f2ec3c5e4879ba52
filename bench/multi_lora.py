"""Many LoRA clients on one base (in-process ServiceClient): memory and mixed sampling speed.

For each number of clients N (--clients, default 1 4 16 64) a process of its own creates N
LoRA training clients on one base, gives each a forward_backward + optim_step (its Adam
moments exist) and a sampling snapshot, and reports its RSS; then every client samples the
same share of one total batch at once (--total-batch samples of --max-tokens tokens, N
clients x total/N samples each), timed over --rounds rounds. The processes of one model and
path stay up side by side and take turns, one round each in turn (one runs at a time), so a
change in the machine's load meets every N alike. The shared sampler holds
--max-resident-adapters adapters on its device (default: N, so the whole total batch is in
flight at once). Two sampling paths, same settings:
`shared` (the base's multi-LoRA sampler: rows of every adapter in one batch, one KV cache)
and `merged` (each client a merged-weights sampler of its own, `multi_lora.enabled=False`;
run up to --merged-max clients, it holds a model copy and a KV cache each).

Prints one JSON line: per model and path, per N: RSS MiB, marginal MiB per client beyond the
first, tokens/s (the median of the rounds' rates: by the clock, and by the process's CPU
time, which other work on a shared machine disturbs less); the targets: marginal memory
<= 3 x (adapter + Adam moments) bytes, and tokens/s with 16 clients mixed >= 80% of one
client's at the same total batch (64 clients >= 60%), both ratios printed. Every client's
call joins the engine's running batch (sampler/decode_loop.py).

    PYTHONPATH=$PWD python bench/multi_lora.py [--clients 1 4 16 64] [--models tiny mid]
    PYTHONPATH=$PWD python bench/multi_lora.py --clients 1 16 64 --models tiny --paths shared
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lora_sessions_memory import write_model

from temper.observability.process_memory import rss_mib

MIB = 2**20
MODELS = {"tiny": None, "mid": dict(dim=512, layers=8, ffn_dim=1536)}


def serve_case(case: dict) -> None:
    """One process: N clients and their memory (one JSON line), then one timed round of
    mixed sampling per 'round' line on stdin (one JSON line each) until stdin ends."""
    import torch

    from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
    from temper.generator.multi_lora import MultiLoraSampler
    from temper.sampler.engine import SamplerEngine

    torch.manual_seed(0)
    sampler = SamplerEngine.Config(max_batch=case["total_batch"], max_seq_len=case["seq_len"])
    multi_lora = MultiLoraSampler.Config(
        enabled=case["path"] == "shared", max_resident_adapters=case["max_resident_adapters"]
    )
    service = ServiceClient(storage_dir=case["storage"], sampler=sampler, multi_lora=multi_lora)
    rss_start = rss_mib()
    clients, samplers = [], []
    tokenizer = None
    for who in range(case["clients"]):
        client = service.create_lora_training_client(case["base"], rank=case["rank"], seed=who)
        tokenizer = client.get_tokenizer()
        tokens = [*tokenizer.encode(f"{who % 10}{(who + 3) % 10}="), tokenizer.eos_token_id]
        datum = Datum(
            model_input=ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(AdamParams(learning_rate=1e-3)).result()
        clients.append(client)
        samplers.append(client.save_weights_and_get_sampling_client())
        if who == 0:  # what the first client holds, its sampler built (one sample)
            prompt = ModelInput.from_ints(tokenizer.encode("1="))
            samplers[0].sample(prompt, 1, SamplingParams(max_tokens=2)).result()
            rss_first = rss_mib()
    rss_all = rss_mib()
    adapter_bytes = sum(
        p.numel() * p.element_size() for p in clients[0].engine.trainable
    )  # the trainable parameters are exactly the adapters
    share = case["total_batch"] // case["clients"]
    prompt = ModelInput.from_ints(tokenizer.encode("12="))
    params = SamplingParams(max_tokens=case["max_tokens"], temperature=1.0)

    def one_round() -> int:
        # Every client's request in flight at once, as many users would send them.
        futures = [s.sample(prompt, share, params) for s in samplers]
        return sum(len(seq.tokens) for f in futures for seq in f.result().sequences)

    one_round()  # warm-up: threads, twins, slot loads
    report = {
        "clients": case["clients"],
        "rss_start_mib": round(rss_start, 1),
        "rss_one_client_mib": round(rss_first, 1),
        "rss_mib": round(rss_all, 1),
        "adapter_mib": round(adapter_bytes / MIB, 3),
        "samples_per_client": share,
    }
    print(json.dumps(report), flush=True)
    for _ in sys.stdin:
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens = one_round()
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        print(json.dumps({"tokens": tokens, "s": seconds, "cpu_s": cpu_seconds}), flush=True)


class CaseProcess:
    """A `serve_case` process: its memory report once started, then rounds on request."""

    def __init__(self, case: dict) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--case", json.dumps(case)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.row = self._reply()
        self.rates: list[float] = []
        self.cpu_rates: list[float] = []

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a case process exited with {self.process.wait()}")
        return json.loads(line)

    def run_round(self) -> None:
        self.process.stdin.write("round\n")
        self.process.stdin.flush()
        reply = self._reply()
        self.rates.append(reply["tokens"] / reply["s"])
        self.cpu_rates.append(reply["tokens"] / reply["cpu_s"])

    def close(self) -> dict:
        self.process.stdin.close()
        if self.process.wait() != 0:
            raise RuntimeError(f"a case process exited with {self.process.returncode}")
        return self.row | {
            "tokens_per_s": round(statistics.median(self.rates), 1),
            "tokens_per_cpu_s": round(statistics.median(self.cpu_rates), 1),
        }


def run_side_by_side(cases: list[dict], *, rounds: int) -> list[dict]:
    """The cases' processes up together (started one after another), rounds in turn."""
    processes = []
    try:
        for case in cases:
            processes.append(CaseProcess(case))
        for _ in range(rounds):
            for process in processes:
                process.run_round()
        return [process.close() for process in processes]
    finally:
        for process in processes:
            if process.process.poll() is None:
                process.process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--models", nargs="+", default=["tiny", "mid"], choices=list(MODELS))
    parser.add_argument("--paths", nargs="+", default=["shared", "merged"])
    parser.add_argument("--merged-max", type=int, default=16)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--total-batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--max-resident-adapters",
        type=int,
        help="the shared sampler's resident adapter slots (default: the case's clients)",
    )
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        serve_case(json.loads(args.case))
        return
    report: dict = {"bench": "multi_lora", "config": vars(args) | {"case": None}, "models": {}}
    with tempfile.TemporaryDirectory(prefix="temper-multi-lora-") as tmp:
        for name in args.models:
            base = "tiny"
            if MODELS[name] is not None:
                base = str(Path(tmp) / name)
                write_model(Path(base), **MODELS[name])
            report["models"][name] = {}
            for path in args.paths:
                cases = []
                for clients in args.clients:
                    if path == "merged" and clients > args.merged_max:
                        continue
                    cases.append(
                        dict(
                            base=base,
                            path=path,
                            clients=clients,
                            rank=args.rank,
                            total_batch=args.total_batch,
                            max_tokens=args.max_tokens,
                            seq_len=args.seq_len,
                            max_resident_adapters=args.max_resident_adapters or clients,
                            storage=str(Path(tmp) / f"storage-{name}-{path}-{clients}"),
                        )
                    )
                rows = run_side_by_side(cases, rounds=args.rounds)
                for case, row in zip(cases, rows, strict=True):
                    row["max_resident_adapters"] = case["max_resident_adapters"]
                    if row["clients"] > 1:
                        extra = row["rss_mib"] - row["rss_one_client_mib"]
                        row["marginal_mib_per_client"] = round(extra / (row["clients"] - 1), 2)
                        # Target: <= 3 x (adapter + its two Adam moments).
                        row["marginal_target_mib"] = round(3 * 3 * row["adapter_mib"], 2)
                    print(json.dumps({name: path, **row}), file=sys.stderr)
                report["models"][name][path] = rows
            # Target: 16 clients mixed >= 80% of one client's tokens/s at the same total batch
            # (one client on the shared sampler, and on its own merged sampler).
            shared = {r["clients"]: r for r in report["models"][name].get("shared", [])}
            merged = {r["clients"]: r for r in report["models"][name].get("merged", [])}
            # Calls join the running batch: 64 clients mixed >= 60% of one client's.
            for many in (16, 64):
                if many not in shared:
                    continue
                for label, one in (("shared", shared.get(1)), ("merged", merged.get(1))):
                    if one is None:
                        continue
                    for unit, key in (("", "tokens_per_s"), ("_cpu", "tokens_per_cpu_s")):
                        ratio = shared[many][key] / one[key]
                        report["models"][name][f"mixed{many}_over_one_{label}{unit}"] = round(
                            ratio, 3
                        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
