"""RunCheckpoints: when a job saves, what the run state names, and that only the last stays."""

from __future__ import annotations

import json
from dataclasses import dataclass

from temper.checkpoint.run_state import load_run_state
from temper.client.service_client import ServiceClient
from temper.distributed.ranks import Ranks
from temper.job import RunCheckpoints


@dataclass
class _State:
    step: int

    def to_json(self) -> dict:
        return {"step": self.step}


def _checkpoints(tmp_path, training, *, every, total_steps, previous=None) -> RunCheckpoints:
    return RunCheckpoints(
        run_dir=tmp_path,
        training=training,
        every=every,
        total_steps=total_steps,
        previous=previous,
        ranks=Ranks.current(),
    )


def _saved_weights(tmp_path, training) -> list[str]:
    return sorted(
        p.name for p in (tmp_path / "checkpoints" / training.model_id / "weights").iterdir()
    )


def test_saves_when_due_names_the_newest_and_keeps_only_it(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "checkpoints")
    training = service.create_training_client("tiny")
    checkpoints = _checkpoints(tmp_path, training, every=2, total_steps=5)
    assert [step for step in range(1, 6) if checkpoints.due(step)] == [2, 4, 5]
    saved = []
    for step in range(1, 6):
        checkpoints.step_done(step, _State(step))
        if checkpoints.due(step):
            saved.append(load_run_state(tmp_path))
    assert [state.step for state in saved] == [2, 4, 5]
    assert [state.loop for state in saved] == [{"step": 2}, {"step": 4}, {"step": 5}]
    assert _saved_weights(tmp_path, training) == ["step-000005"]
    assert saved[-1].train_state.endswith("/weights/step-000005")


def test_a_resumed_run_replaces_the_checkpoint_it_resumed_from(tmp_path):
    service = ServiceClient(storage_dir=tmp_path / "checkpoints")
    training = service.create_training_client("tiny")
    first = _checkpoints(tmp_path, training, every=0, total_steps=1)
    first.step_done(1, _State(1))
    resumed = _checkpoints(
        tmp_path, training, every=0, total_steps=2, previous=load_run_state(tmp_path)
    )
    resumed.step_done(2, _State(2))
    assert (
        _saved_weights(tmp_path, training) == ["step-000002"] and load_run_state(tmp_path).step == 2
    )


def test_a_resume_on_another_number_of_processes_says_how_to_resume_as_it_ran(tmp_path):
    from temper.checkpoint.run_state import RunState, load_run_state, save_run_state
    from temper.job import other_world_note

    saved = RunState(step=3, train_state="tinker://r/weights/3", loop={}, world_size=2)
    save_run_state(tmp_path, saved)
    assert load_run_state(tmp_path) == saved
    note = other_world_note(load_run_state(tmp_path), run_dir=tmp_path)  # one process here
    assert "It ran on 2 processes and continues on 1, which does not reproduce" in note
    assert f"`temper train --resume {tmp_path} --nproc 2` resumes it as it ran" in note
    assert other_world_note(RunState(step=3, train_state="x", loop={}), run_dir=tmp_path) == ""
    state_file = tmp_path / "run_state" / "state.json"
    old = json.loads(state_file.read_text())
    del old["world_size"]  # written before the field existed: one process
    state_file.write_text(json.dumps(old))
    assert load_run_state(tmp_path).world_size == 1
