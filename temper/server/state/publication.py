"""Published checkpoints: which checkpoints every user of the server may read, kept on disk.

    <root>/<run>/published.json    ["sampler_weights/0001", "weights/final"]

A published checkpoint stays its owner's: only the owner may unpublish, delete it or set its
TTL; other users may sample from it, load it into a training model of their own, copy it and
read its weights info. The server owns this file, replaces it atomically on every change and
reads it on every lookup, so a publication made before a restart still holds after it.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage

_FILE = "published.json"


class CheckpointPublication:
    """Reads and writes which checkpoints under one storage root are published."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self._lock = threading.Lock()

    def is_published(self, path: CheckpointPath) -> bool:
        return _key(path) in self._read(path.run_id)

    def published(self, run_id: str) -> set[str]:
        """The run's published checkpoints, as `<kind>/<name>`."""
        return self._read(run_id)

    def set(self, path: CheckpointPath, *, published: bool) -> bool:
        """Publish or unpublish `path`; False if it already was (or was not) published."""
        with self._lock:
            entries = self._read(path.run_id)
            if (_key(path) in entries) == published:
                return False
            if published:
                entries.add(_key(path))
            else:
                entries.discard(_key(path))
            self._write(path.run_id, entries)
            return True

    def _read(self, run_id: str) -> set[str]:
        file = self.storage.root / run_id / _FILE
        if not file.is_file():
            return set()
        return set(json.loads(file.read_text()))

    def _write(self, run_id: str, entries: set[str]) -> None:
        run_dir = self.storage.root / run_id
        handle, staging = tempfile.mkstemp(prefix=f".{_FILE}.", dir=run_dir)
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(sorted(entries)) + "\n")
        os.replace(staging, Path(run_dir) / _FILE)


def _key(path: CheckpointPath) -> str:
    return f"{path.kind}/{path.name}"
