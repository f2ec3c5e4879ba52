"""The first-run checks for a GPU machine, one JSON line each: `make gpu-check`.

Each check runs in a process of its own with a deadline (a hang or a sticky CUDA error in one
does not stop the others) and prints one line: `{"check": NAME, "ok": true|false, ...}` with
its measurements, or the first line of its error. The checks, in order (about 6-8 minutes on
one H100/H200):

- environment: GPUs, driver, torch / CUDA / NCCL / vLLM versions (a CPU torch fails here).
- gpu_tests: the `gpu`-marked tests (`pytest -m gpu`; the CPU suite hides the GPU).
- sdpa_kernels: which SDPA kernels take decode attention's arguments (bf16, grouped heads).
- decode: Temper's engine at the 0.6B shape in bf16, batch 1 / 64 / 256, CUDA graphs on and
  off: tokens/s, ms a step, build time, peak reserved memory.
- train_step: a bf16 train step at the 0.6B shape (8 x 2048 tokens, AdamW): seconds, TFLOP/s,
  MFU against the card's dense bf16 peak.
- moe_block: the MoE block's forward + backward in bf16 (`F.grouped_mm`) against transformers'
  Qwen3-MoE block (bench/moe_block.py), at the bench's default config and at one layer of
  Qwen3-30B-A3B (D=2048, 128 experts, top-8, F=768, 8192 tokens).
- gated_deltanet: one Gated DeltaNet layer's forward + backward in bf16 (bench/gated_deltanet.py)
  against transformers' Qwen3_5GatedDeltaNet, Temper's pure path and, when
  flash-linear-attention is installed, its fla speed wing.
- rl_smoke: `temper train arithmetic_smoke` on CUDA in bf16, one rank; the last metrics line.
- vllm: vLLM at the decode check's shape and batches (compiled, CUDA graphs): tokens/s, a
  weight update, and how much `sleep()` gives back; then a weight update into vLLM's own
  engine process on the same GPU (engine_process='separate': the ipc transport, CUDA IPC);
  on CPU (dry run) vLLM's CPU build, eager (the ipc transport over shared memory).
- vllm_lora: LoRA adapters inside vLLM at that shape: the time to register a new adapter
  version (rank 32, every target), and one adapter's rows against the same rows over 16.
- weight_sync: NCCL weight transfer between two GPUs (bench/weight_sync.py), where two exist.
- summary (last line): Temper's decode against vLLM's at each batch, tokens/s ratio.

`--dry-run` runs the same checks on CPU at tiny shapes (the CPU test suite runs it, so the
script does not rot): it proves the code paths, not the GPU. `--only NAME` runs one check.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Shapes:
    """Sizes of one mode: the real first run, or the dry run's tiny twin on CPU."""

    device: str
    model: str
    dtype: str
    batches: tuple[int, ...]
    seq: int
    new_tokens: int
    graphs: tuple[str, ...]
    timeout_s: int


REAL = Shapes(
    device="cuda",
    model="0.6B",
    dtype="bfloat16",
    batches=(1, 64, 256),
    seq=1024,
    new_tokens=64,
    graphs=("auto", "off"),
    timeout_s=240,
)
DRY = Shapes(
    device="cpu",
    model="tiny",
    dtype="float32",
    batches=(1, 4),
    seq=64,
    new_tokens=4,
    graphs=("off",),
    timeout_s=120,
)


