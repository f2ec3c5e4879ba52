"""Forward and forward+backward throughput of Temper's Qwen3 against HF transformers.

Same random weights (loaded from one HF checkpoint), same batch, same process, interleaved
repetitions; prints one JSON line. Training steps compare Temper's chunked target-logprob loss
with HF's own cross-entropy loss on the same targets. Needs the `test` extra (transformers).

    OMP_WAIT_POLICY=PASSIVE python bench/model_step.py [--batch 16 --seq 128 --dtype float32]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from timing import median_seconds, require_baseline

from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models import materialize, qwen3_size
from temper.models.common.logprobs import target_logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    require_baseline("transformers")

    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    config = qwen3_size(args.size, vocab_size=args.vocab)
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(materialize(config, seed=0), directory)
        ours = load_pretrained(directory, dtype=dtype)
        hf = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    tokens_BT = torch.randint(0, args.vocab, (args.batch, args.seq + 1))
    inputs_BT, targets_BT = tokens_BT[:, :-1], tokens_BT[:, 1:]
    num_tokens = inputs_BT.numel()

    def ours_forward():
        with torch.no_grad():
            ours(inputs_BT)

    def hf_forward():
        with torch.no_grad():
            hf(input_ids=inputs_BT, use_cache=False)

    def ours_train():
        hidden_BTD = ours.hidden_states(inputs_BT)
        loss = -target_logprobs(hidden_BTD, ours.output_weight_VD, targets_BT).mean()
        loss.backward()
        ours.zero_grad(set_to_none=True)

    def hf_train():
        logits_BTV = hf(input_ids=inputs_BT, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits_BTV.float().reshape(-1, args.vocab), targets_BT.reshape(-1)
        )
        loss.backward()
        hf.zero_grad(set_to_none=True)

    results = {}
    for name, fn in [
        ("forward", (ours_forward, hf_forward)),
        ("train", (ours_train, hf_train)),
    ]:
        ours_s = median_seconds(fn[0], repeats=args.repeats)
        hf_s = median_seconds(fn[1], repeats=args.repeats)
        results[f"{name}_tokens_per_s"] = round(num_tokens / ours_s)
        results[f"{name}_hf_tokens_per_s"] = round(num_tokens / hf_s)
        results[f"{name}_speedup_vs_hf"] = round(hf_s / ours_s, 3)
    print(
        json.dumps(
            {
                "bench": "model_step",
                "size": args.size,
                "vocab": args.vocab,
                "batch": args.batch,
                "seq": args.seq,
                "dtype": args.dtype,
                "threads": torch.get_num_threads(),
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
