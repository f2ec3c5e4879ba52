"""Where checkpoints live: `tinker://<run>/<kind>/<name>` paths mapped onto a local directory.

    <root>/<run>/run.json                 base model, LoRA config (so a new process can resume)
    <root>/<run>/weights/<name>/          full train state (DCP), from save_state
    <root>/<run>/sampler_weights/<name>/  weights a sampler loads, from save_weights_for_sampler
    <root>/<run>/external_weights/<name>/ a HF model or PEFT adapter, from save_weights_external

Run ids and checkpoint names are restricted to a safe alphabet, so no path can escape the root.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from temper.checkpoint.atomic import clear_interrupted

CheckpointKind = Literal["weights", "sampler_weights", "external_weights"]
KINDS: tuple[CheckpointKind, ...] = ("weights", "sampler_weights", "external_weights")
SCHEME = "tinker://"
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def check_name(name: str, *, field: str) -> str:
    """A run id or checkpoint name that is safe as one path segment."""
    if not isinstance(name, str) or not _SAFE_NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"{field} {name!r} is not a valid name: use 1-128 letters, digits, '.', '_', ':' or "
            "'-', starting with a letter or digit (no '/' or '..')"
        )
    return name


@dataclass(frozen=True)
class CheckpointPath:
    run_id: str
    kind: CheckpointKind
    name: str

    def __str__(self) -> str:
        return f"{SCHEME}{self.run_id}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> CheckpointPath:
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise ValueError(
                f"checkpoint path {path!r} must look like tinker://<run>/<kind>/<name>"
            )
        parts = path.removeprefix(SCHEME).split("/")
        if len(parts) != 3 or parts[1] not in KINDS:
            raise ValueError(
                f"checkpoint path {path!r} must look like tinker://<run>/<kind>/<name> with kind "
                f"one of {list(KINDS)}"
            )
        run_id, kind, name = parts
        return cls(
            run_id=check_name(run_id, field="run id"),
            kind=kind,  # type: ignore[arg-type]
            name=check_name(name, field="checkpoint name"),
        )


class CheckpointStorage:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser()

    def directory(self, path: CheckpointPath) -> Path:
        return self.root / path.run_id / path.kind / path.name

    def existing(self, path: str | CheckpointPath) -> tuple[CheckpointPath, Path]:
        parsed = path if isinstance(path, CheckpointPath) else CheckpointPath.parse(path)
        directory = self.directory(parsed)
        if not directory.is_dir():
            raise FileNotFoundError(f"no checkpoint at {parsed} (looked in {directory})")
        return parsed, directory

    def write_run(self, run_id: str, info: dict[str, Any]) -> None:
        run_dir = self.root / check_name(run_id, field="run id")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "run.json").write_text(json.dumps(info, indent=2) + "\n")

    def read_run(self, run_id: str) -> dict[str, Any]:
        run_file = self.root / check_name(run_id, field="run id") / "run.json"
        if not run_file.is_file():
            raise FileNotFoundError(f"unknown training run {run_id!r} (no {run_file})")
        return json.loads(run_file.read_text())

    def run_ids(self) -> list[str]:
        """Every run under the root (a directory with a run.json), by name."""
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if _SAFE_NAME.fullmatch(entry.name) and (entry / "run.json").is_file()
        )

    def list(self, run_id: str) -> list[CheckpointPath]:
        run_dir = self.root / check_name(run_id, field="run id")
        found = []
        for kind in KINDS:
            kind_dir = run_dir / kind
            if kind_dir.is_dir():
                found += [
                    CheckpointPath(run_id, kind, entry.name)
                    for entry in sorted(kind_dir.iterdir())
                    if entry.is_dir() and _SAFE_NAME.fullmatch(entry.name)
                ]
        return found

    def clear_interrupted(self, *, older_than_s: float = 0.0) -> list[Path]:
        """Remove what saves killed midway left under the root (`atomic.clear_interrupted`,
        for each run's checkpoint folders); returns the directories handled."""
        handled = []
        for run_id in self.run_ids():
            for kind in KINDS:
                handled += clear_interrupted(self.root / run_id / kind, older_than_s=older_than_s)
        return handled

    def delete(self, path: str | CheckpointPath) -> None:
        _, directory = self.existing(path)
        shutil.rmtree(directory)
