"""Sampler throughput against HF transformers `generate`, measured side by side in one run.

Cases (prompt 16 tokens, 32 new tokens, sampling at temperature 1, no early stop):
- the tiny Qwen3 (4 layers, width 128) at batch 1, 16, 64 and 128, fp32;
- a 0.6B-shaped random Qwen3 in bf16 at batch 1 and 8, with the memory-bandwidth bound: the
  bytes of weights a decode step reads divided by a copy bandwidth measured in this run;
- on CUDA (when present): the 0.6B shape in bf16 at batch 256 and its HBM-bandwidth fraction.

Each case builds one random model, loads the same weights into HF, warms both up, then times
`repeats` interleaved runs of each and keeps the medians. Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE python bench/sampler.py [--quick] [--vocab 1024]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from temper.api import SamplingParams
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models import materialize, qwen3_size
from temper.sampler.engine import SamplerEngine, SampleRequest

PROMPT_LEN = 16
NEW_TOKENS = 32


def copy_bandwidth(*, device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write both counted)."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    target = torch.empty_like(source)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _median_tokens_per_s(fn, *, num_tokens: int, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return num_tokens / statistics.median(times)


def _compare(
    *, ours, hf, vocab: int, batch: int, device: torch.device, repeats: int
) -> tuple[float, float]:
    """(Temper, HF) tokens/s for one batch size."""
    engine = SamplerEngine.Config(max_batch=batch, max_seq_len=PROMPT_LEN + NEW_TOKENS).build(
        model=ours
    )
    generator = torch.Generator().manual_seed(0)
    prompts_BT = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=generator)
    requests = [
        SampleRequest(
            prompt=row.tolist(), params=SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=i)
        )
        for i, row in enumerate(prompts_BT)
    ]
    hf_inputs = prompts_BT.to(device)

    def temper_generate() -> None:
        engine.generate(requests)

    def hf_generate() -> None:
        with torch.no_grad():
            hf.generate(
                hf_inputs,
                attention_mask=torch.ones_like(hf_inputs),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=True,
                top_k=0,
                pad_token_id=0,
            )

    num_tokens = batch * NEW_TOKENS
    timing = {"num_tokens": num_tokens, "repeats": repeats, "device": device}
    return (
        _median_tokens_per_s(temper_generate, **timing),
        _median_tokens_per_s(hf_generate, **timing),
    )


def run_case(
    *,
    size: str,
    vocab: int,
    dtype: torch.dtype,
    batches: list[int],
    device: torch.device,
    repeats: int,
    bandwidth: float | None,
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    config = qwen3_size(size, vocab_size=vocab)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "model"
        save_pretrained(materialize(config, seed=0, dtype=dtype), path)
        ours = load_pretrained(path, dtype=dtype, device=device).eval()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    results = []
    for batch in batches:
        ours_tps, hf_tps = _compare(
            ours=ours, hf=hf, vocab=vocab, batch=batch, device=device, repeats=repeats
        )
        result = {
            "model": size,
            "vocab": vocab,
            "dtype": str(dtype).removeprefix("torch."),
            "device": device.type,
            "batch": batch,
            "temper_tokens_per_s": round(ours_tps, 1),
            "hf_tokens_per_s": round(hf_tps, 1),
            "speedup_vs_hf": round(ours_tps / hf_tps, 2),
        }
        if bandwidth is not None:
            # Every decode step reads all weights once; a step makes `batch` tokens.
            bound = batch * bandwidth / weight_bytes
            result.update(
                weight_bytes=weight_bytes,
                bandwidth_bound_tokens_per_s=round(bound, 1),
                fraction_of_bound=round(ours_tps / bound, 3),
            )
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, fewer repeats")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary of the tiny model")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    cases = run_case(
        size="tiny",
        vocab=args.vocab,
        dtype=torch.float32,
        batches=[1, 16, 64, 128],
        device=cpu,
        repeats=args.repeats,
        bandwidth=None,
    )
    report: dict = {"bench": "sampler", "threads": torch.get_num_threads()}
    if not args.quick:
        bandwidth = copy_bandwidth(device=cpu)
        report["cpu_copy_bandwidth_gb_per_s"] = round(bandwidth / 1e9, 2)
        cases += run_case(
            size="0.6B",
            vocab=151_936,
            dtype=torch.bfloat16,
            batches=[1, 8],
            device=cpu,
            repeats=max(2, args.repeats // 2),
            bandwidth=bandwidth,
        )
        if torch.cuda.is_available():
            cuda = torch.device("cuda")
            hbm = copy_bandwidth(device=cuda)
            report["cuda_copy_bandwidth_gb_per_s"] = round(hbm / 1e9, 1)
            cases += run_case(
                size="0.6B",
                vocab=151_936,
                dtype=torch.bfloat16,
                batches=[256],
                device=cuda,
                repeats=args.repeats,
                bandwidth=hbm,
            )
    report["cases"] = cases
    print(json.dumps(report))


if __name__ == "__main__":
    main()
