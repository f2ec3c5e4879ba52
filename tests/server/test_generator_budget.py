"""Rank 0's placement of samplers on the generator ranks of a disaggregated server by each
rank's model memory budget (server/generators/budget.py, pool.py), in process: the generator
ranks are links that answer at once (or hold their samples until told), so what is asserted
is where each sampler goes, what is released there and the 503 when it fits no rank."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
import torch

from temper.server.generators.budget import LoadSizes, RankMemory
from temper.server.generators.messages import (
    Drop,
    LoadAdapter,
    LoadBase,
    LoadCheckpoint,
    LoadInflight,
    Reply,
    Request,
    Sample,
)
from temper.server.generators.pool import GeneratorPool, Remote
from temper.server.state.model_memory import MIB, OverBudget
from tests.server.test_multimodel import write_model

BUDGET_MB = 5.0
"""Holds the student's sampler (4.5 MiB) or the teacher's and the grader's (1.4 + 1.3)."""


class Link:
    """A generator rank that answers every request at once, its samples once `release`d."""

    def __init__(self) -> None:
        self.ops: list[object] = []
        self.release = threading.Event()
        self.release.set()
        self._replies: queue.Queue[Reply | None] = queue.Queue()

    def send(self, request: Request) -> None:
        self.ops.append(request.op)
        if isinstance(request.op, Sample):
            threading.Thread(target=self._later, args=(request.call_id,), daemon=True).start()
        else:
            self._replies.put(Reply(request.call_id))

    def _later(self, call_id: int) -> None:
        self.release.wait()
        self._replies.put(Reply(call_id))

    def receive(self) -> Reply:
        reply = self._replies.get()
        if reply is None:
            raise EOFError
        return reply

    def close(self) -> None:
        self._replies.put(None)


@pytest.fixture(scope="module")
def sizes(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LoadSizes:
    from temper.sampler.engine import SamplerEngine
    from temper.server.state.base_models import BaseModels, load_base_model

    root = tmp_path_factory.mktemp("models")
    teacher = write_model(root / "teacher-digits", dim=64, num_layers=2, ffn_dim=128, seed=1)
    grader = write_model(root / "grader-digits", dim=96, num_layers=1, ffn_dim=96, seed=2)
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=64, prefix_cache_mib=1)
    return LoadSizes(
        BaseModels(
            [
                load_base_model(str(path), trainable=True, sampler=engine, dtype="float32")
                for path in (model_dir, teacher, grader)
            ]
        )
    )


def _pool(
    sizes: LoadSizes, *, budget_mb: float = BUDGET_MB, idle_seconds: float = 600.0
) -> GeneratorPool:
    remotes = [
        Remote(
            index=index,
            rank=index + 1,
            pid=0,
            link=Link(),
            memory=RankMemory(
                rank=index + 1,
                budget_bytes=int(budget_mb * MIB),
                idle_seconds=idle_seconds,
                sizes=sizes,
            ),
        )
        for index in range(2)
    ]
    return GeneratorPool(remotes, call_timeout_s=60.0)


def _base(sizes: LoadSizes, name: str) -> LoadBase:
    model = sizes.base_models.resolve(name)
    return LoadBase(key=f"base:{name}", base_model=model.name)


def _checkpoint(number: int) -> LoadCheckpoint:
    """A sampler checkpoint of the student (never read: the links answer at once)."""
    path = f"tinker://run/sampler_weights/{number}"
    return LoadCheckpoint(key=f"checkpoint:{number}", model_path=path, base_model="tiny-digits")


