"""The checkpoint catalog as Tinker's REST types see it.

Checkpoints themselves live in `temper.checkpoint.storage.CheckpointStorage` (the same root
the backend writes to): `<root>/<run>/{run.json, weights/<name>, sampler_weights/<name>}`.
A training run id is the Tinker model id, `<session>:train:<n>`, so `tinker://` paths name
directories directly and survive a server restart. Every id and name that reaches the disk
goes through `checked` (ids.py), so no request can address a path outside the root.

Each run records its owner (the user whose session created it) in run.json; every lookup
takes the asking user, and a run, checkpoint or path of another user's answers the same 404
as one that does not exist, unless the checkpoint is published (publication.py): then every
user may read it (`parse`, `run_of`, a run's listing shows them its published checkpoints),
and only its owner may change it (`owner_only`). Runs saved before owners were recorded
belong to `default`.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tinker import types as tinker_types

from temper.checkpoint.storage import CheckpointPath, CheckpointStorage
from temper.server.http.errors import BadRequest, NotFound
from temper.server.http.users import DEFAULT_USER, SERVER, User
from temper.server.state.checkpoint_metadata import CheckpointMetadata
from temper.server.state.copies import CheckpointCopies
from temper.server.state.expiry import CheckpointExpiry
from temper.server.state.external_weights import DownloadSigner
from temper.server.state.ids import checked
from temper.server.state.publication import CheckpointPublication

_CHECKPOINT_TYPES = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
_KIND_HINTS = {
    "weights": "training state comes from save_state (tinker://<run>/weights/<name>)",
    "sampler_weights": "sampler weights come from save_weights_for_sampler "
    "(tinker://<run>/sampler_weights/<name>)",
    "external_weights": "external weights come from save_weights_external "
    "(tinker://<run>/external_weights/<name>)",
}


class CheckpointCatalog:
    """Reads checkpoints and runs from the storage root as Tinker REST objects."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.storage = storage
        self.expiry = CheckpointExpiry(storage)
        self.metadata = CheckpointMetadata(storage)
        self.publication = CheckpointPublication(storage)
        self.copies = CheckpointCopies(storage)
        self.downloads = DownloadSigner()

    def parse(
        self, path: str, *, user: User, kind: str | None = None, owner_only: bool = False
    ) -> CheckpointPath:
        """A `tinker://` path to an existing checkpoint `user` may read (of `kind`, when
        given): their own, or a published one unless `owner_only` (a change to it)."""
        try:
            parsed = CheckpointPath.parse(path)
        except ValueError as error:
            raise BadRequest(str(error)) from None
        if owner_only or not self._published(parsed):
            self.run(parsed.run_id, user=user)  # another user's run: 404 before other checks
        if not self.exists(parsed):
            raise NotFound(f"no checkpoint at {parsed}")
        if kind is not None and parsed.kind != kind:
            raise BadRequest(f"{path} is a {parsed.kind} checkpoint; {_KIND_HINTS[kind]}")
        return parsed

    def run_of(self, path: CheckpointPath, *, user: User) -> dict[str, Any]:
        """The run.json of the run holding `path`, a checkpoint `user` may read (`parse`)."""
        if self._published(path):
            return self.run(path.run_id, user=SERVER)
        return self.run(path.run_id, user=user)

    def _published(self, path: CheckpointPath) -> bool:
        return self.publication.is_published(path) and self.exists(path)

    def exists(self, path: CheckpointPath) -> bool:
        return self.storage.directory(path).is_dir()

    def run(self, run_id: str, *, user: User) -> dict[str, Any]:
        """The run's run.json (404 if it does not exist or `user` does not own it)."""
        try:
            run = self.storage.read_run(checked(run_id, field="training run id"))
        except FileNotFoundError:
            run = None
        if run is None or not user.owns(owner_of(run)):
            raise NotFound(f"unknown training run {run_id!r}")
        return run

    def set_owner(self, run_id: str, owner: str) -> None:
        """Record `owner` in a run's run.json (after the backend wrote it)."""
        run = self.storage.read_run(run_id)
        if run.get("owner") != owner:
            self.storage.write_run(run_id, {**run, "owner": owner})

    def set_user_metadata(self, run_id: str, metadata: Mapping[str, str]) -> None:
        """Replace a run's user_metadata in its run.json (get_training_run reads it back)."""
        run = self.storage.read_run(run_id)
        self.storage.write_run(run_id, {**run, "user_metadata": dict(metadata)})

    def run_ids(self, *, user: User) -> list[str]:
        """The runs in storage `user` owns (all of them for an admin)."""
        run_ids = self.storage.run_ids()
        if user.admin:
            return run_ids
        owned = []
        for run_id in run_ids:
            try:
                run = self.storage.read_run(run_id)
            except (FileNotFoundError, ValueError):  # deleted or being written meanwhile
                continue
            if owner_of(run) == user.name:
                owned.append(run_id)
        return owned

    def checkpoints(self, run_id: str, *, user: User) -> list[tinker_types.Checkpoint]:
        """The run's checkpoints; another user's run lists its published ones (404 if none)."""
        try:
            self.run(run_id, user=user)
            paths = self.storage.list(run_id)
        except NotFound:
            published = self.publication.published(checked(run_id, field="training run id"))
            paths = [p for p in self.storage.list(run_id) if f"{p.kind}/{p.name}" in published]
            if not paths:
                raise
        found = [self.checkpoint(path) for path in paths]
        return sorted(found, key=lambda checkpoint: checkpoint.time)

    def checkpoint(self, path: CheckpointPath) -> tinker_types.Checkpoint:
        directory = self.storage.directory(path)
        return tinker_types.Checkpoint(
            checkpoint_id=f"{path.kind}/{path.name}",
            checkpoint_type=_CHECKPOINT_TYPES[path.kind],
            time=_mtime(directory),
            tinker_path=str(path),
            size_bytes=sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()),
            expires_at=self.expiry.get(path),
            user_metadata=self.metadata.get(path),
            public=self.publication.is_published(path),
        )

    def training_run(
        self, run_id: str, *, user: User, last_request_time: datetime.datetime | None
    ) -> tinker_types.TrainingRun:
        run = self.run(run_id, user=user)
        checkpoints = self.checkpoints(run_id, user=user)
        by_type = {
            kind: [c for c in checkpoints if c.checkpoint_type == kind]
            for kind in ("training", "sampler")
        }
        lora = run.get("lora")
        return tinker_types.TrainingRun(
            training_run_id=run_id,
            base_model=run["base_model"],
            model_owner=owner_of(run),
            is_lora=lora is not None,
            lora_rank=None if lora is None else lora["rank"],
            last_request_time=last_request_time or _mtime(self.storage.root / run_id / "run.json"),
            last_checkpoint=by_type["training"][-1] if by_type["training"] else None,
            last_sampler_checkpoint=by_type["sampler"][-1] if by_type["sampler"] else None,
            user_metadata={key: str(value) for key, value in run.get("user_metadata", {}).items()},
        )

    def training_runs(
        self,
        *,
        user: User,
        limit: int,
        offset: int,
        last_request_times: Mapping[str, datetime.datetime],
    ) -> tinker_types.TrainingRunsResponse:
        """One page of `user`'s runs in storage, the most recently used first
        (`last_request_times`: the live models' last requests; other runs count from their
        run.json)."""
        runs = [
            self.training_run(run_id, user=user, last_request_time=last_request_times.get(run_id))
            for run_id in self.run_ids(user=user)
        ]
        runs.sort(key=lambda run: (run.last_request_time, run.training_run_id), reverse=True)
        return tinker_types.TrainingRunsResponse(
            training_runs=runs[offset : offset + limit],
            cursor=tinker_types.Cursor(offset=offset, limit=limit, total_count=len(runs)),
        )

    def all_checkpoints(
        self, *, user: User, limit: int, offset: int
    ) -> tinker_types.CheckpointsListResponse:
        """One page of the checkpoints of `user`'s runs, newest first."""
        found = [
            self.checkpoint(path)
            for run_id in self.run_ids(user=user)
            for path in self.storage.list(run_id)
        ]
        found.sort(key=lambda checkpoint: (checkpoint.time, checkpoint.tinker_path), reverse=True)
        return tinker_types.CheckpointsListResponse(
            checkpoints=found[offset : offset + limit],
            cursor=tinker_types.Cursor(offset=offset, limit=limit, total_count=len(found)),
        )

    def weights_info(self, path: str, *, user: User) -> tinker_types.WeightsInfoResponse:
        parsed = self.parse(path, user=user)
        run = self.run_of(parsed, user=user)
        lora = run.get("lora")
        return tinker_types.WeightsInfoResponse(
            base_model=run["base_model"],
            is_lora=lora is not None,
            lora_rank=None if lora is None else lora["rank"],
            train_unembed=None if lora is None else lora["train_unembed"],
            train_mlp=None if lora is None else lora["train_mlp"],
            train_attn=None if lora is None else lora["train_attn"],
        )

    def delete(self, path: str, *, user: User) -> CheckpointPath:
        parsed = self.parse(path, user=user, owner_only=True)
        self.storage.delete(parsed)
        self.expiry.set(parsed, expires_at=None)
        self.metadata.set(parsed, None)
        self.publication.set(parsed, published=False)
        return parsed


def owner_of(run: dict[str, Any]) -> str:
    return run.get("owner", DEFAULT_USER)


def _mtime(path: Path) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(path.stat().st_mtime, tz=datetime.UTC)
