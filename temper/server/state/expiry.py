"""Checkpoint TTLs: when each checkpoint expires, kept on disk next to the run.

    <root>/<run>/expiry.json    {"weights/0001": "2026-01-01T00:00:00+00:00", ...}

The server owns this file (the backend never writes it), replaces it atomically on every
change, and reads it on every listing and sweep, so an expiry set before a restart still
holds after it. A checkpoint without an entry never expires. `ttl_seconds` counts from the
moment it is set (a save, or `PUT .../ttl`); null removes the expiry.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import threading
from pathlib import Path

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage
from temper.server.http.errors import BadRequest

MIN_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600
_FILE = "expiry.json"


def check_ttl(ttl_seconds: int | None, *, field: str = "ttl_seconds") -> int | None:
    """A TTL in Tinker's range (1 hour to 10 years), or None (never expires)."""
    if ttl_seconds is None:
        return None
    if not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise BadRequest(
            f"{field} must be in {MIN_TTL_SECONDS}..{MAX_TTL_SECONDS} (1 hour to 10 years) or "
            f"null (never expires), got {ttl_seconds}"
        )
    return ttl_seconds


def now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


class CheckpointExpiry:
    """Reads and writes the expiry times of the checkpoints under one storage root."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self._lock = threading.Lock()

    def get(self, path: CheckpointPath) -> datetime.datetime | None:
        return self._read(path.run_id).get(_key(path))

    def set(self, path: CheckpointPath, *, expires_at: datetime.datetime | None) -> None:
        with self._lock:
            entries = self._read(path.run_id)
            if expires_at is None and _key(path) not in entries:
                return
            if expires_at is None:
                del entries[_key(path)]
            else:
                entries[_key(path)] = expires_at
            self._write(path.run_id, entries)

    def set_ttl(self, path: CheckpointPath, ttl_seconds: int | None) -> datetime.datetime | None:
        expires_at = None
        if ttl_seconds is not None:
            expires_at = now() + datetime.timedelta(seconds=ttl_seconds)
        self.set(path, expires_at=expires_at)
        return expires_at

    def expired(self, *, at: datetime.datetime) -> list[CheckpointPath]:
        """Every checkpoint whose expiry is at or before `at`."""
        found = []
        for run_id in self.storage.run_ids():
            for key, expires_at in self._read(run_id).items():
                if expires_at <= at:
                    kind, name = key.split("/")
                    found.append(CheckpointPath(run_id, kind, name))  # type: ignore[arg-type]
        return found

    def _read(self, run_id: str) -> dict[str, datetime.datetime]:
        file = self.storage.root / run_id / _FILE
        if not file.is_file():
            return {}
        raw = json.loads(file.read_text())
        return {key: datetime.datetime.fromisoformat(value) for key, value in raw.items()}

    def _write(self, run_id: str, entries: dict[str, datetime.datetime]) -> None:
        run_dir = self.storage.root / run_id
        text = json.dumps({key: value.isoformat() for key, value in sorted(entries.items())})
        handle, staging = tempfile.mkstemp(prefix=f".{_FILE}.", dir=run_dir)
        with os.fdopen(handle, "w") as file:
            file.write(text + "\n")
        os.replace(staging, Path(run_dir) / _FILE)


def _key(path: CheckpointPath) -> str:
    return f"{path.kind}/{path.name}"
