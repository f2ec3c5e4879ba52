"""Forward cost of K adapters mixed in one batch (models/multi_lora.py) against merged weights.

Times one forward of a [B, T] batch (T=1 is a decode step's linears without a KV cache; a
larger T is a prefill) on: the merged plain model (one adapter for every row, what a
merged-weights sampler decodes on), and the multi-adapter model with K adapters, rows spread
over them. The models alone, not the sampler engine: attention over a cache is left out,
which is the same for both.

    PYTHONPATH=$PWD python bench/multi_lora_forward.py [--dim 512 --layers 8 --ffn-dim 1536]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import torch

from temper.models import materialize, qwen3_size
from temper.models.lora import (
    LoraConfig,
    apply_lora,
    lora_state_dict,
    merged_config,
    merged_state_dict,
)
from temper.models.multi_lora import apply_multi_lora, set_rows


def timed(fn, *, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=384)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()

    config = dataclasses.replace(
        qwen3_size("tiny"),
        dim=args.dim,
        num_layers=args.layers,
        num_heads=max(1, args.dim // 64),
        num_kv_heads=max(1, args.dim // 128),
        head_dim=min(64, args.dim),
        ffn_dim=args.ffn_dim,
    )
    base = materialize(config, seed=0, dtype="float32").eval().requires_grad_(False)
    adapters = []
    for seed in range(16):
        lora = LoraConfig(rank=args.rank, seed=seed)
        trained = copy.deepcopy(base)
        apply_lora(trained, lora)
        adapters.append((lora, lora_state_dict(trained)))
    merged = materialize(merged_config(trained), dtype="float32", init="empty").eval()
    merged.load_state_dict(merged_state_dict(trained))

    print(f"{args.layers} layers x {args.dim}, rank {args.rank}, batch {args.batch}; ms/forward")
    with torch.inference_mode():
        for tokens in (1, 64):
            tokens_BT = torch.randint(0, config.vocab_size, (args.batch, tokens))
            row = {"merged (1 adapter)": timed(lambda t=tokens_BT: merged(t), repeats=args.repeats)}
            for count in (1, 4, 16):
                multi = copy.deepcopy(base)
                apply_multi_lora(multi, adapters[:count])
                set_rows(multi, torch.arange(args.batch) % count)
                row[f"{count} adapters mixed"] = timed(
                    lambda m=multi, t=tokens_BT: m(t), repeats=args.repeats
                )
            cells = ", ".join(f"{name} {ms:.2f}" for name, ms in row.items())
            print(f"T={tokens}: {cells}")


if __name__ == "__main__":
    main()
