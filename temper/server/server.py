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
created it (users.py); another user's ids answer 404 as if they did not exist."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import torch
import tyro

from temper.api.backend import SamplingBackend, ServiceBackend, TrainingBackend
from temper.checkpoint.storage import CheckpointStorage
from temper.config.checks import check_range
from temper.config.configurable import Configurable
from temper.generator.choice import GeneratorChoice
from temper.generator.multi_lora import MultiLoraSampler
from temper.observability.process_memory import device_memory_bytes
from temper.sampler.engine import SamplerEngine
from temper.server import adapter_room, request_log
from temper.server.base_models import (
    BaseModel,
    BaseModels,
    ModelLimits,
    describe,
    load_base_model,
    model_dirs,
)
from temper.server.catalog import CheckpointCatalog
from temper.server.errors import BadRequest, NotFound, TooManyRequests
from temper.server.lifetimes import EndedIds
from temper.server.model_memory import ModelMemory
from temper.server.scheduler import Scheduler
from temper.server.sessions import SamplingSession, ServedModel, Session
from temper.server.snapshots import MIB, SnapshotRetention
from temper.server.stability import StabilityStore
from temper.server.users import SERVER, User, Users
from temper.trainer.engine import TrainerEngine

__all__ = ["ModelLimits", "SamplingSession", "ServedModel", "Session", "TemperServer"]

log = logging.getLogger("temper.server")
Repeated = tyro.conf.UseAppendAction
STALE_STAGING_S = 600.0
"""Age past which a checkpoint staging directory in --storage counts as a killed save's."""


