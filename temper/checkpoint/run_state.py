"""Where a job resumes from: the last full-state checkpoint of a run directory.

    <run_dir>/run_state/state.json   {"step": ..., "train_state": "tinker://...", "loop": {...},
                                      "world_size": ...}

`step` counts the steps done (the resumed run starts there), `train_state` is the training
client's `save_state` checkpoint (model and optimizer, DCP), and `loop` is whatever else the
job needs to continue exactly (its RNG, its phase, ...), as JSON. The directory is replaced
whole (temper/checkpoint/atomic.py), and a job writes it only after the train state it names
is complete, so a crash at any moment leaves the previous resumable state.

Per-step logs written after the checkpoint by a run that then crashed are cut on resume
(`truncate_jsonl`), so metrics.jsonl continues as one curve with no step twice.

Any job can use this: save with `save_run_state` every few steps, and on `resume` read
`load_run_state`, restore the training client with
`ServiceClient.create_training_client_from_state_with_optimizer(state.train_state)`, restore
the RNG with `rng_from_json`, cut the logs, and continue from `state.step`
(temper/job/run_checkpoints.py does the saving for the RL and SFT jobs).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from temper.checkpoint.atomic import staged_directory

RUN_STATE_DIR = "run_state"
STATE_FILE = "state.json"


class LoopState(Protocol):
    """A job's own state (its dataclass: the RL job's `RLLoopState`, SFT's `SFTState`), kept
    in `RunState.loop` as the JSON `to_json` gives; the job reads it back with its own
    `from_json`."""

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RunState:
    step: int
    """Steps done; the resumed run continues with this step."""
    train_state: str
    """`tinker://<run>/weights/<name>`: the training client's model and optimizer state."""
    loop: dict[str, Any]
    """The job's own state (JSON): RNG, phase, anything else a bitwise resume needs."""
    world_size: int = 1
    """Processes (torchrun ranks) the run had; a resume on another number is not bitwise."""


def save_run_state(run_dir: str | Path, state: RunState) -> None:
    """Replace `run_dir/run_state` whole with `state`."""
    text = json.dumps(asdict(state), indent=1) + "\n"
    with (
        staged_directory(Path(run_dir) / RUN_STATE_DIR) as staging,
        (staging / STATE_FILE).open("w") as file,
    ):
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def has_run_state(run_dir: str | Path) -> bool:
    return (Path(run_dir) / RUN_STATE_DIR / STATE_FILE).is_file()


def load_run_state(run_dir: str | Path) -> RunState:
    path = Path(run_dir) / RUN_STATE_DIR / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir} has no checkpoint to resume from (no {RUN_STATE_DIR}/{STATE_FILE}); "
            "the run saved none yet (see its checkpoint_every)"
        )
    data = json.loads(path.read_text())
    return RunState(
        step=int(data["step"]),
        train_state=data["train_state"],
        loop=data["loop"],
        world_size=int(data.get("world_size", 1)),  # absent before it was recorded
    )


def rng_to_json(rng: random.Random) -> list:
    version, internal, gauss_next = rng.getstate()
    return [version, list(internal), gauss_next]


def rng_from_json(state: list) -> random.Random:
    version, internal, gauss_next = state
    rng = random.Random()
    rng.setstate((version, tuple(internal), gauss_next))
    return rng


def truncate_jsonl(path: str | Path, *, before_step: int) -> None:
    """Keep only the lines of a per-step JSONL file whose "step" is below `before_step`
    (lines written after the checkpoint by the run that stopped); atomic rewrite."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines(keepends=True)
        if line.strip() and json.loads(line)["step"] < before_step
    ]
    staging = path.with_name(f".{path.name}.tmp")
    with staging.open("w") as file:
        file.writelines(kept)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, path)
