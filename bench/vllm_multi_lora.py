"""LoRA users on one vLLM engine (generator/vllm_lora.py): mixed decode speed and sync bytes.

One process, one base model (`tiny`, or --dim/--layers/--ffn-dim), fp32 on the CPU:
- `merged`: a plain vLLM engine (no LoRA) decoding the total batch: what one user's merged
  weights get (the baseline of the LoRA engine's overhead);
- `one_user`: the multi-LoRA vLLM engine, one adapter, the same total batch in one call;
- `users`: the same engine, --users adapters, each sending total/users samples at once from
  its own thread (rows of every adapter in vLLM's batches).
Each path runs --rounds timed rounds after a warm-up; tokens/s over all rounds. Every sample
runs --max-tokens tokens (no stop), so the paths decode the same tokens.

Sync bytes: what an RL LoRA step sends to vLLM (the adapter tensors, bf16) against the whole
model (what a merged sync sends), from the shapes of --sync-size (default the 0.6B shape) at
--rank, counted on the meta device (no weights built), for three sets of targets: all
(attention, MLP, unembedding: Tinker's default), attention and MLP, attention only.

Prints one JSON line: both configs, tokens/s per path, users/one_user (target >= 0.8), adapter
and model bytes per sync and their ratio (target <= 0.02 at rank 32 on the 0.6B shape).

    PYTHONPATH=$PWD python bench/vllm_multi_lora.py [--users 16] [--total-batch 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time

import torch

MIB = 2**20


SYNC_TARGETS = {
    "all": {},  # Tinker's default: attention, MLP and unembedding
    "attn_mlp": dict(train_unembed=False),
    "attn": dict(train_mlp=False, train_unembed=False),
}


def sync_bytes(*, size: str, rank: int) -> dict:
    """Adapter and whole-model bytes (bf16) of a Qwen3 `size` with rank-`rank` LoRA on each
    set of targets (SYNC_TARGETS)."""
    from temper.models import qwen3_size
    from temper.models.lora import LoraConfig, apply_lora, lora_state_dict

    report: dict = {"size": size, "rank": rank}
    for name, targets in SYNC_TARGETS.items():
        with torch.device("meta"):
            model = qwen3_size(size).build().to(torch.bfloat16)
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        apply_lora(model, LoraConfig(rank=rank, **targets))
        adapter_bytes = sum(t.numel() * 2 for t in lora_state_dict(model).values())
        report["model_mib"] = round(model_bytes / MIB, 1)
        report[name] = {
            "adapter_mib": round(adapter_bytes / MIB, 2),
            "ratio": round(adapter_bytes / model_bytes, 4),
        }
    return report


def base_and_adapters(args: argparse.Namespace) -> tuple[torch.nn.Module, list]:
    from temper.models import materialize, qwen3_size
    from temper.models.lora import LoraConfig, apply_lora, lora_state_dict

    shape = dict(dim=args.dim, num_layers=args.layers, ffn_dim=args.ffn_dim)
    shape = {key: value for key, value in shape.items() if value is not None}
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=64), init_std=0.1, **shape)
    base = materialize(config, seed=5).eval().requires_grad_(False)
    adapters = []
    generator = torch.Generator().manual_seed(0)
    for who in range(args.users):
        lora = LoraConfig(rank=args.rank, seed=who)
        with torch.device("meta"):
            skeleton = config.build()
        apply_lora(skeleton, lora)
        tensors = {}
        for name, tensor in lora_state_dict(skeleton).items():
            tensors[name] = torch.randn(tensor.shape, generator=generator) * 0.02
        adapters.append((lora, tensors))
    return base, adapters


def timed(run_round, *, rounds: int) -> float:
    run_round()  # warm-up
    tokens, seconds = 0, 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        tokens += run_round()
        seconds += time.perf_counter() - start
    return round(tokens / seconds, 1)


def requests(args: argparse.Namespace, *, samples: int, seed: int) -> list:
    from temper.api import SamplingParams
    from temper.sampler.requests import SampleRequest

    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[], seed=seed)
    return [SampleRequest(prompt=[1, 2, 3, 4], params=params, num_samples=samples)]


def count(responses) -> int:
    return sum(len(s.tokens) for r in responses for s in r.sequences)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--total-batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--ffn-dim", type=int, default=None)
    parser.add_argument("--sync-size", default="0.6B")
    args = parser.parse_args()

    from temper.generator.multi_lora import MultiLoraSampler
    from temper.generator.vllm import VllmGenerator
    from temper.generator.vllm_lora import VllmMultiLora

    base, adapters = base_and_adapters(args)
    vllm = VllmGenerator.Config(
        kv_cache_mib=256, max_num_seqs=args.total_batch, max_lora_rank=args.rank
    )
    report: dict = {"bench": "vllm_multi_lora", "config": vars(args), "tokens_per_s": {}}
    plain = vllm.build(model=base)
    report["tokens_per_s"]["merged"] = timed(
        lambda: count(plain.generate(requests(args, samples=args.total_batch, seed=0))),
        rounds=args.rounds,
    )
    plain.close()
    multi_config = MultiLoraSampler.Config(max_resident_adapters=args.users, batch_window_s=0.01)
    sampler = VllmMultiLora(multi_config, model=base, tokenizer=None, vllm=vllm)
    held = [sampler.register(config=c, tensors=t, version=0) for c, t in adapters]
    report["tokens_per_s"]["one_user"] = timed(
        lambda: count(
            sampler.generate(requests(args, samples=args.total_batch, seed=0), adapter=held[0])
        ),
        rounds=args.rounds,
    )
    share = args.total_batch // args.users

    def all_users() -> int:
        results = [0] * len(held)

        def user(who: int) -> None:
            responses = sampler.generate(requests(args, samples=share, seed=who), adapter=held[who])
            results[who] = count(responses)

        threads = [threading.Thread(target=user, args=(who,)) for who in range(len(held))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(results)

    batches_before = sampler.num_batches
    report["tokens_per_s"]["users"] = timed(all_users, rounds=args.rounds)
    report["batches_per_round"] = round(
        (sampler.num_batches - batches_before) / (args.rounds + 1), 2
    )
    report["engine"] = sampler.describe()
    sampler.close()
    speeds = report["tokens_per_s"]
    report["users_vs_one_user"] = round(speeds["users"] / speeds["one_user"], 3)
    report["one_user_vs_merged"] = round(speeds["one_user"] / speeds["merged"], 3)
    report["sync"] = sync_bytes(size=args.sync_size, rank=args.rank)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
