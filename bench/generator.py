"""Generator backends side by side in one run: Temper's engine, vLLM and HF `generate`.

Cases (prompt 16 tokens, 32 new tokens, sampling at temperature 1, no early stop, the same
random prompts and weights for all three): the tiny Qwen3 in fp32 at batch 1, 16, 64, 128;
a 0.6B-shaped random Qwen3 in bf16 at batch 1 and 8. Then the time of one weight update
(`update_weights` with a full state dict, as after an `optim_step`) for each backend on the
0.6B shape. Temper runs at its engine's defaults (`SamplerEngine.Config()`); vLLM in this
process, eager, prefix caching on. Each case times rounds that run every side once (order
alternating) and keeps the medians. Prints one JSON line with every config.

    OMP_WAIT_POLICY=PASSIVE python bench/generator.py [--quick]    (needs `make vllm`)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from timing import interleaved_median_seconds, require_baseline

from temper.api import SamplingParams
from temper.generator.vllm import VllmGenerator
from temper.models import materialize, qwen3_size
from temper.sampler.engine import SamplerEngine, SampleRequest

PROMPT_LEN, NEW_TOKENS, VOCAB = 16, 32, 1024


def _hf_model(model):
    import tempfile

    from transformers import AutoModelForCausalLM

    from temper.checkpoint.hf import save_pretrained

    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(model, f"{directory}/m")
        dtype = next(model.parameters()).dtype
        return AutoModelForCausalLM.from_pretrained(f"{directory}/m", dtype=dtype).eval()


def run_case(*, size: str, dtype: str, batch: int, repeats: int) -> dict:
    config = dataclasses.replace(qwen3_size(size, vocab_size=VOCAB), max_seq_len=256)
    model = materialize(config, seed=0, dtype=dtype).eval()
    temper = SamplerEngine.Config(max_batch=max(batch, 1), max_seq_len=128).build(model=model)
    vllm = VllmGenerator.Config(kv_cache_mib=256, max_model_len=128).build(model=model)
    hf = _hf_model(model)
    prompts_BT = torch.randint(
        0, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(0)
    )
    params = [SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=i) for i in range(batch)]
    requests = [
        SampleRequest(prompt=row.tolist(), params=p)
        for row, p in zip(prompts_BT, params, strict=True)
    ]

    def hf_generate() -> None:
        with torch.no_grad():
            hf.generate(
                prompts_BT,
                attention_mask=torch.ones_like(prompts_BT),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )

    try:
        seconds = interleaved_median_seconds(
            {
                "temper": lambda: temper.generate(requests),
                "vllm": lambda: vllm.generate(requests),
                "hf": hf_generate,
            },
            repeats=repeats,
        )
    finally:
        temper.close()
        vllm.close()
    rates = {name: batch * NEW_TOKENS / value for name, value in seconds.items()}
    return {
        "size": size,
        "dtype": dtype,
        "batch": batch,
        **{f"{name}_tokens_per_s": round(rate, 1) for name, rate in rates.items()},
        "temper_vs_vllm": round(rates["temper"] / rates["vllm"], 3),
        "temper_vs_hf": round(rates["temper"] / rates["hf"], 3),
        "vllm_vs_hf": round(rates["vllm"] / rates["hf"], 3),
    }


def weight_update_seconds(*, size: str, dtype: str, repeats: int) -> dict:
    """One full update of each backend from a trainer-side state dict (another module)."""
    config = qwen3_size(size, vocab_size=VOCAB)
    model = materialize(config, seed=0, dtype=dtype).eval()
    trainer = materialize(config, seed=1, dtype=dtype).eval()
    state = trainer.state_dict()
    temper = SamplerEngine.Config(max_batch=8, max_seq_len=128).build(model=model)
    vllm = VllmGenerator.Config(kv_cache_mib=128, max_model_len=128).build(model=model)
    result = {"size": size, "dtype": dtype, "bytes": sum(t.nbytes for t in state.values())}
    try:
        for name, backend in (("temper", temper), ("vllm", vllm)):
            times = []
            for version in range(repeats + 1):  # the first is a warm-up
                start = time.perf_counter()
                backend.update_weights(state, version=version + 1)
                times.append(time.perf_counter() - start)
            result[f"{name}_update_s"] = round(sorted(times[1:])[len(times[1:]) // 2], 4)
    finally:
        temper.close()
        vllm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny batch 64 only, 2 rounds")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    require_baseline("transformers")
    repeats = 2 if args.quick else args.repeats
    cases = [("tiny", "float32", b) for b in ((64,) if args.quick else (1, 16, 64, 128))]
    if not args.quick:
        cases += [("0.6B", "bfloat16", 1), ("0.6B", "bfloat16", 8)]
    load_before = os.getloadavg()[0]
    results = [run_case(size=s, dtype=d, batch=b, repeats=repeats) for s, d, b in cases]
    update = weight_update_seconds(
        size="tiny" if args.quick else "0.6B",
        dtype="float32" if args.quick else "bfloat16",
        repeats=repeats,
    )
    print(
        json.dumps(
            {
                "bench": "generator",
                "config": {
                    "prompt_tokens": PROMPT_LEN,
                    "new_tokens": NEW_TOKENS,
                    "vocab": VOCAB,
                    "temperature": 1.0,
                    "temper": dataclasses.asdict(SamplerEngine.Config()),
                    "vllm": dataclasses.asdict(VllmGenerator.Config()),
                    "threads": torch.get_num_threads(),
                },
                "cases": results,
                "weight_update": update,
                "load_before": load_before,
                "load_after": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
