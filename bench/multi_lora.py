"""Many LoRA clients on one base (in-process ServiceClient): memory and mixed sampling speed.

For each number of clients N (--clients, default 1 4 16 64) a fresh process creates N LoRA
training clients on one base, gives each a forward_backward + optim_step (its Adam moments
exist) and a sampling snapshot, and reports its RSS; then every client samples the same
share of one total batch at once (--total-batch samples of --max-tokens tokens, N clients
x total/N samples each) for --rounds rounds, timed. Two sampling paths, same settings:
`shared` (the base's multi-LoRA sampler: rows of every adapter in one batch, one KV cache)
and `merged` (each client a merged-weights sampler of its own, `multi_lora.enabled=False`;
run up to --merged-max clients, it holds a model copy and a KV cache each).

Prints one JSON line: per model and path, per N: RSS MiB, marginal MiB per client beyond the
first, tokens/s; the targets: marginal memory <= 3 x (adapter + Adam moments) bytes, and
tokens/s with 16 clients mixed >= 80% of one client's at the same total batch (64 clients
>= 60%). Every client's call joins the engine's running batch (sampler/decode_loop.py).

    PYTHONPATH=$PWD python bench/multi_lora.py [--clients 1 4 16 64] [--models tiny mid]
    PYTHONPATH=$PWD python bench/multi_lora.py --clients 1 16 64 --models tiny --paths shared
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lora_sessions_memory import write_model

from temper.observability.process_memory import rss_mib

MIB = 2**20
MODELS = {"tiny": None, "mid": dict(dim=512, layers=8, ffn_dim=1536)}


def run_case(case: dict) -> dict:
    """One process: N clients, their memory and their mixed sampling speed."""
    import torch

    from temper import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient
    from temper.generator.multi_lora import MultiLoraSampler
    from temper.sampler.engine import SamplerEngine

    torch.manual_seed(0)
    sampler = SamplerEngine.Config(max_batch=case["total_batch"], max_seq_len=case["seq_len"])
    service = ServiceClient(
        storage_dir=case["storage"],
        sampler=sampler,
        multi_lora=MultiLoraSampler.Config(enabled=case["path"] == "shared"),
    )
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
    times, tokens = [], 0
    for _ in range(case["rounds"]):
        start = time.perf_counter()
        tokens += one_round()
        times.append(time.perf_counter() - start)
    return {
        "clients": case["clients"],
        "rss_start_mib": round(rss_start, 1),
        "rss_one_client_mib": round(rss_first, 1),
        "rss_mib": round(rss_all, 1),
        "adapter_mib": round(adapter_bytes / MIB, 3),
        "tokens_per_s": round(tokens / sum(times), 1),
        "samples_per_client": share,
    }


def run_in_process(case: dict) -> dict:
    output = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(case)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(output.strip().splitlines()[-1])


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
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
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
                rows = []
                for clients in args.clients:
                    if path == "merged" and clients > args.merged_max:
                        continue
                    case = dict(
                        base=base,
                        path=path,
                        clients=clients,
                        rank=args.rank,
                        total_batch=args.total_batch,
                        max_tokens=args.max_tokens,
                        seq_len=args.seq_len,
                        rounds=args.rounds,
                        storage=str(Path(tmp) / f"storage-{name}-{path}-{clients}"),
                    )
                    row = run_in_process(case)
                    if clients > 1:
                        extra = row["rss_mib"] - row["rss_one_client_mib"]
                        row["marginal_mib_per_client"] = round(extra / (clients - 1), 2)
                        # Target: <= 3 x (adapter + its two Adam moments).
                        row["marginal_target_mib"] = round(3 * 3 * row["adapter_mib"], 2)
                    print(json.dumps({name: path, **row}), file=sys.stderr)
                    rows.append(row)
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
                    if one is not None:
                        report["models"][name][f"mixed{many}_over_one_{label}"] = round(
                            shared[many]["tokens_per_s"] / one["tokens_per_s"], 3
                        )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
