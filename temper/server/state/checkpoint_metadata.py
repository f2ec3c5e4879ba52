"""The user_metadata a client attached to a checkpoint when it saved it, kept next to the run:

    <root>/<run>/checkpoint_metadata.json    {"weights/0001": {"step": "10"}, ...}

`save_state(..., user_metadata=...)` and `save_weights_for_sampler(..., user_metadata=...)` send
it; the checkpoint listings (`Checkpoint.user_metadata`) answer with it. The server owns this
file (the backend never writes it) and replaces it atomically on every change, so metadata
holds across a restart. Saving over a checkpoint replaces its metadata; deleting the checkpoint
drops it.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage

_FILE = "checkpoint_metadata.json"


class CheckpointMetadata:
    """Reads and writes the user_metadata of the checkpoints under one storage root."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self._lock = threading.Lock()

    def get(self, path: CheckpointPath) -> dict[str, str] | None:
        return self._read(path.run_id).get(_key(path))

    def set(self, path: CheckpointPath, metadata: Mapping[str, str] | None) -> None:
        """Attach `metadata` to the checkpoint (None or empty: none)."""
        with self._lock:
            entries = self._read(path.run_id)
            if not metadata and _key(path) not in entries:
                return
            if metadata:
                entries[_key(path)] = {str(key): str(value) for key, value in metadata.items()}
            else:
                del entries[_key(path)]
            self._write(path.run_id, entries)

    def _read(self, run_id: str) -> dict[str, dict[str, str]]:
        file = self.storage.root / run_id / _FILE
        if not file.is_file():
            return {}
        return json.loads(file.read_text())

    def _write(self, run_id: str, entries: dict[str, dict[str, str]]) -> None:
        run_dir = self.storage.root / run_id
        handle, staging = tempfile.mkstemp(prefix=f".{_FILE}.", dir=run_dir)
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(entries, sort_keys=True) + "\n")
        os.replace(staging, Path(run_dir) / _FILE)


def _key(path: CheckpointPath) -> str:
    return f"{path.kind}/{path.name}"
