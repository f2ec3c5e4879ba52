"""`TemperServer.Config`: every setting of `temper serve` (its flags are these fields).

It lives in a module of its own so that the policies the server owns (adapter_room.py, say)
read the settings without importing the server; `TemperServer.Config` is this class.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Annotated, Literal

import torch
import tyro

from temper.api.types import RoutingReplay
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.distributed.placement import Placement
from temper.generator.choice import GeneratorChoice
from temper.generator.multi_lora import MultiLoraSampler
from temper.sampler.engine import SamplerEngine
from temper.server.state.stability import StabilityStore
from temper.trainer.engine import TrainerEngine
from temper.trainer.routing_replay import ROUTING_REPLAY_CHOICES

Repeated = tyro.conf.UseAppendAction


@dataclass(kw_only=True)
class ServerConfig(Configurable.Config):
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
    session_silent_s: float = 30.0
    """A user at one of its --max-*-per-user limits first gets back what its sessions silent
    for this long hold (three missed SDK heartbeats: a script that died): they end as if
    expired, their models and sampling sessions released (checkpoints stay)."""
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
    routing_replay: RoutingReplay = "off"
    """MoE models: 'sampler' records the experts every sampled token was routed to
    (sampler.record_routes) with the sequences sampled with record_stability_info, and
    trains a request through those experts, whatever its loss, when every datum's
    provenance names a recorded sequence whose tokens are the datum's input (routing replay,
    docs/server.md); 'off': the trainer's router routes."""
    trainer: TrainerEngine.Config = field(default_factory=TrainerEngine.Config)
    sampler: SamplerEngine.Config = field(default_factory=SamplerEngine.Config)
    """Temper's sampling engine (generator backend 'temper')."""
    generator: GeneratorChoice.Config = field(default_factory=GeneratorChoice.Config)
    """The generator backend: Temper's engine (set up by `sampler`) or vLLM (set up by
    `generator.vllm`): in one process, or on each generator rank of a disaggregated
    placement; not on colocated --nproc ranks."""
    multi_lora: MultiLoraSampler.Config = field(default_factory=MultiLoraSampler.Config)
    """One sampler per base model for its LoRA models' snapshots (Temper's engine, or one vLLM
    engine with --generator.backend vllm; adapter_room.py); a snapshot holds one version of
    its adapters."""
    placement: Placement.Config = field(default_factory=Placement.Config)
    """With --nproc N: 'colocated' (every rank trains, rank 0 samples) or 'disaggregated'
    (the last `generator_ranks` ranks serve every sampling call, the others train; a
    generator rank that dies leaves the server serving). docs/server.md "Several ranks"."""

    def sampler_config(self) -> SamplerEngine.Config:
        """The engines' settings: `sampler`, recording routes when the server replays them."""
        if self.routing_replay == "sampler":
            return replace(self.sampler, record_routes=True)
        return self.sampler

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
            check_range(value, field=f"{owner}.{memory}", at_least=0, also=(None,), hint=default)
        check_range(
            self.poll_seconds,
            field=f"{owner}.poll_seconds",
            greater_than=0,
            at_most=40,
            hint="the SDK times a poll out at 45 s",
        )
        positive = ("snapshot_idle_seconds", "checkpoint_sweep_seconds", "model_idle_seconds")
        for field_name in (*positive, "max_body_mb"):
            check_range(getattr(self, field_name), field=f"{owner}.{field_name}", greater_than=0)
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
        check_range(
            self.session_silent_s,
            field=f"{owner}.session_silent_s",
            greater_than=0,
            hint="the tinker SDK heartbeats every 10 s",
        )
        check_range(self.port, field=f"{owner}.port", integer=True, at_least=0, at_most=65535)
        check_choice(
            self.routing_replay, field=f"{owner}.routing_replay", choices=ROUTING_REPLAY_CHOICES
        )
        if self.routing_replay != "off" and self.generator.backend != "temper":
            raise ValueError(
                f"{owner}.routing_replay={self.routing_replay!r} needs the sampler's routes, "
                f"which only {owner}.generator.backend='temper' records"
            )
