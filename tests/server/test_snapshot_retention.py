"""SnapshotRetention's rules on a fake clock: the least recently sampled snapshot goes first
when the copies would exceed the budget, a model's newest is never evicted for memory, and an
idle one expires; each gone id remembers why."""

from __future__ import annotations

from temper.server.snapshots import MIB, SnapshotRetention


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
