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
    assert old.generator is not new.generator
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
    engine = snapshot.generator
    del snapshot
    gc.collect()
    _change(sync, trainer)
    assert sync.snapshot().generator is engine  # updated in place
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
    engine = sync.snapshot().generator
    own = Snapshot(generator=engine, version=7)
    with sync.holding(), own.reading() as reading:  # would deadlock if it took the lock
        assert reading is engine and own.version == 7


class _OneVersionEngine:
    """Temper's engine standing in for a generator that holds one version (as vLLM does):
    its own copy of the weights, updated in place."""

    holds_one_version = True

    def __init__(self, *, model, tokenizer) -> None:
        self.engine = SamplerEngine.Config().build(model=model, tokenizer=tokenizer)
        self.model = None

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _one_version_sync(*, lora: bool) -> tuple[WeightSync, TrainerEngine]:
    base = resolve_base_model("tiny", device="cpu", dtype="float32").build()
    trainer = TrainerEngine.Config().build(
        model=base.model, lora=LoraConfig(rank=4, seed=1) if lora else None
    )
    sync = WeightSync(trainer=trainer, new_generator=_OneVersionEngine, tokenizer=base.tokenizer)
    return sync, trainer


def test_a_one_version_generator_is_updated_in_place_and_the_old_snapshot_retired(lora):
    torch.manual_seed(0)
    sync, trainer = _one_version_sync(lora=lora)
    old = sync.snapshot()
    before = _scores(old)
    _change(sync, trainer)
    new = sync.snapshot()
    assert new.generator is old.generator and not torch.equal(_scores(new), before)
    assert sync.num_snapshots == 0  # nothing copied
    with pytest.raises(ValueError, match="policy version 0, which its generator no longer"):
        _scores(old)
    with pytest.raises(ValueError, match="take a new sampling client"):
        old.submitted(object())


def test_requests_submitted_on_a_one_version_snapshot_run_before_it_is_retired():
    sync, trainer = _one_version_sync(lora=False)
    old = sync.snapshot()
    request = object()
    old.submitted(request)  # submitted, not yet run (queued on a sampling worker)
    _change(sync, trainer)
    taken = []
    thread = threading.Thread(target=lambda: taken.append(sync.snapshot()))
    thread.start()
    thread.join(timeout=0.3)
    assert thread.is_alive()  # the new snapshot waits for the pending request
    with old.reading(requests=[request]) as engine:
        assert engine.version == 0  # still the old weights
    thread.join(timeout=5)
    assert taken and taken[0].version == 1
    with pytest.raises(ValueError, match="no longer holds"):
        _scores(old)


def test_a_request_is_submitted_at_once_while_another_read_runs():
    """The server submits samples from its event loop while a batch decodes: counting one
    must not wait for that read (which holds the weights against changes)."""
    sync, _ = _sync(lora=False)
    snapshot = sync.snapshot()
    request = object()
    with snapshot.reading():
        thread = threading.Thread(target=snapshot.submitted, args=(request,))
        thread.start()
        thread.join(timeout=5)
        assert not thread.is_alive()
    assert snapshot.pending == {id(request)}
    with snapshot.reading(requests=[request]):
        pass
    assert not snapshot.pending
