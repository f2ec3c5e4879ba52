"""SnapshotRetention's rules on a fake clock: the least recently sampled snapshot goes first
when the copies would exceed the budget, a model's newest is never evicted for memory, and an
idle one expires; each gone id remembers why. And what one sampler copy is counted at."""

from __future__ import annotations

import dataclasses

import torch

from temper.job.model_bytes import ModelShapes, SamplerBytes
from temper.models import materialize, qwen3_size
from temper.sampler.engine import SamplerEngine
from temper.server.state.snapshots import MIB, SnapshotRetention


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def take(retention: SnapshotRetention, snapshot_id: str, *, model_id: str = "m") -> list[str]:
    evicted = retention.make_room(model_id)
    retention.add(snapshot_id, model_id=model_id)
    return evicted


def test_the_least_recently_sampled_goes_first_and_the_newest_stays():
    clock = Clock()
    retention = SnapshotRetention(copy_bytes=MIB, budget_bytes=MIB, idle_seconds=100.0, clock=clock)
    assert take(retention, "reference") == []
    clock.now = 1
    assert take(retention, "eval-1") == []  # the reference now holds the one copy
    for step in range(2, 6):  # DPO: the reference is sampled every step
        clock.now = step
        assert retention.use("reference") is None
    assert take(retention, "eval-2") == ["eval-1"]  # eval-1 was sampled longest ago
    assert "snapshot memory budget" in retention.use("eval-1")
    assert retention.use("reference") is None and retention.use("eval-2") is None


def test_a_zero_budget_keeps_only_each_models_newest():
    retention = SnapshotRetention(copy_bytes=MIB, budget_bytes=0, idle_seconds=100.0)
    take(retention, "a1", model_id="a")
    take(retention, "b1", model_id="b")
    assert take(retention, "a2", model_id="a") == ["a1"]
    assert retention.use("b1") is None and retention.use("a2") is None


def test_an_idle_snapshot_expires_and_a_used_one_does_not():
    clock = Clock()
    retention = SnapshotRetention(
        copy_bytes=MIB, budget_bytes=10 * MIB, idle_seconds=10.0, clock=clock
    )
    take(retention, "idle")
    take(retention, "busy")
    for clock.now in (5.0, 10.0, 15.0):
        assert retention.use("busy") is None
    assert retention.evict_idle() == ["idle"]
    assert "expired after 10 s without a sample" in retention.use("idle")
    assert retention.use("not-a-snapshot") is None  # base model and checkpoint sessions


def test_a_sampler_copy_counts_its_weights_kv_cache_and_prefix_cache_budget():
    decoder = qwen3_size("tiny", vocab_size=29)
    without = SamplerEngine.Config(max_batch=4, max_seq_len=64, prefix_cache_mib=0)
    meta = materialize(decoder, device="meta", init="empty")
    weights = sum(p.numel() for p in meta.parameters()) * 4  # fp32
    kv_bytes = without.kv_cache_bytes(decoder, dtype=torch.float32)
    shapes = ModelShapes.of(decoder, lora_rank=None)

    def sampler_copy_bytes(sampler: SamplerEngine.Config) -> int:
        return SamplerBytes.of_engine(decoder, shapes, engine=sampler, dtype="float32").total

    assert sampler_copy_bytes(without) == weights + kv_bytes
    with_prefixes = dataclasses.replace(without, prefix_cache_mib=8)
    assert sampler_copy_bytes(with_prefixes) == weights + kv_bytes + 8 * MIB
