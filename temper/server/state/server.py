"""The server's state: its config, the backend, and who holds which model and sampler.

One `ServiceBackend` (by default the in-process `temper.ServiceClient`) serves every client, on
every served base model (base_models.py; loaded on first use within a memory budget,
model_memory.py). Each Tinker training model is one backend `TrainingClient` (its own LoRA
adapters or, with `fine_tuning="full"`, its own full copy, and its own optimizer state), named
by the Tinker model id, which is also its run id on disk. Sampling sessions map onto backend
sampling clients: one shared client per base model and per sampler checkpoint, one per
`save_weights_and_get_sampling_client` call. Sessions own their models and sampling sessions;
finishing a session, or its heartbeats stopping for `session_timeout_s`, releases them
(lifetimes.py). Every session, and so everything it created, belongs to the user whose key
created it (http/users.py); another user's ids answer 404 as if they did not exist."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.distributed as dist

from temper.api.backend import SamplingBackend, ServiceBackend, TrainingBackend
from temper.checkpoint.storage import CheckpointStorage
from temper.config.configurable import Configurable
from temper.observability.process_memory import device_memory_bytes
from temper.server.dispatch.coalescer import SampleCoalescer
from temper.server.dispatch.scheduler import Scheduler
from temper.server.http import request_log
from temper.server.http.errors import BadRequest, NotFound, TooManyRequests
from temper.server.http.users import SERVER, User, Users
from temper.server.state.adapter_room import AdapterRoom
from temper.server.state.base_models import (
    BaseModel,
    BaseModels,
    ModelLimits,
    check_generator,
    describe,
    load_base_model,
    model_dirs,
    trainer_shards,
)
from temper.server.state.catalog import CheckpointCatalog
from temper.server.state.config import ServerConfig
from temper.server.state.lifetimes import EndedIds
from temper.server.state.model_memory import ModelMemory
from temper.server.state.sessions import SamplingSession, ServedModel, Session
from temper.server.state.snapshots import MIB, SnapshotRetention
from temper.trainer.precision import Precision

__all__ = ["ModelLimits", "SamplingSession", "ServedModel", "Session", "TemperServer"]

log = logging.getLogger("temper.server")
Held = Literal["sessions", "models", "sampling sessions"]
"""What a user holds under a per-user limit."""
STALE_STAGING_S = 600.0
"""Age past which a checkpoint staging directory in --storage counts as a killed save's."""


