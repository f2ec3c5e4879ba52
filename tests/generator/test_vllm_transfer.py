"""Weight updates into vLLM through its weight-transfer protocol (vllm_transfer.py), on vLLM's
CPU build: Temper's engine in vLLM's factory runs the four phases in bucket after bucket, the
policy version reads back as vLLM's weight version, vLLM's workers hold bitwise the new
weights (read back out of them) and sample from them (greedy tokens and prompt logprobs
against Temper's engine), in this process (inline transport), in vLLM's own engine process
and over two tensor-parallel workers (ipc transport: buckets in shared memory, the CPU twin of
CUDA IPC; gloo transport: streamed over a gloo group; no file written either way), and a
worker that stalls mid-transfer ends the update at the deadline with an error saying where.
`make test-vllm` runs these."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.tokenizer import build_builtin_tokenizer

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator import vllm_transfer  # noqa: E402
from temper.generator.vllm import VllmGenerator  # noqa: E402

TOLERANCE = 1e-5  # fp32: KV-cache decode vs a full forward differ by ~1e-6 here
PROMPT = [1, 5, 9, 3]
SMALL_BUCKET = 64 * 2**10  # bytes: the tiny model's update takes several buckets


def _model(*, seed: int = 5):
    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        qwen3_size("tiny", vocab_size=tokenizer.vocab_size), init_std=0.1, max_seq_len=64
    )
    return materialize(config, seed=seed, dtype="float32").eval(), tokenizer


def _perturbed(model, *, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: value + 0.05 * torch.randn(value.shape, generator=generator)
        for name, value in model.state_dict().items()
    }


def _worker_state(worker) -> tuple[str, int, bool]:
    engine = worker.weight_transfer_engine
    return type(engine).__name__, engine.buckets, worker._weight_update_active


def _assert_holds(vllm, state: dict[str, torch.Tensor]) -> None:
    """What vLLM's workers hold, read back (CPU-packed layers through their own kernel, tensor-
    parallel shards joined), is bitwise the update."""
    held = vllm.read_weights()
    assert held.keys() == state.keys()
    assert all(torch.equal(held[name], value) for name, value in state.items())


def _assert_samples_from(vllm, model, tokenizer) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0, stop=[])
    request = [SampleRequest(prompt=PROMPT, params=greedy, prompt_logprobs=True)]
    temper = SamplerEngine.Config(max_batch=8, max_seq_len=64).build(
        model=model, tokenizer=tokenizer
    )
    (ours,), (theirs,) = temper.generate(request), vllm.generate(request)
    assert theirs.sequences[0].tokens == ours.sequences[0].tokens
    diffs = [
        abs(a - b)
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:], strict=True)
    ]
    assert max(diffs) < TOLERANCE


def test_the_four_phases_run_bucket_by_bucket_and_the_version_reads_back(monkeypatch):
    monkeypatch.setattr(vllm_transfer, "BUCKET_BYTES", SMALL_BUCKET)
    model, tokenizer = _model()
    vllm = VllmGenerator.Config(kv_cache_mib=32).build(model=model, tokenizer=tokenizer)
    try:
        state = _perturbed(model, seed=1)
        model.load_state_dict(state)
        vllm.update_weights(iter(state.items()), version=7)
        (engine, buckets, active), *_ = vllm._llm.collective_rpc(_worker_state)
        assert engine == "TemperTransferEngine" and not active  # finished
        assert buckets > 1  # 3 MiB of weights in buckets of 64 KiB (a larger tensor alone)
        assert vllm._llm.get_weight_version() == "7" and vllm.version == 7
        _assert_holds(vllm, state)
        _assert_samples_from(vllm, model, tokenizer)
    finally:
        vllm.close()


@pytest.mark.parametrize(
    ("tensor_parallel_size", "transport"),
    [(1, "ipc"), (1, "gloo"), (2, "ipc")],
    ids=["engine_process_ipc", "engine_process_gloo", "tp2_ipc"],
)
def test_vllms_own_processes_take_new_weights_without_a_file(
    monkeypatch, tensor_parallel_size, transport
):
    import safetensors.torch

    def no_file(*args, **kwargs):
        raise AssertionError("a weight update wrote a safetensors file")

    monkeypatch.setattr(vllm_transfer, "BUCKET_BYTES", SMALL_BUCKET)
    model, tokenizer = _model()
    config = VllmGenerator.Config(
        kv_cache_mib=32,
        engine_process="separate",
        tensor_parallel_size=tensor_parallel_size,
        transport="auto" if transport == "ipc" else transport,  # auto: ipc on CPU
    )
    vllm = config.build(model=model, tokenizer=tokenizer)
    monkeypatch.setattr(safetensors.torch, "save_file", no_file)
    try:
        assert vllm.transport == transport
        for version in (1, 2):
            state = _perturbed(model, seed=version)
            model.load_state_dict(state)
            vllm.update_weights(state, version=version)
            assert vllm._llm.get_weight_version() == str(version)
            _assert_holds(vllm, state)
            _assert_samples_from(vllm, model, tokenizer)
    finally:
        vllm.close()


@pytest.mark.parametrize("transport", ["ipc", "gloo"])
def test_a_stalled_worker_ends_the_update_at_the_deadline_saying_where(monkeypatch, transport):
    stall_s, deadline_s = 60, 3.0
    monkeypatch.setattr(vllm_transfer, "BUCKET_BYTES", SMALL_BUCKET)
    monkeypatch.setenv(vllm_transfer.FAULT_ENV, f"3:{stall_s}")  # before receiving bucket 3
    model, tokenizer = _model()
    config = VllmGenerator.Config(
        kv_cache_mib=32, engine_process="separate", sync_timeout_s=deadline_s, transport=transport
    )
    vllm = config.build(model=model, tokenizer=tokenizer)
    try:
        started = time.monotonic()
        message = (
            rf"\({transport} transport\): the vLLM worker rank 1 of the transfer group did not "
            r"finish phase update_weights .*sync_timeout_s=3 s, after 2 bucket"
        )
        with pytest.raises(TimeoutError, match=message):
            vllm.update_weights(_perturbed(model, seed=1), version=1)
        # It did not wait for the stalled worker (a hang guard, not a speed check).
        assert time.monotonic() - started < stall_s
        with pytest.raises(ValueError, match=r"failed part-way.*build a new generator"):
            vllm.score([[1, 2, 3]])
    finally:
        vllm.close()
