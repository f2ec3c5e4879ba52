"""CUDA-graph capture's logic that a CPU can check: captures on several threads run one at a
time, and an engine going to sleep drops its graphs before it frees the KV cache (so the
graphs' memory pool goes back with it)."""

from __future__ import annotations

import threading
import time

from temper.models import materialize, qwen3_size
from temper.sampler import cuda_graphs
from temper.sampler.cuda_graphs import CudaGraphDecoding, StaticDecoder
from temper.sampler.engine import SamplerEngine
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