class TemperServer(Configurable):
    """The facade routes call: lookups that answer 404/410 for the asking user, per-user
    limits, registration of models and sampling sessions, and endings (module doc). It owns
    the policies (memory, snapshots, adapter room) and the dispatch of requests."""

    Config = ServerConfig

    def __init__(self, config: Config, *, backend: ServiceBackend | None = None) -> None:
        self.config = config
        self.users = Users(api_key=config.api_key, key_file=config.key_file)
        dirs = model_dirs(
            models=config.model, sample_only=config.sample_only_model, models_dir=config.models_dir
        )
        shards = trainer_shards(config.trainer.sharding)
        self.base_models = BaseModels(
            [
                load_base_model(
                    path,
                    trainable=trainable,
                    sampler=config.sampler,
                    dtype=config.dtype,
                    trainer_shards=shards,
                )
                for path, trainable in dirs
            ]
        )
        # Before the server listens: the first request would fail on the model otherwise.
        compute = Precision.resolve(config.dtype, device=config.device).compute
        check_generator([path for path, _ in dirs], generator=config.generator, dtype=compute)
        device_bytes = device_memory_bytes(config.device)
        self.memory = ModelMemory(
            budget_bytes=model_budget_bytes(config, device_bytes=device_bytes),
            idle_seconds=config.model_idle_seconds,
            per_rank=shards > 1,
        )
        storage = CheckpointStorage(config.storage)
        # Saves a killed server left midway; a younger one may be another server's, still saving.
        storage.clear_interrupted(older_than_s=STALE_STAGING_S)
        self.catalog = CheckpointCatalog(storage)
        self.backend = in_process_backend(config, storage) if backend is None else backend
        self.scheduler = Scheduler(result_ttl_s=config.result_ttl_s)
        self.coalescer = SampleCoalescer(
            config.sample_window_s,
            max_hold_s=config.sample_max_hold_s,
            capacity=config.sampler.max_batch,
        )
        self.stability = config.stability.build()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ServedModel] = {}
        self.sampling_sessions: dict[str, SamplingSession] = {}
        self.ended = EndedIds()
        self.snapshots = snapshot_retention(config, self.base_models, device_bytes=device_bytes)
        self.adapter_room = AdapterRoom(config, snapshots=self.snapshots)
        self._shared_samplers: dict[str, SamplingBackend] = {}
        # The LoRA training models on each base model, which share its weights (counted once).
        self._shared_base_users: dict[str, set[str]] = {}
        self._shared_lock = threading.Lock()
        self.rank_health: Callable[[], list[dict[str, Any]]] | None = None
        """On several ranks (set by `temper serve --nproc`): each rank's role, pid and
        whether it is alive, for healthz."""

    # -- lookups (each raises NotFound naming what is unknown) --------------------------------

    def session(self, session_id: str, *, user: User, alive: bool = True) -> Session:
        """The session (404 if unknown or another user's; 410 if it ended). `alive`: the
        request comes from the session's own client, a sign of life (a REST client looking
        at it is not)."""
        request_log.note(session=session_id)
        session = self.sessions.get(session_id)
        if session is None or not user.owns(session.user):
            self.ended.check(session_id, kind="session", user=user)
            raise NotFound(f"unknown session {session_id!r}; create one with create_session")
        if alive:
            session.last_seen = time.monotonic()
        return session

    def model(self, model_id: str, *, user: User) -> ServedModel:
        request_log.note(model=model_id)
        served = self.models.get(model_id)
        if served is None or not user.owns(served.owner):
            self.ended.check(model_id, kind="model id", user=user)
            raise NotFound(f"unknown model id {model_id!r}")
        served.last_request_time = _now()
        self._seen(served.session_id)
        return served

    def training(self, served: ServedModel) -> TrainingBackend:
        """The model's backend client; called on its queue, after the creating request."""
        if served.training is None:
            raise NotFound(f"model {served.model_id!r} failed to be created")
        return served.training

    def sampling_session(self, sampling_session_id: str, *, user: User) -> SamplingSession:
        request_log.note(sampler=sampling_session_id)
        sampling = self.sampling_sessions.get(sampling_session_id)
        if sampling is None or not user.owns(sampling.owner):
            self.ended.check(sampling_session_id, kind="sampling session", user=user)
            raise NotFound(f"unknown sampling session {sampling_session_id!r}")
        if self.snapshots.use(sampling_session_id) is not None:  # idle too long: evicted now
            self.forget_snapshots([sampling_session_id])
            self.ended.check(sampling_session_id, kind="sampling session", user=user)
        self._seen(sampling.session_id)
        return sampling

    def _seen(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_seen = time.monotonic()

    # -- per-user limits (429 naming the setting) ---------------------------------------------

    def check_room(self, user: User, *, kind: Held) -> None:
        """429 if `user` holds as many `kind`s as its limit allows, once its silent sessions
        (`end_silent_sessions`) have let go of theirs."""
        limit, setting = self._limit(kind)
        if self._held(user, kind) >= limit:
            self.end_silent_sessions(user)
        if self._held(user, kind) >= limit:
            raise TooManyRequests(
                f"user {user.name!r} holds {limit} live {kind}, its limit (--{setting}); "
                "finish or release some first"
            )

    def end_silent_sessions(self, user: User, *, now: float | None = None) -> list[str]:
        """End `user`'s sessions whose client showed no sign of life for `session_silent_s`
        (a script that died: its heartbeats stopped), as expiry would later; their ids."""
        now = time.monotonic() if now is None else now
        silent_s = self.config.session_silent_s
        silent = [
            session
            for session in list(self.sessions.values())
            if session.user == user.name and now - session.last_seen > silent_s
        ]
        for session in silent:
            self.end_session(
                session.session_id,
                why=f"ended: no heartbeat for {now - session.last_seen:.0f} s "
                f"(--session-silent-s {silent_s:g}) when its user needed room under a "
                "--max-*-per-user limit; its checkpoints are kept",
            )
            log.info(
                "session %s of %s ended early: silent, its user at a limit",
                session.session_id,
                user.name,
            )
        return [session.session_id for session in silent]

    def _limit(self, kind: Held) -> tuple[int, str]:
        config = self.config
        if kind == "sessions":
            return config.max_sessions_per_user, "max-sessions-per-user"
        if kind == "models":
            return config.max_models_per_user, "max-models-per-user"
        return config.max_sampling_sessions_per_user, "max-sampling-sessions-per-user"

    def _held(self, user: User, kind: Held) -> int:
        if kind == "sessions":
            owners = [session.user for session in self.sessions.values()]
        elif kind == "models":
            owners = [served.owner for served in self.models.values()]
        else:
            owners = [sampling.owner for sampling in self.sampling_sessions.values()]
        return owners.count(user.name)

    def base_model(self, name: str) -> BaseModel:
        """The served base model `name` names (404 naming the served ones otherwise)."""
        return self.base_models.resolve(name)

    def served_names(self) -> str:
        return ", ".join(model.name for model in self.base_models)

    def check_queue_room(self, user: User) -> None:
        """429 (which the SDK retries) if `user` has as many unfinished requests as its
        limit allows."""
        limit = self.config.max_queued_requests_per_user
        if self.scheduler.queued(user.name) >= limit:
            raise TooManyRequests(
                f"user {user.name!r} has {limit} unfinished requests, its limit "
                "(--max-queued-requests-per-user); retry once some finish",
                retry=True,
            )

    # -- registration -----------------------------------------------------------------------
    def add_model(self, served: ServedModel) -> None:
        """Register a training model, counting its memory (503 if it cannot fit): its own
        part, and for the first LoRA model on a base, the base weights they all share."""
        base = served.base
        # A sharded trainer (--nproc) gives every model its own base (client/shared_base.py).
        shares_base = self.adapter_room.shares_base(served)
        shares_sampler = self.adapter_room.shares_sampler(served)
        released = []
        with self._shared_lock:
            users = self._shared_base_users.setdefault(base.name, set())
            try:
                if shares_base and not users:
                    released += self.memory.admit(
                        _shared_base_key(base.name),
                        base_model=base.name,
                        what="base weights and sampler its LoRA models share"
                        if shares_sampler
                        else "base weights its LoRA models share",
                        num_bytes=base.shared_bytes(shared_sampler=shares_sampler),
                        pinned=True,
                    )
                released += self.memory.admit(
                    served.model_id,
                    base_model=base.name,
                    what=f"training model {served.model_id}",
                    num_bytes=base.training_bytes(
                        lora_rank=served.lora_rank,
                        shared_base=shares_base,
                        shared_sampler=shares_sampler,
                        sampler_reads_trainer=self.adapter_room.sampler_reads_trainer(),
                        sampler=not self.adapter_room.samplers_on_generator_ranks(),
                    ),
                    pinned=True,
                )
            except BaseException:
                if not users:
                    self.memory.release(_shared_base_key(base.name))
                raise
            finally:
                for key in released:
                    self._shared_samplers.pop(key, None)
            if shares_base:
                users.add(served.model_id)
        self.models[served.model_id] = served
        self.sessions[served.session_id].model_ids.append(served.model_id)

    def admit_inflight(self, served: ServedModel) -> None:
        """Count `served`'s in-flight target (client/inflight.py) at its first in-flight save
        (503 if it cannot fit), held until the model is dropped: on the base's multi-LoRA
        sampler two adapter versions (the one decoding and a newer one offered), else a
        sampler copy of its own, as an older snapshot's. On generator ranks their budgets
        count it (server/generators/budget.py), not this one."""
        if self.adapter_room.samplers_on_generator_ranks():
            return
        key = _inflight_key(served.model_id)
        with self._shared_lock:
            if self.memory.holds(key):
                return
            base = served.base
            if self.adapter_room.shares_sampler(served):
                num_bytes = 2 * served.lora_rank * base.lora_bytes_per_rank
            else:
                num_bytes = base.sampler_copy_bytes(lora=served.is_lora)
            released = self.memory.admit(
                key,
                base_model=base.name,
                what=f"in-flight sampler of {served.model_id}",
                num_bytes=num_bytes,
                pinned=True,
            )
            for released_key in released:
                self._shared_samplers.pop(released_key, None)

    def drop_model(self, model_id: str) -> None:
        served = self.models.pop(model_id, None)
        self.scheduler.close_queue(model_id)
        self.memory.release(model_id)
        self.memory.release(_inflight_key(model_id))
        if served is not None:
            with self._shared_lock:
                users = self._shared_base_users.get(served.base.name, set())
                if model_id in users:
                    users.discard(model_id)
                    if not users:
                        self.memory.release(_shared_base_key(served.base.name))

    def check_checkpoint_base(self, served: ServedModel, run: dict) -> None:
        """400 if a checkpoint's run trained another base model than `served`."""
        base = self.base_model(run["base_model"])
        if base is not served.base:
            raise BadRequest(
                f"the checkpoint was trained on base model {base.name!r}, but model "
                f"{served.model_id!r} trains {served.base.name!r}; load it with "
                "create_training_client_from_state instead"
            )

    def add_sampling_session(self, session_id: str | None, sampling: SamplingSession) -> None:
        self.sampling_sessions[sampling.sampling_session_id] = sampling
        session = self.sessions.get(session_id)
        if session is not None:
            ids = session.sampling_session_ids
            ids.append(sampling.sampling_session_id)
            if len(ids) > 64 and len(ids) > 2 * len(self.sampling_sessions):
                # An RL loop takes a snapshot per step: forget the ids already evicted.
                session.sampling_session_ids = [i for i in ids if i in self.sampling_sessions]

    def make_room_for_snapshot(self, served: ServedModel) -> None:
        """Evict the snapshots the retention rules drop before `served` takes one (a live
        one would make the backend copy its sampler at the next weight change), and on a
        multi-LoRA sampler those that make room for its adapters (adapter_room.py)."""
        self.forget_snapshots(self.snapshots.make_room(served.model_id))
        self.adapter_room.make_room(
            served, lora_models=self.lora_models_on(served.base.name), forget=self.forget_snapshots
        )

    def check_snapshot_room(self, served: ServedModel) -> None:
        """429 before queueing a snapshot its multi-LoRA sampler will have no room for."""
        self.adapter_room.check_room(served, lora_models=self.lora_models_on(served.base.name))

    def lora_models_on(self, base_name: str) -> set[str]:
        with self._shared_lock:
            return set(self._shared_base_users.get(base_name, ()))

    def forget_snapshots(self, snapshot_ids: list[str]) -> None:
        """Drop snapshots the retention rules evicted; their ids answer 404 saying why."""
        for snapshot_id in snapshot_ids:
            sampling = self.sampling_sessions.pop(snapshot_id, None)
            if sampling is not None:
                why = self.snapshots.use(snapshot_id) or "evicted"
                self.ended.add([snapshot_id], owner=sampling.owner, what=why, gone=False)

    def add_snapshot(self, served: ServedModel, sampling: SamplingSession) -> None:
        self.add_sampling_session(served.session_id, sampling)
        copy_bytes = self.adapter_room.snapshot_bytes(served)
        self.snapshots.add(
            sampling.sampling_session_id, model_id=served.model_id, copy_bytes=copy_bytes
        )

    def sweep(self, *, now: datetime.datetime | None = None) -> list[str]:
        """Delete the checkpoints whose TTL ran out and drop idle snapshots; returns the
        deleted checkpoint paths (the periodic sweep calls this)."""
        self.forget_snapshots(self.snapshots.evict_idle())
        self._forget_released(self.memory.release_idle())
        deleted = []
        for path in self.catalog.expiry.expired(at=now or _now()):
            try:
                self.catalog.delete(str(path), user=SERVER)
            except NotFound:  # deleted by hand meanwhile
                self.catalog.expiry.set(path, expires_at=None)
                continue
            self.forget_sampler(str(path))
            deleted.append(str(path))
        return deleted

    def loaded_client(self, sampling: SamplingSession) -> SamplingBackend | None:
        """The session's backend client if it is loaded (a snapshot's always is)."""
        if sampling.client is not None:
            return sampling.client
        with self._shared_lock:
            client = self._shared_samplers.get(sampling.lineage)
        if client is not None:
            self.memory.use(sampling.lineage)
        return client

    def load_client(self, sampling: SamplingSession) -> SamplingBackend:
        """The session's backend client, loading its shared sampler if it was released
        (blocks while it loads; 503 if it cannot fit)."""
        if sampling.client is not None:
            return sampling.client
        if sampling.model_path is not None:
            return self.shared_sampler(
                sampling.model_path,
                base=self.base_model(sampling.base_model),
                model_path=sampling.model_path,
            )
        return self.shared_sampler(sampling.base_model, base=self.base_model(sampling.base_model))

    def shared_sampler(
        self, key: str, *, base: BaseModel, model_path: str | None = None
    ) -> SamplingBackend:
        """One backend sampling client per base model / sampler checkpoint (thread-safe),
        built on first use within the model memory budget (503 if it cannot fit; on
        generator ranks, within theirs)."""
        with self._shared_lock:
            if key in self._shared_samplers:
                self.memory.use(key)
                return self._shared_samplers[key]
            counted = not self.adapter_room.samplers_on_generator_ranks()
            if counted:
                what = f"sampler of {model_path or 'the base model'}"
                released = self.memory.admit(
                    key, base_model=base.name, what=what, num_bytes=base.sampler_bytes, pinned=False
                )
                for released_key in released:
                    self._shared_samplers.pop(released_key, None)
            try:
                if model_path is not None:
                    client = self.backend.create_sampling_client(model_path=model_path)
                else:
                    client = self.backend.create_sampling_client(base_model=base.name)
            except BaseException:
                if counted:
                    self.memory.release(key)
                raise
            self._shared_samplers[key] = client
            return client

    def forget_sampler(self, key: str) -> None:
        with self._shared_lock:
            self._shared_samplers.pop(key, None)
        self.memory.release(key)

    def _forget_released(self, keys: list[str]) -> None:
        """Drop the shared samplers the memory budget released."""
        with self._shared_lock:
            for key in keys:
                self._shared_samplers.pop(key, None)

    def end_session(self, session_id: str, *, why: str) -> None:
        """Release everything the session holds (checkpoints stay); its ids then answer 410
        with `why` ('finished by its client', say)."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        for model_id in session.model_ids:
            self.drop_model(model_id)
            self.snapshots.drop_model(model_id)
        for sampling_session_id in session.sampling_session_ids:
            self.sampling_sessions.pop(sampling_session_id, None)
        self.scheduler.drop_scope(session_id, sampling_session_ids=session.sampling_session_ids)
        self.stability.drop_session(session_id)
        what = f"session {session_id} {why}"
        ids = [session_id, *session.model_ids, *session.sampling_session_ids]
        self.ended.add(ids, owner=session.user, what=what)

    def expire_sessions(self, *, now: float | None = None) -> list[str]:
        """End the sessions whose client showed no sign of life for `session_timeout_s`;
        returns their ids."""
        now = time.monotonic() if now is None else now
        timeout = self.config.session_timeout_s
        stale = [
            session for session in list(self.sessions.values()) if now - session.last_seen > timeout
        ]
        for session in stale:
            idle = now - session.last_seen
            self.end_session(
                session.session_id,
                why=f"expired: no heartbeat for {idle:.0f} s (--session-timeout-s {timeout:g}); "
                "its checkpoints are kept",
            )
        return [session.session_id for session in stale]

    def describe(self) -> dict[str, Any]:
        return {
            "models": [describe(model) for model in self.base_models],
            "loaded_mib": {name: round(n / MIB, 1) for name, n in self.memory.loaded().items()},
            "model_memory_mib": round(self.memory.budget_bytes / MIB, 1),
            "fine_tuning": self.config.fine_tuning,
            "compute_threads": torch.get_num_threads(),
            "snapshot_copy_mib": round(self.snapshots.copy_bytes / MIB, 1),
            "snapshot_memory_mib": round(self.snapshots.budget_bytes / MIB, 1),
        }


def in_process_backend(config: ServerConfig, storage: CheckpointStorage) -> ServiceBackend:
    """The default backend: an in-process `ServiceClient` on the server's settings."""
    from temper.client.service_client import ServiceClient

    sampler = config.sampler_config()
    if config.device == "cpu":
        threads = config.cpu_threads()  # read once: it depends on torch's count
        # Before the backend starts its worker threads: they read this once.
        torch.set_num_threads(threads)
        # Sampler helper processes ('auto': a core each) keep within those cores.
        sampler = replace(sampler, cpu=sampler.cpu.with_auto_processes_at_most(threads))
    return ServiceClient(
        storage_dir=storage.root,
        device=config.device,
        dtype=config.dtype,
        trainer=config.trainer,
        sampler=sampler,
        generator=config.generator,
        multi_lora=config.multi_lora,
    )


def model_budget_bytes(config: ServerConfig, *, device_bytes: int) -> int:
    """The model memory budget of one rank (rank 0 holds the most: its shard of every
    training model, as every rank does, and the samplers): `model_memory_mb`, or half the
    device's memory, on CPU half the machine's RAM over the ranks that share it."""
    if config.model_memory_mb is not None:
        return int(config.model_memory_mb * MIB)
    if torch.device(config.device).type == "cpu" and dist.is_initialized():
        ranks = dist.get_world_size()
        if config.placement.mode == "disaggregated":  # processes of their own, not in the group
            ranks += config.placement.generator_ranks
        device_bytes //= ranks
    return device_bytes // 2


def snapshot_retention(
    config: ServerConfig, base_models: BaseModels, *, device_bytes: int
) -> SnapshotRetention:
    """One budget for every model's snapshots: each counts as the largest model's copy."""
    copy_bytes = base_models.largest_sampler_copy(lora=config.fine_tuning == "lora")
    budget_mb = config.snapshot_memory_mb
    retention = SnapshotRetention(
        copy_bytes=copy_bytes,
        budget_bytes=device_bytes // 4 if budget_mb is None else int(budget_mb * MIB),
        idle_seconds=config.snapshot_idle_seconds,
    )
    retention.log_settings()
    return retention


def _inflight_key(model_id: str) -> str:
    """The memory budget's key for a training model's in-flight target."""
    return f"in-flight target of {model_id}"


def _shared_base_key(base_model: str) -> str:
    """The memory budget's key for the base weights LoRA models on `base_model` share."""
    return f"shared base weights of {base_model}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)
