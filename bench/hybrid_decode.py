"""Hybrid decode throughput: Temper's sampler engine against transformers' `generate` on the
tiny Qwen3.5, side by side in one run.

The tiny Qwen3.5 (4 layers of width 128: 3 Gated DeltaNet + 1 gated full attention) with
random weights, saved once as a transformers directory and loaded by both sides, so they decode
the identical weights in fp32 on the CPU. Batch 64 (one prompt each, 16 random tokens), 32 new
tokens, greedy, no early stop. Tokens per second count the generated tokens over whole
`generate` calls (prefill and decode), as bench/sampler.py does; `same_tokens` is the share of
generated tokens on which the two sides agree (greedy on the same weights: near 1, ties of
rounding aside).

Two Temper settings run in the same rounds as transformers (order alternating, medians kept):
- `temper`: the engine's defaults (`SamplerEngine.Config()` with max_batch = the batch: on CPU
  up to a process per core for calls of at least 32 samples; `temper_helpers_started` is
  the helper processes it started);
- `temper_one_process`: the same in one process (`cpu.processes=1`; the engine's thread
  choice, one thread for this model).
transformers runs its own PyTorch fallbacks for the gated delta rule and the causal conv (no
flash-linear-attention or causal-conv1d kernels on CPU). Prints one JSON line with every config
and the load average before and after.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python bench/hybrid_decode.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

import torch
from timing import interleaved_median_seconds, require_baseline

from temper.api import SamplingParams
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models import materialize
from temper.models.qwen3_5 import qwen3_5_size
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine, SampleRequest

PROMPT_LEN, NEW_TOKENS = 16, 32
VOCAB = 1024


def engine_configs(batch: int) -> dict[str, SamplerEngine.Config]:
    defaults = SamplerEngine.Config(max_batch=batch, max_seq_len=PROMPT_LEN + NEW_TOKENS)
    one_process = dataclasses.replace(defaults, cpu=CpuDecoding.Config(processes=1))
    return {"temper": defaults, "temper_one_process": one_process}


def _models(directory: Path):
    from transformers import AutoModelForCausalLM

    config = qwen3_5_size("tiny", vocab_size=VOCAB)
    save_pretrained(materialize(config, seed=0, dtype="float32"), directory)
    ours = load_pretrained(directory, dtype=torch.float32).eval()
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return ours, hf


def run(*, batch: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        ours, hf = _models(Path(directory) / "model")
    prompts_BT = torch.randint(
        0, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0)
    )
    requests = [
        SampleRequest(
            prompt=row.tolist(),
            params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, stop=[]),
        )
        for row in prompts_BT
    ]
    engines = {name: c.build(model=ours) for name, c in engine_configs(batch).items()}
    outputs: dict[str, list[list[int]]] = {}

    def temper_generate(name: str):
        def call() -> None:
            responses = engines[name].generate(requests)
            outputs[name] = [r.sequences[0].tokens for r in responses]

        return call

    def hf_generate() -> None:
        with torch.no_grad():
            tokens_BT = hf.generate(
                prompts_BT,
                attention_mask=torch.ones_like(prompts_BT),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        outputs["hf"] = tokens_BT[:, PROMPT_LEN:].tolist()

    split = engines["temper"]
    try:
        seconds = interleaved_median_seconds(
            {**{name: temper_generate(name) for name in engines}, "hf": hf_generate},
            repeats=repeats,
        )
    finally:
        helpers_started = split.helpers.num_running if hasattr(split, "helpers") else 0
        for engine in engines.values():
            engine.close()
    rates = {name: batch * NEW_TOKENS / value for name, value in seconds.items()}
    hf_tokens = torch.tensor(outputs["hf"])
    return {
        **{f"{name}_tokens_per_s": round(rate, 1) for name, rate in rates.items()},
        "temper_vs_hf": round(rates["temper"] / rates["hf"], 3),
        "temper_one_process_vs_hf": round(rates["temper_one_process"] / rates["hf"], 3),
        "temper_helpers_started": helpers_started,
        **{
            f"same_tokens_{name}": (torch.tensor(outputs[name]) == hf_tokens).float().mean().item()
            for name in engines
        },
    }


def main() -> None:
    require_baseline("transformers")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    result = run(batch=args.batch, repeats=args.repeats)
    config = qwen3_5_size("tiny", vocab_size=VOCAB)
    print(
        json.dumps(
            {
                "bench": "hybrid_decode",
                "config": {
                    "model": "qwen3_5 tiny, random weights, fp32, cpu",
                    "layer_types": list(config.layer_types),
                    "dim": config.dim,
                    "linear_heads": config.recurrent_state_shape,
                    "vocab": VOCAB,
                    "batch": args.batch,
                    "prompt_tokens": PROMPT_LEN,
                    "new_tokens": NEW_TOKENS,
                    "greedy": True,
                    "repeats": args.repeats,
                    **{
                        name: dataclasses.asdict(c)
                        for name, c in engine_configs(args.batch).items()
                    },
                    "threads": torch.get_num_threads(),
                },
                **result,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
