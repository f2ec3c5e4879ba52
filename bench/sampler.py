"""Sampler throughput against HF transformers `generate`, measured side by side in one run.

Cases (prompt 16 tokens, 32 new tokens, sampling at temperature 1, no early stop):
- the tiny Qwen3 (4 layers, width 128) at batch 1, 16, 64 and 128, fp32;
- a 0.6B-shaped random Qwen3 in bf16 at batch 1 and 8, with the memory-bandwidth bound: the
  bytes of weights a decode step reads divided by a copy bandwidth measured in this run;
- on CUDA (when present): the 0.6B shape in bf16 at batch 256 and its HBM-bandwidth fraction.

Decode-only throughput (the run minus prefill and first token) is what the bandwidth bound
is compared with. `linear_kernel_gb_per_s` is the rate at which torch's linear kernel streams
feed-forward weights from memory at that batch (matrices totalling 256 MiB, far more than the
L3 cache, as a decode step's weights are), and `packed_linear_kernel_gb_per_s` the same for
oneDNN-prepacked weights (what the engine uses for bf16 on CPU): the ceiling for any engine
built on that kernel, printed as `kernel_ceiling_fraction_of_bound` (that rate over the copy
bandwidth).

Each case builds one random model, loads the same weights into HF, warms each side up, then
times `repeats` rounds that run each side once (the order alternating between rounds) and
keeps the medians. Prints one JSON line, with the load average before and after.

Every CPU case runs Temper at two settings, side by side with HF in the same rounds:
- `temper_*` (the headline, `speedup_vs_hf`): the engine's defaults (`SamplerEngine.Config()
  .cpu`: a process per core for calls of at least 32 samples, each on its share of the
  process's threads; smaller calls in one process, on one thread if their decode steps are
  small (`num_threads='auto'`), else on all of them; decode steps unsplit; `*_threads` is
  what each process ran on),
  unless the flags say otherwise: `--tiny-threads 1` runs every part on one thread,
  `--decode-shards auto` splits decode steps over the threads, `--cpu-processes 1` keeps
  every call in one process;
- `rl_job_*`: what an RL job samples with (`RLJob.Config().sampler.cpu`: one process per core,
  each on one thread), at the same batch.

    OMP_WAIT_POLICY=PASSIVE python bench/sampler.py [--quick] [--vocab 1024] [--batches 1,64]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from timing import interleaved_median_seconds, median_seconds, require_baseline

from temper.api import SamplingParams
from temper.checkpoint.hf import load_pretrained, save_pretrained
from temper.models import materialize, qwen3_size
from temper.rl.job import RLJob
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.cpu.packed_linear import PackedLinear
from temper.sampler.engine import SamplerEngine, SampleRequest

PROMPT_LEN = 16
NEW_TOKENS = 32


def copy_bandwidth(*, device: torch.device, nbytes: int = 2**30, repeats: int = 5) -> float:
    """Bytes per second moved by a large tensor copy (read + write both counted)."""
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    target = torch.empty_like(source)
    return 2 * nbytes / median_seconds(lambda: target.copy_(source), repeats=repeats, device=device)


def linear_bandwidth(
    config,
    *,
    batch: int,
    dtype: torch.dtype,
    device: torch.device,
    packed: bool = False,
    nbytes: int = 2**28,
) -> float:
    """Weight bytes per second torch's linear kernel streams at this batch, over feed-forward
    matrices of `nbytes` in all (read from memory, not cache, as in a decode step): the
    ceiling that kernel sets, whatever the engine does around it."""
    matrix_bytes = config.ffn_dim * config.dim * torch.empty((), dtype=dtype).element_size()
    weights = [
        torch.randn(config.ffn_dim, config.dim, device=device).to(dtype)
        for _ in range(max(1, nbytes // matrix_bytes))
    ]
    x = torch.randn(batch, config.dim, device=device).to(dtype)
    if packed:
        weights = [PackedLinear(weight, batch_hint=batch) for weight in weights]

        def run() -> None:
            for linear in weights:
                linear(x)
    else:

        def run() -> None:
            for weight in weights:
                torch.nn.functional.linear(x, weight)

    seconds = median_seconds(run, repeats=7, device=device)
    return len(weights) * matrix_bytes / seconds


def _compare(
    *,
    ours,
    hf,
    vocab: int,
    batch: int,
    device: torch.device,
    repeats: int,
    cpus: dict[str, CpuDecoding.Config],
    hf_threads: int | None = None,
) -> dict[str, dict[str, float | bool]]:
    """Tokens/s of Temper at each CPU configuration in `cpus` and of HF, interleaved; with
    `hf_threads`, HF again on that many threads."""
    engines = {
        name: SamplerEngine.Config(
            max_batch=batch, max_seq_len=PROMPT_LEN + NEW_TOKENS, cpu=cpu
        ).build(model=ours)
        for name, cpu in cpus.items()
    }
    generator = torch.Generator().manual_seed(0)
    prompts_BT = torch.randint(0, vocab, (batch, PROMPT_LEN), generator=generator)
    requests = [
        SampleRequest(
            prompt=row.tolist(), params=SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=i)
        )
        for i, row in enumerate(prompts_BT)
    ]
    first_token_only = [
        SampleRequest(prompt=r.prompt, params=SamplingParams(max_tokens=1, stop=[], seed=i))
        for i, r in enumerate(requests)
    ]
    hf_inputs = prompts_BT.to(device)

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

    def generate(engine, batch_requests):
        return lambda: engine.generate(batch_requests)

    try:
        runs = {name: generate(engine, requests) for name, engine in engines.items()}
        seconds = interleaved_median_seconds(
            {**runs, "hf": hf_generate}, repeats=repeats, device=device
        )
        # Decode alone (what a bandwidth bound describes): the run minus prefill + 1 token.
        prefill = interleaved_median_seconds(
            {name: generate(engine, first_token_only) for name, engine in engines.items()},
            repeats=repeats,
            device=device,
        )
        results: dict[str, dict[str, float | bool]] = {}
        for name, engine in engines.items():
            results[name] = {
                "tokens_per_s": batch * NEW_TOKENS / seconds[name],
                "decode_tokens_per_s": batch
                * (NEW_TOKENS - 1)
                / max(seconds[name] - prefill[name], 1e-9),
                # On CPU the engine's decode path (chosen at build) says whether it decodes
                # on packed weights; the plain path (CUDA) has no twin.
                "packed": getattr(_local_engine(engine).decoding, "twin", None) == "packed",
                "threads": _threads(engine, rows=batch),
            }
    finally:
        for engine in engines.values():
            engine.close()
    results["hf"] = {"tokens_per_s": batch * NEW_TOKENS / seconds["hf"]}
    if hf_threads is not None and device.type == "cpu":
        threads = torch.get_num_threads()
        torch.set_num_threads(hf_threads)
        try:
            results["hf_same_threads"] = {
                "tokens_per_s": batch * NEW_TOKENS / median_seconds(hf_generate, repeats=repeats)
            }
        finally:
            torch.set_num_threads(threads)
    return results


def cpu_config(**settings: int | str | None) -> CpuDecoding.Config:
    """`SamplerEngine.Config.cpu` with the settings given (None: the engine's default)."""
    return CpuDecoding.Config(**{name: v for name, v in settings.items() if v is not None})


def rl_job_cpu() -> CpuDecoding.Config:
    """The CPU settings an RL job samples with (`RLJob.Config().sampler.cpu`: one process per
    core, each on one thread), which differ from the engine's defaults."""
    return RLJob.Config().sampler.cpu


def _local_engine(sampler) -> SamplerEngine:
    """The engine itself (a split sampler holds one for its own part)."""
    return getattr(sampler, "engine", sampler)


def _threads(sampler, *, rows: int) -> int:
    """The threads each process of a `rows`-row call decodes on (`cpu.num_threads` resolved)."""
    helpers = getattr(sampler, "helpers", None)
    if helpers is not None and rows >= 2 * helpers.min_rows:
        return helpers.threads  # a split call: every part on its share
    decoding = _local_engine(sampler).decoding
    auto = getattr(decoding, "auto_threads", lambda rows: None)(rows=rows)  # CUDA: none
    return auto or torch.get_num_threads()


def auto_or_int(value: str) -> int | str:
    return value if value == "auto" else int(value)


def run_case(
    *,
    size: str,
    vocab: int,
    dtype: torch.dtype,
    batches: list[int],
    device: torch.device,
    repeats: int,
    bandwidth: float | None,
    cpu: CpuDecoding.Config,
    rl_job: bool,
) -> list[dict]:
    """Each batch at the CPU settings `cpu` (the headline, `temper_*`) and, with `rl_job`,
    also at the RL job's (`rl_job_*`), against HF."""
    from transformers import AutoModelForCausalLM

    config = qwen3_size(size, vocab_size=vocab)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "model"
        save_pretrained(materialize(config, seed=0, dtype=dtype), path)
        ours = load_pretrained(path, dtype=dtype, device=device).eval()
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in ours.parameters())
    cpus = {"temper": cpu}
    if rl_job and device.type == "cpu":
        cpus["rl_job"] = rl_job_cpu()
    results = []
    for batch in batches:
        measured = _compare(
            ours=ours,
            hf=hf,
            vocab=vocab,
            batch=batch,
            device=device,
            repeats=repeats,
            cpus=cpus,
            hf_threads=cpu.num_threads if isinstance(cpu.num_threads, int) else None,
        )
        hf_tps = measured["hf"]["tokens_per_s"]
        result = {
            "model": size,
            "vocab": vocab,
            "dtype": str(dtype).removeprefix("torch."),
            "device": device.type,
            "batch": batch,
            "hf_tokens_per_s": round(hf_tps, 1),
        }
        for name, settings in cpus.items():
            ours_tps = measured[name]["tokens_per_s"]
            result.update(
                {
                    f"{name}_threads": measured[name]["threads"],
                    f"{name}_decode_shards": settings.decode_shards,
                    f"{name}_cpu_processes": settings.num_processes(),
                    f"{name}_packed_linear": measured[name]["packed"],
                    f"{name}_tokens_per_s": round(ours_tps, 1),
                    f"{name}_decode_tokens_per_s": round(measured[name]["decode_tokens_per_s"], 1),
                    f"{name}_speedup_vs_hf": round(ours_tps / hf_tps, 2),
                }
            )
        result["speedup_vs_hf"] = result["temper_speedup_vs_hf"]
        if "hf_same_threads" in measured:
            same = measured["hf_same_threads"]["tokens_per_s"]
            result["hf_same_threads_tokens_per_s"] = round(same, 1)
            result["speedup_vs_hf_same_threads"] = round(
                measured["temper"]["tokens_per_s"] / same, 2
            )
        if bandwidth is not None:
            # Every decode step reads all weights once; a step makes `batch` tokens.
            bound = batch * bandwidth / weight_bytes
            decode = measured["temper"]["decode_tokens_per_s"]
            result.update(
                weight_bytes=weight_bytes,
                bandwidth_bound_tokens_per_s=round(bound, 1),
                decode_fraction_of_bound=round(decode / bound, 3),
                linear_kernel_gb_per_s=round(
                    linear_bandwidth(config, batch=batch, dtype=dtype, device=device) / 1e9, 1
                ),
            )
            kernel_rate = result["linear_kernel_gb_per_s"] * 1e9
            if measured["temper"]["packed"]:
                kernel_rate = linear_bandwidth(
                    config, batch=batch, dtype=dtype, device=device, packed=True
                )
                result["packed_linear_kernel_gb_per_s"] = round(kernel_rate / 1e9, 1)
            # The most any engine on this kernel can reach: its weight streaming alone.
            result["kernel_ceiling_fraction_of_bound"] = round(kernel_rate / bandwidth, 3)
        results.append(result)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny model only, fewer repeats")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary of the tiny model")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--tiny-threads",
        type=int,
        default=None,
        help="Temper's CPU threads for the tiny model (default: the engine's default, "
        "the process's threads)",
    )
    parser.add_argument(
        "--decode-shards",
        default=None,
        type=auto_or_int,
        help="SamplerEngine.Config.cpu.decode_shards for the tiny model ('auto' or an int; "
        "default: the engine's default)",
    )
    parser.add_argument(
        "--cpu-processes",
        default=None,
        type=auto_or_int,
        help="SamplerEngine.Config.cpu.processes for the CPU cases ('auto' or an int; default: "
        "the engine's default, 'auto')",
    )
    parser.add_argument(
        "--batches",
        default="1,16,64,128",
        type=lambda text: [int(b) for b in text.split(",")],
        help="batches of the tiny model, comma-separated",
    )
    args = parser.parse_args()
    require_baseline("transformers")
    cpu = torch.device("cpu")
    rl_job = rl_job_cpu()
    report: dict = {
        "bench": "sampler",
        "threads": torch.get_num_threads(),
        "load_average_before": round(os.getloadavg()[0], 2),
        "temper_cpu_config": repr(
            cpu_config(
                num_threads=args.tiny_threads,
                decode_shards=args.decode_shards,
                processes=args.cpu_processes,
            )
        ),
        "rl_job_cpu_config": repr(rl_job),
    }
    cases = run_case(
        size="tiny",
        vocab=args.vocab,
        dtype=torch.float32,
        batches=args.batches,
        device=cpu,
        repeats=args.repeats,
        bandwidth=None,
        cpu=cpu_config(
            num_threads=args.tiny_threads,
            decode_shards=args.decode_shards,
            processes=args.cpu_processes,
        ),
        rl_job=True,
    )
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
            cpu=cpu_config(processes=args.cpu_processes),
            rl_job=True,
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
                cpu=cpu_config(),
                rl_job=False,
            )
    report["load_average_after"] = round(os.getloadavg()[0], 2)
    report["cases"] = cases
    print(json.dumps(report))


if __name__ == "__main__":
    main()
