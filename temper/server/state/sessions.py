"""What the server holds for its clients: sessions, their training models and sampling
sessions, each with the user who owns it (server.py keeps them; lifetimes.py ends them)."""

from __future__ import annotations

import asyncio
import datetime
import time
from dataclasses import dataclass, field

from temper.api.backend import SamplingBackend, TrainingBackend
from temper.server.state.base_models import BaseModel


@dataclass
class ServedModel:
    model_id: str
    session_id: str
    owner: str
    """The user whose session created it."""
    base: BaseModel
    is_lora: bool
    lora_rank: int | None
    training: TrainingBackend | None = None
    """Set once the creating request has run on the model's queue."""
    last_request_time: datetime.datetime = field(default_factory=lambda: _now())


@dataclass(frozen=True)
class SamplingSession:
    sampling_session_id: str
    client: SamplingBackend | None
    """A snapshot's own client; None for a session on a base model or sampler checkpoint,
    which samples on the shared sampler of its `lineage` (loaded again after a release)."""
    base_model: str
    model_path: str | None
    lineage: str
    """What its samples batch like: the training model of a snapshot, else the checkpoint
    path or base model (the coalescer expects each burst of a lineage to match the last)."""
    session_id: str
    """The session that created it: it owns the sequences recorded from it."""
    owner: str
    """The user of that session."""


@dataclass(frozen=True)
class SamplingCreation:
    """One create_sampling_session request of a session: what it asked for, and its answer
    (the sampling session id) once the sampler has loaded."""

    request: tuple[str | None, str | None]
    """(base_model, model_path) as sent."""
    sampling_session_id: asyncio.Future[str]


@dataclass
class Session:
    session_id: str
    user: str
    """The user whose key created it."""
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    project_id: str | None = None
    """Recorded and logged only: this server has no projects (access is per user)."""
    sampling_by_seq_id: dict[int, SamplingCreation] = field(default_factory=dict)
    """create_sampling_session's answer per `sampling_session_seq_id`, so a retried request
    (the SDK resends one whose answer was lost) gets the same sampling session."""
    model_ids: list[str] = field(default_factory=list)
    sampling_session_ids: list[str] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)
    """When its client last showed it is alive (a heartbeat or a request on its ids)."""
    created_at: datetime.datetime = field(default_factory=lambda: _now())


def _now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)