def _wait_for(condition, *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _holders(pool: GeneratorPool) -> list[set[str]]:
    return [set(remote.held) for remote in pool.remotes]


def test_samplers_go_to_a_rank_with_room_and_release_idle_ones_there(sizes):
    pool = _pool(sizes)
    try:
        student, teacher, grader = (
            _base(sizes, name) for name in ("tiny-digits", "teacher-digits", "grader-digits")
        )
        for load in (student, teacher, grader):
            pool.place(load)
        # Rank 1 is full with the student's sampler: the others go where there is room.
        assert _holders(pool) == [{student.key}, {teacher.key, grader.key}]
        # A sampler checkpoint of the student fits nowhere as things are: the least loaded
        # rank releases what it must (the student's base sampler, not in use).
        checkpoint = LoadCheckpoint(
            key="checkpoint:1",
            model_path="tinker://run/sampler_weights/1",
            base_model="tiny-digits",
        )
        pool.place(checkpoint)
        assert _holders(pool) == [{checkpoint.key}, {teacher.key, grader.key}]
        assert Drop(student.key) in pool.remotes[0].link.ops
        # Its sessions stay valid: the next call loads it again where there is room.
        pool.call(student, Sample(student.key, prompt=None)).result(timeout=10)
        assert student.key in set().union(*_holders(pool))
    finally:
        pool.close()


def test_a_sampler_in_use_is_never_released_and_what_fits_no_rank_is_the_503(sizes):
    pool = _pool(sizes)
    try:
        student, teacher = _base(sizes, "tiny-digits"), _base(sizes, "teacher-digits")
        pool.place(student)
        pool.place(teacher)
        for remote in pool.remotes:
            remote.link.release.clear()  # samples wait until released
        running = [
            pool.call(load, Sample(load.key, prompt=None), sequences=1)
            for load in (student, teacher)
        ]
        _wait_for(lambda: all(remote.busy for remote in pool.remotes))
        grader = _base(sizes, "grader-digits")
        pool.place(grader)  # fits beside the teacher as things are
        checkpoint = LoadCheckpoint(
            key="checkpoint:2",
            model_path="tinker://run/sampler_weights/2",
            base_model="tiny-digits",
        )
        with pytest.raises(OverBudget) as refused:
            pool.place(checkpoint)
        message = str(refused.value)
        assert "model memory budget of generator rank 1 (--model-memory-mb 5)" in message
        assert "sampler of the base model on" in message  # what holds rank 1
        assert "nor does generator rank(s) [2] have room" in message
        for remote in pool.remotes:
            remote.link.release.set()
        for future in running:
            future.result(timeout=10)
        pool.place(checkpoint)  # idle now: the student's sampler makes room
        assert checkpoint.key in pool.remotes[0].held
    finally:
        pool.close()


def test_a_sampler_larger_than_a_ranks_whole_budget_names_the_setting(sizes):
    pool = _pool(sizes, budget_mb=1.0)
    try:
        with pytest.raises(OverBudget) as refused:
            pool.place(_base(sizes, "tiny-digits"))
        assert "more than the whole model memory budget of generator rank 1" in str(refused.value)
        assert "(--model-memory-mb 1); raise --model-memory-mb" in str(refused.value)
        assert _holders(pool) == [set(), set()]
    finally:
        pool.close()


def test_lora_snapshots_share_their_bases_multi_lora_sampler_on_a_rank(sizes):
    from temper.models.lora import LoraConfig

    memory = RankMemory(rank=1, budget_bytes=int(BUDGET_MB * MIB), idle_seconds=600.0, sizes=sizes)
    teacher = sizes.base_models.resolve("teacher-digits")

    def adapter(version: int) -> LoadAdapter:
        return LoadAdapter(
            key=f"snapshot:{version}",
            model_id="m",
            base_model=teacher.name,
            lora=LoraConfig(rank=4),
            tensors={"a": torch.zeros(256, 256)},  # 256 KiB
            version=version,
        )

    first, second = adapter(1), adapter(2)
    memory.admit(first, keep=())
    memory.admit(second, keep=())
    held = memory.memory.loaded()[teacher.name]
    assert held == teacher.sampler_bytes + first.nbytes + second.nbytes  # the sampler once
    memory.release(first.key)
    assert memory.memory.loaded()[teacher.name] == teacher.sampler_bytes + second.nbytes
    memory.release(second.key)  # the last adapter on it releases the sampler
    assert memory.memory.loaded() == {}
    # An in-flight target keeps two versions of its adapters: the one decoding and the next.
    target = LoadInflight(load=adapter(3), save=1)
    memory.admit(target, keep=())
    assert memory.memory.loaded()[teacher.name] == teacher.sampler_bytes + 2 * first.nbytes
    memory.release(target.key)
    assert memory.memory.loaded() == {}


def test_an_idle_sampler_is_released_on_its_rank(sizes):
    pool = _pool(sizes, idle_seconds=0.0)
    try:
        student = _base(sizes, "tiny-digits")
        pool.place(student)
        _wait_for(lambda: Drop(student.key) in pool.remotes[0].link.ops)  # the 1 s sweep
        assert _holders(pool) == [set(), set()]
        assert pool.remotes[0].memory.memory.loaded() == {}
    finally:
        pool.close()


def test_a_call_cancelled_while_its_rank_samples_is_dropped_quietly(sizes, caplog):
    """cancel_future on a sample a generator rank is running: the rank finishes it and its
    answer is dropped (no error raised in the link's reader, the sampler not left busy)."""
    pool = _pool(sizes)
    try:
        student = _base(sizes, "tiny-digits")
        pool.place(student)
        for remote in pool.remotes:
            remote.link.release.clear()
        running = pool.call(student, Sample(student.key, prompt=None))
        _wait_for(lambda: any(remote.busy for remote in pool.remotes))
        assert running.cancel()
        for remote in pool.remotes:
            remote.link.release.set()
        _wait_for(lambda: not any(remote.busy for remote in pool.remotes))
        # A rank's replies are handled one after another: once the next call on that rank
        # answers, the first one's answer has been handled.
        pool.call(student, Sample(student.key, prompt=None)).result(timeout=10)
        assert "exception calling callback" not in caplog.text
        assert running.cancelled()
    finally:
        pool.close()
