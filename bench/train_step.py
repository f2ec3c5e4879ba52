"""Training throughput: Temper's forward_backward + optim_step against an HF training step.

Same random weights (one HF checkpoint loaded by both), same token batch, AdamW on both sides,
measured side by side in one run; prints one JSON line. Temper's side is the real API path:
Datums with cross_entropy loss inputs -> TrainerEngine.forward_backward -> optim_step, with
`shard_threads` = the torch thread count (one shard of the datums per core, see
temper/distributed/thread_shards.py) and, for reference, without (`..._unsharded`).

The three steps are timed interleaved (one of each per round) so that load from other
processes on a shared machine hits them alike; reported: the median of the rounds, the best
round (closest to an idle machine) and CPU time per step (summed over threads).
On CUDA (when present) it also reports the MFU of the 0.6B shape in bf16 at 16k tokens/step.

    OMP_WAIT_POLICY=PASSIVE python bench/train_step.py [--batch 16 --seq 128 --vocab 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from timing import median_seconds, require_baseline

from temper.api import AdamParams, Datum, ModelInput
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models import materialize, qwen3_size
from temper.trainer import TrainerEngine

ADAM = AdamParams(learning_rate=1e-4, weight_decay=0.0)


def _models(size: str, *, vocab: int, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "model"
        save_pretrained(materialize(qwen3_size(size, vocab_size=vocab), seed=0), path)
        ours = load_pretrained(path, dtype=dtype, device=device)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return ours, hf


def compare(*, size: str, vocab: int, batch: int, seq: int, repeats: int) -> dict:
    device = torch.device("cpu")
    ours, hf = _models(size, vocab=vocab, dtype=torch.float32, device=device)
    unsharded_model, _ = _models(size, vocab=vocab, dtype=torch.float32, device=device)
    threads = torch.get_num_threads()
    engine = TrainerEngine.Config(
        max_tokens_per_microbatch=batch * seq, shard_threads=threads
    ).build(model=ours, lora=None)
    unsharded = TrainerEngine.Config(max_tokens_per_microbatch=batch * seq).build(
        model=unsharded_model, lora=None
    )
    tokens_BT = torch.randint(
        0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    data = [
        Datum(
            model_input=ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:], "weights": torch.ones(seq)},
        )
        for row in tokens_BT
    ]
    hf_optimizer = torch.optim.AdamW(hf.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12)

    def temper_step(trainer: TrainerEngine) -> Callable[[], None]:
        def step() -> None:
            trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(ADAM)

        return step

    def hf_step() -> None:
        logits_BTV = hf(input_ids=tokens_BT[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(
            logits_BTV.float().reshape(-1, vocab), tokens_BT[:, 1:].reshape(-1), reduction="sum"
        )
        loss.backward()
        hf_optimizer.step()
        hf_optimizer.zero_grad(set_to_none=True)

    steps = {"temper": temper_step(engine), "unsharded": temper_step(unsharded), "hf": hf_step}
    times = _interleaved(steps, repeats=repeats)
    num_tokens = batch * seq
    median = {name: statistics.median(wall) for name, (wall, _) in times.items()}
    best = {name: min(wall) for name, (wall, _) in times.items()}
    return {
        "model": size,
        "vocab": vocab,
        "batch": batch,
        "seq": seq,
        "dtype": "float32",
        "shard_threads": threads,
        "temper_tokens_per_s": round(num_tokens / median["temper"]),
        "hf_tokens_per_s": round(num_tokens / median["hf"]),
        "speedup_vs_hf": round(median["hf"] / median["temper"], 3),
        "temper_unsharded_tokens_per_s": round(num_tokens / median["unsharded"]),
        "speedup_unsharded_vs_hf": round(median["hf"] / median["unsharded"], 3),
        "best_round_speedup_vs_hf": round(best["hf"] / best["temper"], 3),
        "best_round_speedup_unsharded_vs_hf": round(best["hf"] / best["unsharded"], 3),
        "cpu_ms_per_step": {
            name: round(statistics.median(cpu) * 1e3, 1) for name, (_, cpu) in times.items()
        },
    }


def _interleaved(
    steps: dict[str, Callable[[], None]], *, repeats: int
) -> dict[str, tuple[list[float], list[float]]]:
    """(wall seconds, CPU seconds) of each step per round, one round = each step once."""
    for step in steps.values():
        step()  # warm-up: allocator, kernel selection, lazy initialization
    times = {name: ([], []) for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            cpu, wall = time.process_time(), time.perf_counter()
            step()
            times[name][0].append(time.perf_counter() - wall)
            times[name][1].append(time.process_time() - cpu)
    return times


def cuda_mfu(*, repeats: int) -> dict:
    """0.6B shape, bf16, 16k tokens per step (8 x 2048): model FLOPs utilization."""
    device = torch.device("cuda")
    config = qwen3_size("0.6B")
    model = materialize(config, device=device, dtype=torch.bfloat16, seed=0)
    engine = TrainerEngine.Config(max_tokens_per_microbatch=16384).build(model=model, lora=None)
    batch, seq = 8, 2048
    tokens_BT = torch.randint(0, config.vocab_size, (batch, seq + 1))
    data = [
        Datum(
            model_input=ModelInput.from_ints(row[:-1].tolist()),
            loss_fn_inputs={"target_tokens": row[1:], "weights": torch.ones(seq)},
        )
        for row in tokens_BT
    ]

    def step() -> None:
        engine.forward_backward(data, "cross_entropy")
        engine.optim_step(ADAM)

    seconds = median_seconds(step, repeats=repeats, device=device)
    # 6 N per token for the matmuls, plus attention: 12 * layers * (heads * head_dim) * seq per
    # token (the query width, which is not `dim` in Qwen3: 16 x 128 against 1024 at 0.6B).
    attention_width = config.num_heads * config.head_dim
    flops_per_token = 6 * config.num_params + 12 * config.num_layers * attention_width * seq
    achieved = flops_per_token * batch * seq / seconds
    peak = _peak_bf16_flops()
    return {
        "model": "0.6B",
        "dtype": "bfloat16",
        "tokens_per_step": batch * seq,
        "seconds_per_step": round(seconds, 4),
        "tflops": round(achieved / 1e12, 1),
        "mfu": round(achieved / peak, 3) if peak else None,
    }


def _peak_bf16_flops() -> float | None:
    """The card's dense bf16 peak (the datasheets' figures without sparsity); None if unknown.
    The H100's depends on its form: SXM (HBM3) 989, NVL 835, PCIe 756 TFLOP/s."""
    name = torch.cuda.get_device_name()
    dense_bf16 = {
        "H100 PCIe": 756e12,
        "H100 NVL": 835e12,
        "H100": 989e12,
        "H200": 989e12,
        "A100": 312e12,
    }
    return next((value for key, value in dense_bf16.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    require_baseline("transformers")
    report = {
        "bench": "train_step",
        "threads": torch.get_num_threads(),
        "cpu": compare(
            size=args.size, vocab=args.vocab, batch=args.batch, seq=args.seq, repeats=args.repeats
        ),
    }
    if torch.cuda.is_available():
        report["cuda"] = cuda_mfu(repeats=args.repeats)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