def environment(shapes: Shapes) -> dict:
    import torch

    found: dict = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import vllm

        found["vllm"] = vllm.__version__
    except ImportError:
        found["vllm"] = None
    if shapes.device == "cpu":
        return found
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    found["gpus"] = listing.stdout.strip().splitlines()
    found["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
    if torch.version.cuda is None or not torch.cuda.is_available():
        raise RuntimeError(
            f"torch {torch.__version__} is a CPU build or sees no GPU: `make clean-venv && "
            "make gpu-check` installs the CUDA build"
        )
    found["device_name"] = torch.cuda.get_device_name()
    return found


def gpu_tests(shapes: Shapes) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    if shapes.device == "cpu":
        command.append("--collect-only")
    result = subprocess.run(
        [*command, "tests"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    last = (result.stdout.strip().splitlines() or [""])[-1]
    # Exit 5 is "no tests ran": with --collect-only, what a dry run expects.
    if result.returncode not in (0, 5) or "failed" in last or "error" in last:
        raise RuntimeError(f"pytest -m gpu: {last or result.stderr.strip()[-300:]}")
    return {"summary": last}


def sdpa_kernels(shapes: Shapes) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from temper.models.common.attention import masked_attention

    device = torch.device(shapes.device)
    dtype = getattr(torch, shapes.dtype)
    width = 128 if shapes.device == "cuda" else 16
    q = torch.randn(8, 16, 1, width, device=device, dtype=dtype)
    kv = torch.randn(8, 8, shapes.seq, width, device=device, dtype=dtype)
    visible = torch.ones(8, 1, 1, shapes.seq, device=device, dtype=torch.bool)
    runs, refused = [], {}
    for backend in (
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    ):
        try:
            with sdpa_kernel([backend]):
                masked_attention(q, kv, kv, visible_B1TC=visible)
            runs.append(backend.name)
        except RuntimeError as error:
            refused[backend.name] = str(error).splitlines()[0]
    return {"runs": runs, "refused": refused}


def decode(shapes: Shapes) -> dict:
    import torch

    from temper.models import materialize, qwen3_size
    from temper.sampler.engine import SamplerEngine

    model = materialize(qwen3_size(shapes.model), device=shapes.device, dtype=shapes.dtype, seed=0)
    on_gpu = shapes.device == "cuda"
    rows = []
    for graphs in shapes.graphs:
        for batch in shapes.batches:
            start = time.perf_counter()
            engine = SamplerEngine.Config(
                max_batch=batch, max_seq_len=shapes.seq, cuda_graphs=graphs, prefix_cache_mib=0
            ).build(model=model)
            _sync(on_gpu)
            build_s = time.perf_counter() - start
            requests = _decode_requests(shapes, batch=batch)
            engine.generate(requests)
            _sync(on_gpu)
            start = time.perf_counter()
            engine.generate(requests)
            _sync(on_gpu)
            seconds = time.perf_counter() - start
            row = {
                "graphs": graphs,
                "batch": batch,
                "build_s": round(build_s, 2),
                "tokens_per_s": round(batch * shapes.new_tokens / seconds),
                "ms_per_step": round(1e3 * seconds / shapes.new_tokens, 2),
            }
            if on_gpu:
                row["reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
            rows.append(row)
            engine.close()
            del engine
            if on_gpu:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    return {"model": shapes.model, "dtype": shapes.dtype, "seq": shapes.seq, "rows": rows}


def train_step(shapes: Shapes) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import train_step as bench

    if shapes.device == "cpu":
        return bench.compare(size="tiny", vocab=64, batch=2, seq=16, repeats=1)
    return bench.cuda_mfu(repeats=5)


def moe_block(shapes: Shapes) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import moe_block as bench

    if shapes.device == "cpu":
        return bench.run(
            dim=32, experts=4, ffn_dim=16, tokens=64, ffn_dims=(), fine_grained=(8, 4), repeats=1
        )
    default = bench.run(device="cuda", dtype="bfloat16", repeats=10)
    published = bench.run(
        device="cuda",
        dtype="bfloat16",
        dim=2048,
        experts=128,
        top_k=8,
        ffn_dim=768,
        tokens=8192,
        ffn_dims=(),
        fine_grained=None,
        repeats=10,
    )
    return {"default": default, "qwen3_30b_a3b_layer": published}


def gated_deltanet(shapes: Shapes) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import gated_deltanet as bench

    if shapes.device == "cpu":
        return bench.run(tokens=64, repeats=1)
    return bench.run(device="cuda", dtype="bfloat16", tokens=8192, repeats=10)


def rl_smoke(shapes: Shapes) -> dict:
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"temper-gpu-check-{os.getpid()}"
    command = [sys.executable, "-m", "temper", "train", "arithmetic_smoke", "--nproc", "1"]
    # --model.dtype 'auto': the device's default precision (bf16-mixed on CUDA, float32 on CPU).
    command += ["--model.device", shapes.device]
    command += ["--run-dir", str(run_dir), "--metrics.display", "none"]
    if shapes.device == "cpu":
        command += ["--warmup.steps", "2", "--rl.steps", "1"]
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"temper train exited {result.returncode}: {result.stderr[-400:]}")
        lines = (run_dir / "metrics.jsonl").read_text().strip().splitlines()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {"last_metrics": json.loads(lines[-1])}


def vllm(shapes: Shapes) -> dict:
    """vLLM at the decode check's shape and batches (compiled with CUDA graphs on a GPU, eager
    on CPU), then a weight update and, on a GPU, what `sleep()` gives back; then a weight
    update into vLLM's own engine process on the same device (the ipc transport)."""
    try:
        import vllm as _  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed (make vllm)"}
    import torch

    from temper.generator.vllm import VllmGenerator
    from temper.models import materialize, qwen3_size

    on_gpu = shapes.device == "cuda"
    model = materialize(qwen3_size(shapes.model), device=shapes.device, dtype=shapes.dtype, seed=0)
    start = time.perf_counter()
    generator = VllmGenerator.Config(
        max_model_len=shapes.seq,
        max_num_seqs=max(shapes.batches),
        sleep="keep_weights" if on_gpu else "off",
        execution="compiled" if on_gpu else "eager",
    ).build(model=model)
    found: dict = {"build_s": round(time.perf_counter() - start, 2), "rows": []}
    for batch in shapes.batches:
        requests = _decode_requests(shapes, batch=batch)
        generator.generate(requests)
        start = time.perf_counter()
        generator.generate(requests)
        seconds = time.perf_counter() - start
        found["rows"].append(
            {
                "batch": batch,
                "tokens_per_s": round(batch * shapes.new_tokens / seconds),
                "ms_per_step": round(1e3 * seconds / shapes.new_tokens, 2),
            }
        )
    start = time.perf_counter()
    generator.update_weights(model.state_dict(), version=1)
    found["update_weights_s"] = round(time.perf_counter() - start, 3)
    if on_gpu:
        free = torch.cuda.mem_get_info()[0]
        generator.sleep()
        found["sleep_freed_gib"] = round((torch.cuda.mem_get_info()[0] - free) / 2**30, 2)
        generator.wake_up()
    generator.close()
    return found | _separate_update(model, shapes)


def _separate_update(model, shapes: Shapes) -> dict:
    """A weight update into vLLM's own engine process on this device (engine_process=
    'separate': the ipc transport, CUDA IPC on a GPU, shared memory on CPU), timed after one
    warm-up update, beside the in-process one above."""
    from temper.generator.vllm import VllmGenerator

    generator = VllmGenerator.Config(
        max_model_len=shapes.seq, max_num_seqs=8, engine_process="separate"
    ).build(model=model)
    try:
        state = model.state_dict()
        generator.update_weights(state, version=1)
        start = time.perf_counter()
        generator.update_weights(state, version=2)
        seconds = time.perf_counter() - start
    finally:
        generator.close()
    return {
        "separate_transport": generator.transport,
        "separate_update_weights_s": round(seconds, 3),
    }


def vllm_lora(shapes: Shapes) -> dict:
    """LoRA adapters inside vLLM (generator/vllm_lora.py) at the decode check's shape: the time
    to register one new adapter version (rank 32, every target: what an RL LoRA step sends),
    and tokens/s of the largest batch as one adapter's rows against the same rows spread over
    several adapters."""
    try:
        import vllm as _  # noqa: F401
    except ImportError:
        return {"skipped": "vLLM is not installed (make vllm)"}
    import torch

    from temper.generator.multi_lora import MultiLoraSampler
    from temper.generator.vllm import VllmGenerator
    from temper.generator.vllm_lora import VllmMultiLora
    from temper.models import materialize, qwen3_size
    from temper.models.lora import LoraConfig

    on_gpu = shapes.device == "cuda"
    users, batch = (16, max(shapes.batches)) if on_gpu else (4, max(shapes.batches))
    size = qwen3_size(shapes.model)
    model = materialize(size, device=shapes.device, dtype=shapes.dtype, seed=0)
    lora = LoraConfig(rank=32)
    tensors = _random_adapter(size, lora=lora, dtype=getattr(torch, shapes.dtype))
    sampler = VllmMultiLora(
        MultiLoraSampler.Config(max_adapters=users + 1, max_resident_adapters=users),
        model=model,
        tokenizer=None,
        vllm=VllmGenerator.Config(
            max_model_len=shapes.seq,
            max_num_seqs=batch,
            execution="compiled" if on_gpu else "eager",
        ),
    )
    adapters, seconds = [], []
    for who in range(users):
        update = tensors()
        start = time.perf_counter()
        adapters.append(sampler.register(config=lora, tensors=update, version=who))
        seconds.append(time.perf_counter() - start)
    adapter_mib = sum(t.numel() * t.element_size() for t in update.values()) / 2**20
    found: dict = {
        "users": users,
        "batch": batch,
        "adapter_mib": round(adapter_mib, 1),
        "adapter_update_s": round(sorted(seconds)[len(seconds) // 2], 3),
    }
    requests = _decode_requests(shapes, batch=batch)
    share = batch // users

    def one_adapter() -> None:
        sampler.generate(requests, adapter=adapters[0])

    def mixed() -> None:
        threads = [
            threading.Thread(
                target=sampler.generate,
                args=(requests[who * share : (who + 1) * share],),
                kwargs={"adapter": adapters[who]},
            )
            for who in range(users)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    for name, run in (("one_adapter", one_adapter), ("mixed", mixed)):
        run()
        start = time.perf_counter()
        run()
        tokens = (batch if name == "one_adapter" else share * users) * shapes.new_tokens
        found[f"{name}_tokens_per_s"] = round(tokens / (time.perf_counter() - start))
    found["mixed_vs_one_adapter"] = round(
        found["mixed_tokens_per_s"] / found["one_adapter_tokens_per_s"], 3
    )
    sampler.close()
    return found


def _random_adapter(size, *, lora, dtype) -> Callable[[], dict]:
    """Draws of random adapter tensors of `lora` on a model of `size` (shapes from a meta
    model, nothing built), one set per call."""
    import torch

    from temper.models.lora import apply_lora, lora_state_dict

    with torch.device("meta"):
        skeleton = size.build()
    apply_lora(skeleton, lora)
    shapes_of = {name: t.shape for name, t in lora_state_dict(skeleton).items()}
    draws = torch.Generator().manual_seed(0)

    def tensors() -> dict:
        return {
            name: (torch.randn(shape, generator=draws) * 0.02).to(dtype)
            for name, shape in shapes_of.items()
        }

    return tensors


def _decode_requests(shapes: Shapes, *, batch: int) -> list:
    """The decode checks' workload: `batch` 16-token prompts, `new_tokens` each, no stops."""
    from temper.api import SamplingParams
    from temper.sampler.engine import SampleRequest

    return [
        SampleRequest(
            prompt=[(7 * row + j) % 100 for j in range(16)],
            params=SamplingParams(max_tokens=shapes.new_tokens, stop=[], seed=row),
        )
        for row in range(batch)
    ]


def summary(results: list[dict]) -> dict:
    """Temper's decode (its first decoding setting: CUDA graphs on a GPU) against vLLM's at each
    batch: the ratio of tokens/s (1.0: as fast as vLLM)."""
    by_name = {result["check"]: result for result in results}
    temper, vllm_found = by_name.get("decode", {}), by_name.get("vllm", {})
    if not temper.get("ok") or "rows" not in vllm_found:
        return {"check": "summary", "ok": True, "skipped": "needs the decode and vllm checks"}
    first = temper["rows"][0]["graphs"]
    ours = {row["batch"]: row["tokens_per_s"] for row in temper["rows"] if row["graphs"] == first}
    theirs = {row["batch"]: row["tokens_per_s"] for row in vllm_found["rows"]}
    ratios = {
        str(batch): round(ours[batch] / theirs[batch], 3)
        for batch in sorted(ours.keys() & theirs.keys())
    }
    return {"check": "summary", "ok": True, "temper_graphs": first, "temper_vs_vllm": ratios}


def weight_sync(shapes: Shapes) -> dict:
    import torch

    if shapes.device == "cpu" or torch.cuda.device_count() < 2:
        return {"skipped": "NCCL weight transfer needs two GPUs"}
    command = [sys.executable, "bench/weight_sync.py", "--device", "cuda", "--shapes", "0.6B"]
    command += ["--trainer-ranks", "1", "--dtype", "bfloat16", "--repeats", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"bench/weight_sync.py exited {result.returncode}: {result.stderr[-400:]}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _sync(on_gpu: bool) -> None:
    if on_gpu:
        import torch

        torch.cuda.synchronize()


CHECKS: dict[str, Callable[[Shapes], dict]] = {
    "environment": environment,
    "gpu_tests": gpu_tests,
    "sdpa_kernels": sdpa_kernels,
    "decode": decode,
    "train_step": train_step,
    "moe_block": moe_block,
    "gated_deltanet": gated_deltanet,
    "rl_smoke": rl_smoke,
    "vllm": vllm,
    "vllm_lora": vllm_lora,
    "weight_sync": weight_sync,
}


def run_one(name: str, shapes: Shapes) -> dict:
    """One check in this process: its JSON line's fields."""
    start = time.perf_counter()
    try:
        found = {"ok": True, **CHECKS[name](shapes)}
    except Exception as error:  # a check's failure is its result, not the script's
        found = {"ok": False, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    return {"check": name, **found, "seconds": round(time.perf_counter() - start, 1)}


def run_isolated(name: str, *, dry_run: bool, timeout_s: int) -> dict:
    """One check in a child process with a deadline; its JSON line."""
    command = [sys.executable, str(Path(__file__)), "--only", name]
    if dry_run:
        command.append("--dry-run")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    try:
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired:
        return {"check": name, "ok": False, "error": f"no result within {timeout_s} s"}
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"check": name, "ok": False, "error": f"exit {result.returncode}: {tail}"}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU")
    parser.add_argument("--only", choices=sorted(CHECKS), help="run one check, in-process")
    args = parser.parse_args()
    shapes = DRY if args.dry_run else REAL
    if args.only is not None:
        print(json.dumps(run_one(args.only, shapes)), flush=True)
        return 0
    results = []
    for name in CHECKS:
        results.append(run_isolated(name, dry_run=args.dry_run, timeout_s=shapes.timeout_s))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps(summary(results)), flush=True)
    return 0 if all(result["ok"] for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
