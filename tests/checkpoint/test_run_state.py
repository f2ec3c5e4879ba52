"""The generic resume record: atomic, round-trips, and restores an RNG exactly."""

from __future__ import annotations

import json
import random

import pytest

from temper.checkpoint.run_state import (
    RunState,
    has_run_state,
    load_run_state,
    rng_from_json,
    rng_to_json,
    save_run_state,
    truncate_jsonl,
)


def test_round_trip_and_replace(tmp_path):
    assert not has_run_state(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from"):
        load_run_state(tmp_path)
    rng = random.Random(7)
    rng.random()
    state = RunState(
        step=3, train_state="tinker://r/weights/step-3", loop={"rng": rng_to_json(rng)}
    )
    save_run_state(tmp_path, state)
    save_run_state(tmp_path, RunState(step=6, train_state="tinker://r/weights/step-6", loop={}))
    assert load_run_state(tmp_path).step == 6
    assert [p.name for p in tmp_path.iterdir()] == ["run_state"]  # no staging left behind
    restored = rng_from_json(json.loads(json.dumps(state.loop))["rng"])
    assert [restored.random() for _ in range(3)] == [rng.random() for _ in range(3)]


def test_a_failed_write_keeps_the_previous_state(tmp_path):
    save_run_state(tmp_path, RunState(step=3, train_state="tinker://r/weights/a", loop={}))
    with pytest.raises(TypeError):
        save_run_state(tmp_path, RunState(step=6, train_state="x", loop={"bad": object()}))
    assert load_run_state(tmp_path).step == 3


def test_truncate_jsonl_keeps_steps_before_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "v": s}) + "\n" for s in [0, 1, 2, 3, 2]))
    truncate_jsonl(path, before_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]
    truncate_jsonl(tmp_path / "missing.jsonl", before_step=1)  # nothing to cut