class TemperServer(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        model: Annotated[list[str], Repeated] = field(default_factory=list)
        """HF model directory to serve, trainable and sampleable (`temper init-model DIR`
        writes a small one). Repeat to serve several; each loads on first use."""
        sample_only_model: Annotated[list[str], Repeated] = field(default_factory=list)
        """HF model directory served for sampling and prompt logprobs only (a teacher, grader
        or answerer); create_model on it is refused. Repeatable."""
        models_dir: str | None = None
        """Also serve every HF model directory (one with a config.json) inside this one,
        trainable (unless also given as --sample-only-model)."""
        model_memory_mb: float | None = None
        """Memory budget for loaded base models: each training model counts its trainer's
        weights (x4 with --fine-tuning full) and a sampler, each shared sampler (a base model's
        or a sampler checkpoint's) its weights and KV cache. A request that cannot fit once
        idle samplers are released answers 503 naming what holds the budget. None: half the
        device's memory (--device cuda: the GPU's; cpu: the machine's RAM)."""
        model_idle_seconds: float = 600.0
        """A base model or checkpoint sampler not sampled for this long is released (its
        sampling sessions stay valid and load it again); a base model with no training model
        and no sampler left is unloaded."""
        host: str = "127.0.0.1"
        """Address to bind. Any address other than loopback requires --key-file or --api-key."""
        port: int = 8000
        """TCP port."""
        storage: str = "~/.cache/temper/checkpoints"
        """Directory that holds checkpoints; tinker:// paths saved here load after a restart."""
        api_key: str | None = None
        """Require this X-API-Key (must start with 'tml-', as the tinker SDK checks): the key
        of the user 'default' (who, without --key-file, is the only one and sees all)."""
        key_file: str | None = None
        """JSON file of users and their key digests (`temper users add NAME --key-file F`
        writes it). Each user sees and uses only the sessions, models, sampling sessions,
        futures and checkpoints it created (others' ids answer 404); an admin sees all.
        Re-read on SIGHUP and on POST /api/v1/admin/reload_keys."""
        session_timeout_s: float = 180.0
        """A session whose client shows no sign of life (the tinker SDK heartbeats every
        10 s) for this long expires: its models, sampling sessions, snapshots and queued
        requests are released (checkpoints stay) and its ids answer 410 saying so."""
        max_sessions_per_user: int = 64
        """Most live sessions one user may hold (429 beyond, naming this setting)."""
        max_models_per_user: int = 16
        """Most live training models one user may hold (429 beyond)."""
        max_sampling_sessions_per_user: int = 1024
        """Most live sampling sessions (snapshots included) one user may hold (429 beyond)."""
        max_queued_requests_per_user: int = 4096
        """Most unfinished requests one user may have queued (429 beyond; retried by the
        SDK, as the queue drains)."""
        max_body_mb: float = 256.0
        """Largest request body of forward_backward and forward (413 beyond); asample takes
        at most 32 MiB (or this, if less), other routes 1 MiB."""
        fine_tuning: Literal["lora", "full"] = "lora"
        """'lora': create_lora_training_client trains LoRA adapters (Tinker); 'full': it
        trains every weight instead (the LoRA config is then ignored)."""
        device: str = "cpu"
        """Device for models, e.g. 'cpu' or 'cuda'."""
        dtype: Literal["float32", "bfloat16"] = "float32"
        """Parameter dtype."""
        compute_threads: int | None = None
        """torch threads, and at most as many sampler processes, with --device cpu. None: one
        fewer than torch's default (OMP_NUM_THREADS, else the physical cores), at least 1, so
        the HTTP event loop and the clients on this machine keep a core (requests wait on it)."""
        poll_seconds: float = 20.0
        """Longest hold of a retrieve_future long poll before answering try_again."""
        result_ttl_s: float = 900.0
        """How long a finished request's result stays retrievable."""
        sample_window_s: float = 0.005
        """Samples for one sampler arriving less than this apart are submitted together, so
        the backend decodes them as one batch (an RL step sends a group per prompt at once)."""
        sample_max_hold_s: float = 0.1
        """Longest a sample waits for more to batch with (a steady stream still starts); also
        the gap after which a client's next sample opens a new burst."""
        snapshot_memory_mb: float | None = None
        """Memory budget for older sampling snapshots (save_weights_and_get_sampling_client):
        each live one but its model's newest holds a sampler copy (weights + KV cache) once
        the weights change; taking a snapshot first evicts the least recently sampled ones
        until the copies fit (sampling on an evicted one answers 404 saying why). None: a
        quarter of the device's memory (--device cuda: the GPU's; cpu: the machine's RAM)."""
        snapshot_idle_seconds: float = 3600.0
        """A sampling snapshot not sampled for this long expires (404 saying why)."""
        checkpoint_sweep_seconds: float = 60.0
        """How often expired checkpoints (ttl_seconds) are deleted and idle snapshots dropped."""
        log_level: Literal["debug", "info", "warning", "error"] = "info"
        """Server log level on stderr; 'info' logs one line per request."""
        stability: StabilityStore.Config = field(default_factory=StabilityStore.Config)
        """Sequences sampled with record_stability_info, for stable_reinforce."""
        trainer: TrainerEngine.Config = field(default_factory=TrainerEngine.Config)
        sampler: SamplerEngine.Config = field(default_factory=SamplerEngine.Config)
        """Temper's sampling engine (generator backend 'temper')."""
        generator: GeneratorChoice.Config = field(default_factory=GeneratorChoice.Config)
        """The generator backend: Temper's engine (set up by `sampler`) or vLLM (set up by
        `generator.vllm`; one process only, not with --nproc)."""
        multi_lora: MultiLoraSampler.Config = field(default_factory=MultiLoraSampler.Config)
        """One sampler per base model for its LoRA models' snapshots (Temper's engine;
        adapter_room.py); a snapshot holds a copy of its adapters."""

        def cpu_threads(self) -> int:
            """torch threads on --device cpu: `compute_threads`, or one fewer than torch's."""
            return self.compute_threads or max(1, torch.get_num_threads() - 1)

        def __post_init__(self) -> None:
            if isinstance(self.model, str):  # Config(model="dir"): one model, as a string
                self.model = [self.model]
            if not (self.model or self.sample_only_model or self.models_dir):
                raise ValueError(
                    "TemperServer.Config: give a model to serve: --model DIR (repeatable), "
                    "--sample-only-model DIR or --models-dir DIR"
                )
            owner = "TemperServer.Config"
            memory_defaults = {
                "model_memory_mb": "half the device's memory",
                "snapshot_memory_mb": "a quarter of the device's memory",
            }
            for memory, default in memory_defaults.items():
                value = getattr(self, memory)
                check_range(
                    value, field=f"{owner}.{memory}", at_least=0, also=(None,), hint=default
                )
            check_range(
                self.poll_seconds,
                field=f"{owner}.poll_seconds",
                greater_than=0,
                at_most=40,
                hint="the SDK times a poll out at 45 s",
            )
            positive = ("snapshot_idle_seconds", "checkpoint_sweep_seconds", "model_idle_seconds")
            for field_name in (*positive, "max_body_mb"):
                check_range(
                    getattr(self, field_name), field=f"{owner}.{field_name}", greater_than=0
                )
            check_range(
                self.sample_window_s,
                field=f"{owner}.sample_window_s",
                at_least=0,
                at_most=self.sample_max_hold_s,
                hint="at most sample_max_hold_s",
            )
            check_range(
                self.compute_threads, field=f"{owner}.compute_threads", at_least=1, also=(None,)
            )
            for limit in (
                "max_sessions_per_user",
                "max_models_per_user",
                "max_sampling_sessions_per_user",
                "max_queued_requests_per_user",
            ):
                check_range(getattr(self, limit), field=f"{owner}.{limit}", at_least=1)
            check_range(
                self.session_timeout_s,
                field=f"{owner}.session_timeout_s",
                greater_than=0,
                hint="the tinker SDK heartbeats every 10 s",
            )
            check_range(self.port, field=f"{owner}.port", integer=True, at_least=0, at_most=65535)

    def __init__(self, config: Config, *, backend: ServiceBackend | None = None) -> None:
        self.config = config
        self.users = Users(api_key=config.api_key, key_file=config.key_file)
        dirs = model_dirs(
            models=config.model, sample_only=config.sample_only_model, models_dir=config.models_dir
        )
        self.base_models = BaseModels(
            [
                load_base_model(
                    path, trainable=trainable, sampler=config.sampler, dtype=config.dtype
                )
                for path, trainable in dirs
            ]
        )
        budget_mb, device_bytes = config.model_memory_mb, device_memory_bytes(config.device)
        self.memory = ModelMemory(
            budget_bytes=device_bytes // 2 if budget_mb is None else int(budget_mb * MIB),
            idle_seconds=config.model_idle_seconds,
        )
        storage = CheckpointStorage(config.storage)
        # Saves a killed server left midway; a younger one may be another server's, still saving.
        storage.clear_interrupted(older_than_s=STALE_STAGING_S)
        self.catalog = CheckpointCatalog(storage)
        if backend is None:
            from temper.client.service_client import ServiceClient

            sampler = config.sampler
            if config.device == "cpu":
                threads = config.cpu_threads()  # read once: it depends on torch's count
                # Before the backend starts its worker threads: they read this once.
                torch.set_num_threads(threads)
                # Sampler helper processes ('auto': a core each) keep within those cores.
                sampler = replace(sampler, cpu=sampler.cpu.with_auto_processes_at_most(threads))
            backend = ServiceClient(
                storage_dir=storage.root,
                device=config.device,
                dtype=config.dtype,
                trainer=config.trainer,
                sampler=sampler,
                generator=config.generator,
                multi_lora=config.multi_lora,
            )
        self.backend = backend
        self.scheduler = Scheduler(result_ttl_s=config.result_ttl_s)
        self.stability = config.stability.build()
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, ServedModel] = {}
        self.sampling_sessions: dict[str, SamplingSession] = {}
        self.ended = EndedIds()
        # One budget for every model's snapshots: each counts as the largest model's copy.
        copy_bytes = self.base_models.largest_sampler_copy(lora=config.fine_tuning == "lora")
        budget_mb = config.snapshot_memory_mb
        self.snapshots = SnapshotRetention(
            copy_bytes=copy_bytes,
            budget_bytes=device_bytes // 4 if budget_mb is None else int(budget_mb * MIB),
            idle_seconds=config.snapshot_idle_seconds,
        )
        self.snapshots.log_settings()
        self._shared_samplers: dict[str, SamplingBackend] = {}
        # The LoRA training models on each base model, which share its weights (counted once).
        self._shared_base_users: dict[str, set[str]] = {}
        self._shared_lock = threading.Lock()

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

    def check_room(self, user: User, *, kind: str) -> None:
        """429 if `user` holds as many `kind`s ('sessions', 'models', 'sampling sessions') as
        its limit allows."""
        held = {
            "sessions": lambda: self.sessions.values(),
            "models": lambda: self.models.values(),
            "sampling sessions": lambda: self.sampling_sessions.values(),
        }[kind]()
        owner_of = {"sessions": lambda x: x.user}.get(kind, lambda x: x.owner)
        setting = "max_" + kind.replace(" ", "_") + "_per_user"
        limit = getattr(self.config, setting)
        if sum(1 for item in held if owner_of(item) == user.name) >= limit:
            raise TooManyRequests(
                f"user {user.name!r} holds {limit} live {kind}, its limit "
                f"(--{setting.replace('_', '-')}); finish or release some first"
            )

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
        shares_base = adapter_room.shares_base(self.config, served)
        shares_sampler = adapter_room.shares_sampler(self.config, served)
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
                        sampler_reads_trainer=adapter_room.sampler_reads_trainer(self.config),
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

    def drop_model(self, model_id: str) -> None:
        served = self.models.pop(model_id, None)
        self.scheduler.close_queue(model_id)
        self.memory.release(model_id)
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
        adapter_room.make_room(self, served)

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
        copy_bytes = adapter_room.snapshot_bytes(self.config, served)
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
        built on first use within the model memory budget (503 if it cannot fit)."""
        with self._shared_lock:
            if key in self._shared_samplers:
                self.memory.use(key)
                return self._shared_samplers[key]
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
        self.scheduler.drop_scope(session_id)
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


def _shared_base_key(base_model: str) -> str:
    """The memory budget's key for the base weights LoRA models on `base_model` share."""
    return f"shared base weights of {base_model}"


def _now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)
