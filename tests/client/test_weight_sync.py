"""WeightSync's contract, without the clients around it: a snapshot keeps its version bitwise
after the trainer's weights change, one taken after sees the new weights, a copy is made only
for a snapshot that is still alive, and readers hold the weights against changes."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from temper.client.sampler_weights import resolve_base_model
from temper.client.weight_sync import Snapshot, WeightSync
from temper.models.lora import LoraConfig
from temper.sampler.engine import SamplerEngine
from temper.trainer.engine import TrainerEngine

TOKENS = [1, 2, 3, 4, 5, 6]


def _sync(*, lora: bool) -> tuple[WeightSync, TrainerEngine]:
    base = resolve_base_model("tiny", device="cpu", dtype="float32").build()
    trainer = TrainerEngine.Config().build(
        model=base.model, lora=LoraConfig(rank=4, seed=1) if lora else None
    )
    sync = WeightSync(
        trainer=trainer, new_generator=SamplerEngine.Config().build, tokenizer=base.tokenizer
    )
    return sync, trainer


def _change(sync: WeightSync, trainer: TrainerEngine) -> None:
    """What an optimizer step does to the weights, inside `changing()`."""
    with sync.changing(), torch.no_grad():
        for parameter in trainer.trainable:
            parameter.add_(0.01 * torch.randn_like(parameter))
        trainer.policy_version += 1


def _scores(snapshot: Snapshot) -> torch.Tensor:
    with snapshot.reading() as engine:
        return engine.score([TOKENS])[0]


@pytest.fixture(params=[False, True], ids=["full", "lora"])
def lora(request):
    return request.param


def test_a_snapshot_keeps_its_version_and_a_later_one_sees_the_change(lora):
    torch.manual_seed(0)
    sync, trainer = _sync(lora=lora)
    old = sync.snapshot()
    before = _scores(old)
    _change(sync, trainer)
    new = sync.snapshot()
    assert (old.version, new.version) == (0, 1)
    assert torch.equal(_scores(old), before)  # bitwise: the old weights, kept aside
    assert not torch.equal(_scores(new), before)
    assert old.engine is not new.engine
    assert sync.num_snapshots == 1


def test_snapshots_of_one_version_are_one_object(lora):
    sync, trainer = _sync(lora=lora)
    first = sync.snapshot()
    assert sync.snapshot() is first
    _change(sync, trainer)
    assert sync.snapshot() is not first


def test_no_copy_when_no_snapshot_is_alive(lora):
    torch.manual_seed(0)
    sync, trainer = _sync(lora=lora)
    snapshot = sync.snapshot()
    engine = snapshot.engine
    del snapshot
    gc.collect()
    _change(sync, trainer)
    assert sync.snapshot().engine is engine  # updated in place
    assert sync.num_snapshots == 0
    if not lora:
        assert engine.model is trainer.model  # the trainer's own tensors, no copy


def test_a_reader_holds_the_shared_weights_against_a_change():
    sync, trainer = _sync(lora=False)
    snapshot = sync.snapshot()
    changed = threading.Event()

    def change() -> None:
        _change(sync, trainer)
        changed.set()

    with snapshot.reading() as engine:
        assert engine.model is trainer.model
        thread = threading.Thread(target=change)
        thread.start()
        assert not changed.wait(timeout=0.2)  # waits for the reader
    thread.join()
    assert changed.is_set() and sync.num_snapshots == 1
    with snapshot.reading() as engine:  # now on its own copy: no lock, the old version
        assert engine.model is not trainer.model and engine.version == 0


def test_a_snapshot_of_its_own_engine_never_touches_a_sync():
    sync, _ = _sync(lora=False)
    engine = sync.snapshot().engine
    own = Snapshot(engine=engine, version=7)
    with sync.holding(), own.reading() as reading:  # would deadlock if it took the lock
        assert reading is engine and own.version == 7
