"""Several base models on a multi-rank server (`temper serve --nproc 3`, colocated).

Two trainable models of different shapes (the tiny student and a smaller teacher) and a
sample-only grader, driven by the unmodified tinker SDK: a LoRA model trained on each (FSDP over
the 3 ranks) gives the numbers of a one-process server with the same models and flags, the
grader samples on rank 0, the model memory budget refuses what does not fit on a rank (503,
and 400 for a LoRA rank it could never hold) and ending a session releases its models on
every rank. The estimates count a rank's FSDP shard as `temper plan` does.
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.server.conftest import start_server
from tests.server.test_multimodel import write_model
from tests.server.test_replicated import _assert_close, _train

NUM_RANKS = 3
BUDGET_MB = "460"
"""Rank 0 holds about 453 MiB of it: the student's and the teacher's LoRA models (rank 4,
each with its base's shard and a merged sampler) and the grader's sampler; one process holds
about the same (the LoRA models' shared bases and multi-LoRA samplers instead)."""


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "teacher-digits"
    return write_model(directory, dim=64, num_layers=2, ffn_dim=128, seed=1)


@pytest.fixture(scope="module")
def grader_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("models") / "grader-digits"
    return write_model(directory, dim=96, num_layers=1, ffn_dim=96, seed=2)


def _start(*, model_dir, teacher_dir, grader_dir, root: Path, extra: tuple[str, ...] = ()):
    root.mkdir()
    return start_server(
        model_dir,
        root / "storage",
        root / "server.log",
        *("--model", str(teacher_dir), "--sample-only-model", str(grader_dir)),
        *("--model-memory-mb", BUDGET_MB, *extra),
    )


@pytest.fixture(scope="module")
def servers(model_dir, teacher_dir, grader_dir, tmp_path_factory):
    """(the 3-rank server, a one-process one) on the same models and flags, started together."""
    root = tmp_path_factory.mktemp("servers")
    args = {"model_dir": model_dir, "teacher_dir": teacher_dir, "grader_dir": grader_dir}
    with ThreadPoolExecutor(max_workers=2) as pool:
        starting = [
            pool.submit(_start, root=root / "ranks", extra=("--nproc", str(NUM_RANKS)), **args),
            pool.submit(_start, root=root / "one", **args),
        ]
    started = [future.result() for future in starting if future.exception() is None]
    try:
        for future in starting:
            future.result()  # a server that failed to start fails the test, naming why
        yield started
    finally:
        for server in started:
            server.stop()


def _models_session(server, *, model_dir: Path, teacher_dir: Path, grader_dir: Path) -> dict:
    """A LoRA model trained and sampled on each trainable model, and the grader sampled."""
    service = server.service()
    result = {}
    for name, directory, seed in (("student", model_dir, 1), ("teacher", teacher_dir, 2)):
        training = service.create_lora_training_client(str(directory), rank=4, seed=seed).result()
        result[name] = _train(training, training.get_tokenizer(), module=types)
        result[f"{name}_id"] = training.model_id
    grader = service.create_sampling_client(base_model=str(grader_dir)).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    sample = grader.sample(prompt, 2, params).result()
    result["grader"] = [sequence.tokens for sequence in sample.sequences]
    result["service"] = service
    return result


def test_two_models_on_three_ranks_train_and_sample_like_one_process(
    servers, model_dir, teacher_dir, grader_dir
):
    ranks, single = servers
    dirs = {"model_dir": model_dir, "teacher_dir": teacher_dir, "grader_dir": grader_dir}
    replayed = _models_session(ranks, **dirs)
    try:
        _check_budget(ranks, replayed, model_dir=model_dir)
    finally:
        replayed.pop("service").close("success").result()
    _check_released(ranks, [replayed["student_id"], replayed["teacher_id"]])
    # What the ended session held is free again: a model fits where the 503 was.
    service = ranks.service()
    service.create_lora_training_client(str(model_dir), rank=4).result()
    service.close("success").result()
    ranks.process.terminate()  # every rank stops cleanly while the one process computes

    reference = _models_session(single, **dirs)
    reference.pop("service").close("success").result()
    for name in ("student", "teacher"):
        _assert_close(replayed[name], reference[name])
    assert replayed["student"]["losses"] != pytest.approx(replayed["teacher"]["losses"])
    assert replayed["grader"] == reference["grader"]
    assert ranks.process.wait(timeout=120) == 0
    log = ranks.log.read_text()
    assert "Traceback" not in log and f"{NUM_RANKS} ranks" in log


def _check_budget(server, held: dict, *, model_dir: Path) -> None:
    """Rank 0 is full: another student model is the 503 naming each rank's budget and what
    holds it, and a LoRA rank no rank could hold is the request's 400."""
    service = held["service"]
    with pytest.raises(tinker.APIStatusError) as full:
        service.create_lora_training_client(str(model_dir), rank=4).result()
    assert full.value.status_code == 503
    message = str(full.value)
    assert f"model memory budget of a rank (--model-memory-mb {BUDGET_MB})" in message
    assert f"training model {held['teacher_id']}" in message
    with pytest.raises(tinker.BadRequestError) as huge:
        service.create_lora_training_client(str(model_dir), rank=10**9).result()
    assert "lora_config.rank 1000000000 does not fit" in str(huge.value)
    assert int(re.search(r"the largest rank that fits is (\d+)", str(huge.value)).group(1)) > 1


def _check_released(server, model_ids: list[str]) -> None:
    """Every rank dropped each model of the ended session (rank 0's log says which did)."""
    on_every_rank = list(range(NUM_RANKS))
    expected = [f"model {model_id} released on ranks {on_every_rank}" for model_id in model_ids]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = server.log.read_text()
        if all(line in log for line in expected):
            return
        time.sleep(0.2)
    pytest.fail(f"not released on every rank: {expected}\n{server.log.read_text()[-3000:]}")


def test_a_ranks_estimate_is_its_shard_as_the_plan_counts_it(teacher_dir):
    from temper.job.memory_plan import PlanSettings, plan_memory
    from temper.sampler.engine import SamplerEngine
    from temper.server.state.base_models import load_base_model

    engine = SamplerEngine.Config(max_batch=4, max_seq_len=64, prefix_cache_mib=1)
    base = load_base_model(
        str(teacher_dir), trainable=True, sampler=engine, dtype="float32", trainer_shards=NUM_RANKS
    )
    for lora_rank in (5, None):
        settings = PlanSettings(
            model=str(teacher_dir),
            lora_rank=lora_rank,
            dtype="float32",
            nproc_per_node=NUM_RANKS,
            batch=4,
            max_seq_len=64,
            max_batch=4,
            prefix_cache_mib=1,
        )
        rows = {
            row.item.split(",")[0]: row.num_bytes
            for row in plan_memory(settings).role("colocated").rows
        }
        held = base.trainer_bytes(lora_rank=lora_rank)
        if lora_rank is None:
            assert (held.frozen, held.trained) == (0, rows["weights"])
        else:
            assert (held.frozen, held.trained) == (
                rows["base weights (frozen)"],
                rows["LoRA adapters"],
            )
        assert held.moments == rows["AdamW moments (2)"]
        assert held.frozen + held.trained < base.weights_bytes // 2  # a third, padded
        # Every rank's sampler holds whole (merged) weights of its own.
        sampler = base.sampler_bytes if lora_rank is None else base.merged_sampler_bytes
        estimate = base.training_bytes(
            lora_rank=lora_rank, shared_base=False, sampler_reads_trainer=False
        )
        assert estimate == held.total + sampler


def test_the_largest_lora_rank_on_a_sharded_trainer_is_the_last_that_fits(teacher_dir):
    from temper.sampler.engine import SamplerEngine
    from temper.server.state.base_models import load_base_model

    base = load_base_model(
        str(teacher_dir),
        trainable=True,
        sampler=SamplerEngine.Config(max_batch=4, max_seq_len=64, prefix_cache_mib=1),
        dtype="float32",
        trainer_shards=NUM_RANKS,
    )
    sharing = {"shared_base": False, "shared_sampler": False}
    for budget in (3 * 2**20, 5 * 2**20, 40 * 2**20):
        largest = base.largest_lora_rank(budget_bytes=budget, **sharing)
        assert largest >= 1
        assert base.lora_model_bytes(lora_rank=largest, **sharing) <= budget
        assert base.lora_model_bytes(lora_rank=largest + 1, **sharing) > budget


def test_several_ranks_refuse_a_sample_only_model_alone(grader_dir, capsys):
    from temper.cli import main

    assert main(["serve", "--sample-only-model", str(grader_dir), "--nproc", "2"]) == 2
    assert "several ranks takes a trainable model (--model DIR)" in capsys.readouterr().err


def test_what_fits_no_rank_is_the_503_naming_each_ranks_budget():
    from temper.server.state.model_memory import ModelMemory, OverBudget

    memory = ModelMemory(budget_bytes=100 * 2**20, idle_seconds=60.0, per_rank=True)
    with pytest.raises(OverBudget) as caught:
        memory.admit(
            "m", base_model="/m/big", what="training model m", num_bytes=200 * 2**20, pinned=True
        )
    assert str(caught.value) == (
        "base model /m/big cannot be loaded: training model m needs 200.0 MiB, more than the "
        "whole model memory budget of a rank (--model-memory-mb 100); raise --model-memory-mb"
    )
    assert memory.loaded() == {}
