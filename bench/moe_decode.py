"""MoE decode throughput: Temper's engine against vLLM's CPU build on the tiny Qwen3-MoE.

The tiny Qwen3-MoE (4 layers, width 128, 8 experts of width 128, 2 per token, every layer
sparse) as `temper init-model` writes it (`init_model_dir`, the `words` vocabulary), loaded
back and handed to both backends, so they decode the identical weights. Batch 64 (one prompt
each, 16 random tokens), 32 new tokens, temperature 1, no early stop, the same seeds; a case
per dtype (fp32, bf16). Tokens per second count the generated tokens over whole `generate`
calls (prefill and decode), as bench/generator.py does.

Three sides run in the same rounds (order alternating, medians kept):
- `temper`: the engine's defaults (`SamplerEngine.Config()` with max_batch = the batch: on CPU
  a process per core for calls of at least 32 samples, decode twins: fp32 fused attention,
  bf16 packed attention, routers and experts);
- `temper_one_process`: the same in one process (`cpu.processes=1`);
- `vllm`: vLLM in this process (`VllmGenerator.Config()`: eager, prefix caching on), whose CPU
  build runs the experts through its fused MoE kernel.
Prints one JSON line with every config and the load average before and after.

    OMP_WAIT_POLICY=PASSIVE python bench/moe_decode.py [--repeats 5] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile

import torch
from timing import interleaved_median_seconds

from temper.api import SamplingParams
from temper.checkpoint.model_source import ModelSource, init_model_dir
from temper.generator.vllm import VllmGenerator
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

PROMPT_LEN, NEW_TOKENS, MAX_SEQ_LEN = 16, 32, 128
TOKENIZER = "words"


def _load(*, dtype: str):
    """The tiny Qwen3-MoE as `temper init-model` writes it, loaded back."""
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/moe"
        init_model_dir(path, family="qwen3_moe", size="tiny", tokenizer=TOKENIZER, dtype=dtype)
        loaded = ModelSource.Config(path=path, dtype=dtype).build()
    return loaded.model.eval(), loaded.tokenizer


def _requests(*, batch: int, vocab: int) -> list[SampleRequest]:
    prompts_BT = torch.randint(
        0, vocab, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0)
    )
    return [
        SampleRequest(
            prompt=row.tolist(), params=SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=i)
        )
        for i, row in enumerate(prompts_BT)
    ]


def temper_configs(batch: int) -> dict[str, SamplerEngine.Config]:
    defaults = SamplerEngine.Config(max_batch=batch, max_seq_len=MAX_SEQ_LEN)
    one_process = dataclasses.replace(defaults, cpu=CpuDecoding.Config(processes=1))
    return {"temper": defaults, "temper_one_process": one_process}


def vllm_config() -> VllmGenerator.Config:
    return VllmGenerator.Config(kv_cache_mib=256, max_model_len=MAX_SEQ_LEN)


def run_case(model, tokenizer, *, dtype: str, batch: int, repeats: int) -> dict:
    backends = {
        name: config.build(model=model, tokenizer=tokenizer)
        for name, config in temper_configs(batch).items()
    }
    backends["vllm"] = vllm_config().build(model=model, tokenizer=tokenizer)
    requests = _requests(batch=batch, vocab=model.config.vocab_size)
    try:
        seconds = interleaved_median_seconds(
            {name: (lambda b=backend: b.generate(requests)) for name, backend in backends.items()},
            repeats=repeats,
        )
    finally:
        for backend in backends.values():
            backend.close()
    rates = {name: batch * NEW_TOKENS / value for name, value in seconds.items()}
    return {
        "dtype": dtype,
        "batch": batch,
        **{f"{name}_tokens_per_s": round(rate, 1) for name, rate in rates.items()},
        "temper_vs_vllm": round(rates["temper"] / rates["vllm"], 3),
        "temper_one_process_vs_vllm": round(rates["temper_one_process"] / rates["vllm"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    cases = []
    for dtype in args.dtypes.split(","):
        model, tokenizer = _load(dtype=dtype)
        case = run_case(model, tokenizer, dtype=dtype, batch=args.batch, repeats=args.repeats)
        cases.append(case)
    model_config = model.config
    print(
        json.dumps(
            {
                "bench": "moe_decode",
                "config": {
                    "model": "qwen3_moe tiny",
                    "tokenizer": TOKENIZER,
                    "vocab": model_config.vocab_size,
                    "num_experts": model_config.num_experts,
                    "top_k": model_config.top_k,
                    "num_params": model_config.num_params,
                    "num_active_params": model_config.num_active_params,
                    "prompt_tokens": PROMPT_LEN,
                    "new_tokens": NEW_TOKENS,
                    "temperature": 1.0,
                    "repeats": args.repeats,
                    **{
                        name: dataclasses.asdict(config)
                        for name, config in temper_configs(args.batch).items()
                    },
                    "vllm": dataclasses.asdict(vllm_config()),
                    "threads": torch.get_num_threads(),
                },
                "cases": cases,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
