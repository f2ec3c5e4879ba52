"""CUDA-graph capture's logic that a CPU can check: captures on several threads run one at a
time, an engine going to sleep drops its graphs before it frees the KV cache (so the graphs'
memory pool goes back with it), and a MoE model, whose routing syncs with the host, is never
captured (on a GPU: capturing its forward fails, and it decodes eagerly)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_moe_size, qwen3_size
from temper.sampler import cuda_graphs
from temper.sampler import engine as engine_module
from temper.sampler.cuda_graphs import CudaGraphDecoding, StaticDecoder, capture_blocker
from temper.sampler.decoding import Decoding
from temper.sampler.engine import SamplerEngine, SampleRequest
from temper.sampler.oracle import greedy_decode
from tests.sampler.test_engine import ONE_PROCESS


def _engine() -> SamplerEngine:
    model = materialize(qwen3_size("tiny", vocab_size=32), seed=0)
    return SamplerEngine.Config(max_batch=4, max_seq_len=16, cpu=ONE_PROCESS).build(model=model)


def test_captures_on_several_threads_run_one_at_a_time(monkeypatch):
    engine = _engine()
    running, most = [0], [0]

    def capture(self) -> None:  # stands in for the CUDA capture
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.05)
        running[0] -= 1

    monkeypatch.setattr(StaticDecoder, "_capture_buckets", capture)
    threads = [
        threading.Thread(
            target=StaticDecoder,
            kwargs={"model": engine.weights.model, "cache": engine.cache, "buckets": [1, 2]}
            | {"capture": True},
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most[0] == 1
    assert not cuda_graphs.CAPTURE_LOCK.locked()


def test_sleep_drops_the_graphs_before_the_cache(monkeypatch):
    engine = _engine()
    engine.decoding = CudaGraphDecoding(
        engine.weights, cache=engine.cache, buckets=[1, 4], capture=False
    )
    order = []
    original_release = engine.cache.release

    def release() -> None:
        order.append(("cache", engine.decoding.static is None))
        original_release()

    monkeypatch.setattr(engine.cache, "release", release)
    engine.sleep()
    assert order == [("cache", True)]  # the graphs were already gone
    engine.wake_up()
    assert engine.decoding.static is not None


def _moe(**fields):
    config = dataclasses.replace(qwen3_moe_size("tiny", vocab_size=32), init_std=0.1, **fields)
    return materialize(config, seed=0)


def test_a_moe_model_is_named_as_not_capturable():
    assert capture_blocker(materialize(qwen3_size("tiny", vocab_size=32), seed=0)) is None
    # Layer 0 dense: the first MoE block is named.
    reason = capture_blocker(_moe(mlp_only_layers=(0,)))
    assert reason.startswith("blocks.1.feed_forward is a MoE block")
    assert "host" in reason


def test_on_cuda_a_moe_model_decodes_eagerly_and_a_dense_one_on_graphs(monkeypatch):
    """The engine's choice, with its device said to be CUDA (the capture itself replaced)."""
    monkeypatch.setattr(StaticDecoder, "_capture_buckets", lambda self: None)
    dense = _engine()
    moe = SamplerEngine.Config(max_batch=4, max_seq_len=16, cpu=ONE_PROCESS).build(model=_moe())
    for engine in (dense, moe):
        engine.device = torch.device("cuda")
    assert isinstance(dense._pick_decoding(dense.model), CudaGraphDecoding)
    assert type(moe._pick_decoding(moe.model)) is Decoding
    monkeypatch.setattr(engine_module, "capture_blocker", lambda model: None)
    assert isinstance(moe._pick_decoding(moe.model), CudaGraphDecoding)  # what it guards


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_decodes_a_moe_model_eagerly_since_capturing_it_fails(dtype):
    model = _moe().to(device="cuda", dtype=dtype).eval()
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=32, cpu=ONE_PROCESS).build(model=model)
    assert type(engine.decoding) is Decoding
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0)
    responses = engine.generate([SampleRequest(prompt=p, params=params) for p in prompts])
    if dtype == torch.float32:  # bf16 rounds a cached decode and a full forward apart
        for prompt, response in zip(prompts, responses, strict=True):
            expected = greedy_decode(model, [prompt], max_new_tokens=8)[0]
            assert response.sequences[0].tokens == expected
    # Why: the MoE block reads device values on the host, which a capture refuses (last, as
    # a failed capture is the end of this test's use of the stream).
    moe = model.blocks[0].feed_forward
    x_BTD = torch.randn(4, 1, model.config.dim, device="cuda", dtype=dtype)
    with torch.no_grad():
        moe(x_BTD)  # warm-up outside the capture
        graph = torch.cuda.CUDAGraph()
        capture = torch.cuda.graph(graph, capture_error_mode="thread_local")
        with pytest.raises(RuntimeError), capture:
            moe(x_BTD)
