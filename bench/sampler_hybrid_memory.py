"""A hybrid model's sampler memory per sequence, and what its prefix cache saves on a multi-turn
workload. Prints one JSON line.

- memory: bytes per decoding sequence of the KV cache (full-attention layers only) and of the
  recurrent-state pool (linear-attention layers), at max_seq_len 128 and 2,048, for the tiny
  Qwen3.5 (allocated by an engine, fp32) and the published 4B and 9B shapes (from their
  configs, bf16); beside them the KV bytes if every layer held keys/values.
- multi_turn: episodes of several turns, each turn's prompt the previous prompt and
  completion plus an observation, all episodes' turns in one generate call; tokens prefilled
  and seconds with the prefix cache on (a next turn extends its whole finished sequence:
  keys/values and final states) and off, on the same engine configuration otherwise.

    PYTHONPATH=. python bench/sampler_hybrid_memory.py
"""

from __future__ import annotations

import dataclasses
import json
import time

import torch

from temper.api import SamplingParams
from temper.models import materialize
from temper.models.qwen3_5 import qwen3_5_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.kv_cache import KVCacheShape
from temper.sampler.recurrent_pool import RecurrentPoolShape

VOCAB = 64
EPISODES, TURNS, FIRST_PROMPT, COMPLETION, OBSERVATION = 16, 4, 64, 24, 16


def _per_sequence(config, *, max_seq_len: int, dtype: torch.dtype) -> dict[str, int]:
    kv = KVCacheShape.for_model(config, num_slots=1, max_seq_len=max_seq_len)
    every_layer = dataclasses.replace(kv, num_layers=config.num_layers, attention_layers=None)
    pool = RecurrentPoolShape.for_model(config, num_slots=1)
    return {
        "kv_bytes": kv.nbytes(dtype),
        "state_pool_bytes": pool.nbytes(dtype),
        "kv_bytes_if_every_layer_had_kv": every_layer.nbytes(dtype),
    }


def memory(model) -> dict:
    report = {}
    for max_seq_len in (128, 2048):
        engine = SamplerEngine.Config(
            max_batch=8, max_seq_len=max_seq_len, cpu=CpuDecoding.Config(processes=1)
        ).build(model=model)
        computed = _per_sequence(model.config, max_seq_len=max_seq_len, dtype=torch.float32)
        report[f"tiny_fp32_allocated_{max_seq_len}"] = {
            "kv_bytes": engine.cache.nbytes // 8,
            "state_pool_bytes": engine.cache.states.nbytes // 8,
            "kv_bytes_if_every_layer_had_kv": computed["kv_bytes_if_every_layer_had_kv"],
        }
        for name in ("4B", "9B"):
            report[f"{name}_bf16_{max_seq_len}"] = _per_sequence(
                qwen3_5_size(name), max_seq_len=max_seq_len, dtype=torch.bfloat16
            )
    return report


def multi_turn(model, *, prefix_cache_mib: float) -> dict:
    engine = SamplerEngine.Config(
        max_batch=EPISODES,
        max_seq_len=512,
        prefix_cache_mib=prefix_cache_mib,
        cpu=CpuDecoding.Config(processes=1, num_threads=1),
    ).build(model=model)
    prefilled = [0]
    original = engine.admission._prefill

    def counting(rows):
        prefilled[0] += sum(len(s.prompt) - (c.length if c else 0) for s, _, c in rows)
        return original(rows)

    engine.admission._prefill = counting
    generator = torch.Generator().manual_seed(0)

    def tokens(count: int) -> list[int]:
        return torch.randint(0, VOCAB, (count,), generator=generator).tolist()

    prompts = [tokens(FIRST_PROMPT) for _ in range(EPISODES)]
    prompt_tokens, start = 0, time.perf_counter()
    for turn in range(TURNS):
        requests = [
            SampleRequest(
                prompt=prompt, params=SamplingParams(max_tokens=COMPLETION, seed=100 * turn + e)
            )
            for e, prompt in enumerate(prompts)
        ]
        prompt_tokens += sum(map(len, prompts))
        responses = engine.generate(requests)
        prompts = [
            prompt + response.sequences[0].tokens + tokens(OBSERVATION)
            for prompt, response in zip(prompts, responses, strict=True)
        ]
    return {
        "prefix_cache_mib": prefix_cache_mib,
        "prompt_tokens": prompt_tokens,
        "tokens_prefilled": prefilled[0],
        "seconds": round(time.perf_counter() - start, 3),
        "prefix_cache_bytes": engine.prefix_cache.nbytes,
    }


def main() -> None:
    torch.set_num_threads(1)
    config = dataclasses.replace(qwen3_5_size("tiny", vocab_size=VOCAB), init_std=0.1)
    model = materialize(config, seed=0, dtype="float32").eval()
    workload = {
        "episodes": EPISODES,
        "turns": TURNS,
        "first_prompt": FIRST_PROMPT,
        "completion": COMPLETION,
        "observation": OBSERVATION,
        "model": "qwen3_5 tiny fp32 (3 linear + 1 full attention layers)",
        "threads": 1,
    }
    report = {
        "bench": "sampler_hybrid_memory",
        "memory_per_sequence": memory(model),
        "multi_turn_workload": workload,
        "multi_turn": {
            "prefix_cache_on": multi_turn(model, prefix_cache_mib=32.0),
            "prefix_cache_off": multi_turn(model, prefix_cache_mib=0.0),
        },
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
