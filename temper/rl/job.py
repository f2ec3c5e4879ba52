"""The RL job (GRPO-style), written only against the public client API.

One step: a sampling client on the current weights -> `rl.group_size` episodes for each of
`rl.prompts_per_step` groups from the env source (a single-turn task's problems or a multi-turn
environment's episodes, one rollout path: episodes.py) -> rewards -> group-relative advantages
(optionally a KL penalty to the initial policy) -> `forward_backward(loss_fn)` -> `optim_step`.
An optional supervised warm-up on the source's demonstrations runs first; held-out evaluations
play the source's held-out episodes (evaluation.py). The step functions and their settings
(`RLSteps.Config`, the job config's `rl`) live in steps.py and the loops that run them in
loops.py: lock-step (`mode="sync"`) or sampling overlapped with training (`mode="async"`).
This module sets a run up and runs its phases (warm-up, RL, finish), each a method of
`_RLRun`. The same job runs in-process (here) or against a Tinker-compatible server.

Several ranks (SPMD, `temper train RECIPE --nproc N` or torchrun): every rank runs this job
with the trainer sharded over all ranks (`sharding`); each samples its share of every step's
groups and of the warm-up batches and evaluation problems, and metrics are combined over ranks
(steps.py). Rank 0 alone writes metrics.jsonl, rollouts.jsonl (run_logs.py), plots and the
run state; the training client's checkpoints are written by all ranks together (DCP).

Resume: every `checkpoint_every` steps (warm-up and RL steps counted together) the job saves
the training client's state and its `RLLoopState` (temper/job/run_checkpoints.py);
`run(run_dir=..., resume=True)` (`temper train --resume RUN_DIR`) continues from the last one,
bitwise equal to a run that never stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar, Literal

from temper.client.sampling_client import SamplingClient
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient
from temper.config.configurable import Configurable
from temper.distributed.placement import Placement
from temper.distributed.ranks import Ranks
from temper.distributed.world import using_trainer_world
from temper.generator.choice import GeneratorChoice
from temper.generator.remote import RemoteGenerators
from temper.job import (
    CHECKPOINTS_DIR,
    ModelChoice,
    RunCheckpoints,
    check_generator_model,
    check_generator_ranks,
    model_shapes,
    other_world_note,
    state_to_resume,
)
from temper.job.long_lived import long_lived_objects_frozen
from temper.job.memory_plan import MemoryPlan, PlanSettings, Role, plan_memory
from temper.job.placement import (
    memory_plan_line,
    plan_settings,
    rank_memory_gib,
    rank_sampler,
    remote_generators,
    serve_generator,
    split_roles,
)
from temper.models.common.decoder import DecoderConfig
from temper.observability import MetricsLogger
from temper.rl.env import EnvSource, ProblemSource
from temper.rl.envs import EnvConfig
from temper.rl.episodes import EpisodeRunner
from temper.rl.evaluation import HeldoutSuccess
from temper.rl.job_checks import check_job_config
from temper.rl.loop_state import RLLoopState, RLResult
from temper.rl.loops import run_async, run_sync
from temper.rl.run_logs import metrics_logger, open_rollouts, truncate_logs
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.tasks import SumDigits, TaskConfig
from temper.trainer.engine import TrainerEngine
from temper.trainer.sharding import Sharding


class RLJob(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        """The RL job: what it trains and on what, the steps' own settings (`rl`), the loop,
        and the engines. Bad settings fail when the config is made, before any model is
        built."""

        model: ModelChoice.Config = field(default_factory=ModelChoice.Config)
        """The model trained: base model, LoRA, device, dtype."""
        task: TaskConfig = field(default_factory=SumDigits.Config)
        """The single-turn task problems and rewards come from (unused when `env` is set)."""
        env: EnvConfig | None = None
        """A multi-turn environment source to roll out against instead of `task` (its
        episodes, held-out envs and warm-up demonstrations); None: the single-turn `task`."""
        episodes: EpisodeRunner.Config = field(default_factory=EpisodeRunner.Config)
        """How episodes run (turn and context limits, env step threads); a single-turn
        task's episodes are one turn each."""
        warmup: SFTWarmup.Config = field(default_factory=SFTWarmup.Config)
        """Supervised warm-up before RL."""
        rl: RLSteps.Config = field(default_factory=RLSteps.Config)
        """The RL steps: how many, problems and completions per step, sampling, loss,
        learning rate, advantages, KL penalty, evaluations."""
        mode: Literal["sync", "async", "inflight"] = "sync"
        """sync: sample, then train, every step. async: sample later steps while this one
        trains, from weights at most `max_staleness` steps old (the PPO / importance ratio
        against the sampler's logprobs corrects for the lag). inflight: as async, on one
        in-flight sampling target that every step's save moves on, also for the episodes
        still decoding (PipelineRL-style: temper/rl/loops.py)."""
        max_staleness: int = 1
        """async, inflight: how many RL steps older than the trained policy the sampling
        weights may be (0 behaves exactly like sync)."""
        checkpoint_every: int = 0
        """Steps (warm-up and RL together) between full-state checkpoints that
        `temper train --resume` continues from; 0 = only at the end."""
        eval_problems: int = 256
        """Held-out problems (episodes) per evaluation, in warm-up and RL (a fixed set)."""
        seed: int = 0
        """Seed of the problem stream, and of LoRA initialization unless `model.lora_seed`
        is set."""
        sampler: SamplerEngine.Config = field(
            default_factory=lambda: SamplerEngine.Config(
                max_batch=256,
                max_seq_len=64,
                cpu=CpuDecoding.Config(num_threads=1, processes="auto"),
            )
        )
        """Temper's sampling engine behind the sampling clients (generator backend 'temper').
        On CPU each rollout batch is split over one process per core (`cpu.processes`), each
        decoding on one thread."""
        generator: GeneratorChoice.Config = field(default_factory=GeneratorChoice.Config)
        """The generator backend: Temper's engine (set up by `sampler`) or vLLM (set up by
        `generator.vllm`)."""
        metrics: MetricsLogger.Config = field(
            default_factory=lambda: MetricsLogger.Config(
                progress_keys=("reward/mean", "eval/accuracy", "warmup/loss"), table_every=100
            )
        )
        """Console, metrics.jsonl and TensorBoard logging."""
        trainer: TrainerEngine.Config = field(default_factory=TrainerEngine.Config)
        """The engine behind the training client (micro-batch budget, shared prefixes, CPU
        thread shards). Its `sharding` stays unset: on several ranks `sharding` below applies,
        and thread shards are off (the ranks already use the cores)."""
        sharding: Sharding.Config = field(default_factory=Sharding.Config)
        """How the trainer is sharded when the job runs on several ranks (`--nproc N`,
        torchrun): data parallel (tp must be 1), and expert parallel for MoE models
        (`dims.ep`). Unused in one process."""
        placement: Placement.Config = field(default_factory=Placement.Config)
        """Where trainer and generator run on several ranks: 'colocated' (every rank does
        both) or 'disaggregated' (the last `placement.generator_ranks` ranks generate, the
        others train; weights are streamed to the generators after every step)."""
        sleep_generator: bool = False
        """Release the generator's KV cache while the trainer steps (colocated, mode 'sync'):
        less peak memory, a re-allocation before each sampling."""

        renamed_fields: ClassVar[Mapping[str, str]] = MappingProxyType(
            {f.name: f"rl.{f.name}" for f in dataclasses.fields(RLSteps.Config)}
        )
        """The steps' settings moved into `rl`: `temper train --group_size 8` says to give
        `--rl.group_size 8`."""

        def __post_init__(self) -> None:
            check_job_config(self)

        @property
        def total_steps(self) -> int:
            """Warm-up and RL steps together: the run's step count (logs, checkpoints)."""
            return self.warmup.steps + self.rl.steps

    runs_on_ranks: ClassVar[bool] = True
    """`temper train` may run this job on several ranks (torchrun, `--nproc`)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: Path, resume: bool = False) -> RLResult | None:
        """Train into `run_dir`; with `resume`, continue from its last checkpoint. Returns
        None on the generator ranks of a disaggregated placement (they only sample)."""
        # Before any collective or model, on every rank alike:
        self.check_model()
        placement = self.check_ranks(world_size=Ranks.world_size_now())
        if not placement.disaggregated:
            return self._run(run_dir=Path(run_dir), resume=resume, placement=placement)
        config = self.config
        roles = split_roles(placement, sharding=config.sharding, device=config.model.device)
        if roles.is_generator:
            serve_generator(
                roles,
                placement=config.placement,
                sampler=_sampler(config),
                generator=config.generator,
                device=config.model.device,
                on_start=lambda decoder: _log_memory_plan(
                    config, placement=placement, role="generator", decoder=decoder
                ),
            )
            return None
        remote = remote_generators(roles, placement=config.placement, device=config.model.device)
        with using_trainer_world(roles.trainer_world):
            try:
                return self._run(
                    run_dir=Path(run_dir), resume=resume, placement=placement, remote=remote
                )
            finally:
                remote.close()

    def check_model(self) -> None:
        """The settings refused for this model on this machine (a generator backend that
        cannot run it), from the model's config alone: by `temper train` before it writes the
        run directory, and by `run` before anything is built."""
        check_generator_model(self.config.model, self.config.generator)

    def check_ranks(self, *, world_size: int) -> Placement:
        """The settings that depend on the number of ranks (degrees, the placement's split,
        `prompts_per_step`), checked without any collective: by every rank, and by `temper
        train --nproc N` before it starts torchrun. Raises ValueError naming the field."""
        placement = Placement(self.config.placement, world_size=world_size)
        _check_ranks(self.config, num_ranks=placement.num_trainers)
        return placement

    def memory_plan(
        self, *, nproc_per_node: int, nnodes: int = 1, gpu_memory_gib: float, headroom: float
    ) -> MemoryPlan:
        """What each rank of this job on `nnodes` x `nproc_per_node` ranks would hold on a GPU
        of `gpu_memory_gib` (`temper plan`), from the config alone: the model's shapes come
        from its named size or its directory's config.json; nothing is built."""
        placement = self.check_ranks(world_size=nnodes * nproc_per_node)
        decoder = model_shapes(self.config.model)
        settings = _plan_settings(
            self.config,
            placement,
            nnodes=nnodes,
            gpu_memory_gib=gpu_memory_gib,
            headroom=headroom,
        )
        return plan_memory(settings, decoder=decoder)

    def _run(
        self,
        *,
        run_dir: Path,
        resume: bool,
        placement: Placement,
        remote: RemoteGenerators | None = None,
    ) -> RLResult:
        ranks = Ranks.current()
        run = _RLRun(self.config, run_dir=run_dir, resume=resume, ranks=ranks, remote=remote)
        _log_memory_plan(
            self.config,
            placement=placement,
            role="colocated" if remote is None else "trainer",
            decoder=run.training.engine.model.config,
        )
        with run.logger, long_lived_objects_frozen():
            run.warmup()
            run.reinforce()
            return run.finish()


class _RLRun:
    """One run of the job: set up (fresh, or resumed from the run's last checkpoint) when
    made, then its phases in order: `warmup`, `reinforce`, `finish`."""

    def __init__(
        self,
        config: RLJob.Config,
        *,
        run_dir: Path,
        resume: bool,
        ranks: Ranks,
        remote: RemoteGenerators | None,
    ) -> None:
        self.config, self.run_dir, self.ranks = config, run_dir, ranks
        model = config.model.build()
        self.service = _service_client(
            config, model=model, run_dir=run_dir, ranks=ranks, remote=remote
        )
        saved = (
            state_to_resume(run_dir, total_steps=config.total_steps, storage=self.service.storage)
            if resume
            else None
        )
        self.training = model.training_client(
            self.service,
            train_state=None if saved is None else saved.train_state,
            job_seed=config.seed,
        )
        _check_routing_replay(config, training=self.training)
        if saved is None:
            self.start, self.state = 0, RLLoopState(rng=random.Random(config.seed))
        else:
            self.start, self.state = saved.step, RLLoopState.from_json(saved.loop)
            ranks.on_writer(functools.partial(truncate_logs, run_dir, before_step=saved.step))
        self.tokenizer = self.training.get_tokenizer()
        self.sft_warmup = config.warmup.build()
        # Where episodes come from: the multi-turn `env`, else the single-turn `task`.
        self.source: EnvSource = (
            ProblemSource(config.task.build(), tokenizer=self.tokenizer)
            if config.env is None
            else config.env.build(tokenizer=self.tokenizer)
        )
        self.episodes = config.episodes.build(max_seq_len=config.sampler.max_seq_len)
        self.evaluate = HeldoutSuccess(
            training=self.training,
            source=self.source,
            num_envs=config.eval_problems,
            episodes=self.episodes,
            max_tokens=config.rl.max_tokens,
            ranks=ranks,
        )
        self.checkpoints = RunCheckpoints(
            run_dir=run_dir,
            training=self.training,
            every=config.checkpoint_every,
            total_steps=config.total_steps,
            previous=saved,
            ranks=ranks,
        )
        # After the logs are cut: the logger appends to metrics.jsonl.
        self.logger = metrics_logger(
            config.metrics, ranks=ranks, run_dir=run_dir, total_steps=config.total_steps
        )
        if saved is not None:
            self.logger.console.print(
                f"resuming {run_dir} at step {saved.step} of {config.total_steps} (its last "
                f"checkpoint).{other_world_note(saved, run_dir=run_dir)}",
                soft_wrap=True,
            )

    def warmup(self) -> None:
        """The supervised warm-up steps not done yet, with held-out evaluations every
        `warmup.eval_every` steps and after the last."""
        num_warmup = self.config.warmup.steps
        if self.start >= num_warmup:
            return
        self.logger.console.print(f"SFT warm-up: {num_warmup} steps")
        self.logger.begin_phase("SFT warm-up", first_step=0, num_steps=num_warmup)
        self.sft_warmup.run_demonstrations(
            self.training,
            demonstrate=self.source.demonstration,
            rng=self.state.rng,
            on_step=self._warmup_step_done,
            start_step=self.start,
            ranks=self.ranks,
        )

    def _warmup_step_done(self, step: int, metrics: dict[str, float]) -> None:
        if self.sft_warmup.evaluates_after(step):
            metrics = {**metrics, "eval/accuracy": self.evaluate()}
        if step == self.config.warmup.steps - 1:
            self.state.warmup_accuracy = metrics["eval/accuracy"]
        self.logger.log(step, metrics)
        self.checkpoints.step_done(step + 1, self.state)

    def reinforce(self) -> None:
        """The RL steps not done yet, in the config's mode."""
        config = self.config
        reference = self._kl_reference()
        self.logger.console.print(
            f"RL ({config.rl.loss_fn}, {config.rl.advantages}, {config.mode}): "
            f"{config.rl.steps} steps"
        )
        self.logger.begin_phase("GRPO", first_step=config.warmup.steps, num_steps=config.rl.steps)
        with open_rollouts(self.run_dir, ranks=self.ranks) as rollouts_file:
            steps = config.rl.build(
                training=self.training,
                source=self.source,
                episodes=self.episodes,
                tokenizer=self.tokenizer,
                rng=self.state.rng,
                reference=reference,
                logger=self.logger,
                rollouts_file=rollouts_file,
                evaluate=self.evaluate,
                ranks=self.ranks,
                first_step=config.warmup.steps,
            )
            first = max(self.start - config.warmup.steps, 0)
            if config.mode == "sync":
                run_sync(steps, first=first, on_step_done=self._rl_step_done)
            else:
                run_async(
                    steps,
                    first=first,
                    max_staleness=config.max_staleness,
                    barrier=self._rl_barrier,
                    on_step_done=self._rl_step_done,
                    kind="inflight" if config.mode == "inflight" else "snapshot",
                )

    def _kl_reference(self) -> SamplingClient | None:
        """A sampling client on the policy at the start of RL (saved the first time)."""
        if self.config.rl.kl_coef <= 0:
            return None
        if self.state.kl_reference is None:
            saved = self.training.save_weights_for_sampler("kl_reference").result()
            self.state.kl_reference = saved.path
        return self.service.create_scoring_client(self.state.kl_reference)

    def _rl_step_done(self, steps_done: int) -> None:
        self.state.rewards.append(self.logger.latest["reward/mean"])
        self.checkpoints.step_done(self.config.warmup.steps + steps_done, self.state)

    def _rl_barrier(self, rl_step: int) -> int:
        """RL steps that must be done before sampling for `rl_step` may start: those up to
        the last checkpoint at or before it, so a resumed run samples what this one did."""
        every, num_warmup = self.config.checkpoint_every, self.config.warmup.steps
        if every == 0:
            return 0
        return max(0, (num_warmup + rl_step) // every * every - num_warmup)

    def finish(self) -> RLResult:
        """The final evaluation (unless the last step had one), weights and report."""
        logger, rewards = self.logger, self.state.rewards
        warmup_accuracy = self.state.warmup_accuracy
        final_accuracy = logger.latest.get("eval/accuracy", None)
        if final_accuracy is None:
            final_accuracy = self.evaluate()
        sampler_path = self.checkpoints.save_final()
        self.checkpoints.report(
            logger,
            sampler_path=sampler_path,
            summary={
                "held-out accuracy": {
                    "after warm-up": warmup_accuracy if warmup_accuracy is not None else "-",
                    "final": final_accuracy,
                },
                "rollout reward": {
                    "first RL step": rewards[0] if rewards else "-",
                    "last RL step": rewards[-1] if rewards else "-",
                },
            },
            title="GRPO done",
        )
        return RLResult(
            warmup_accuracy=warmup_accuracy,
            final_accuracy=final_accuracy,
            reward_first=rewards[0] if rewards else float("nan"),
            reward_last=rewards[-1] if rewards else float("nan"),
            sampler_path=sampler_path,
        )


def _service_client(
    config: RLJob.Config,
    *,
    model: ModelChoice,
    run_dir: Path,
    ranks: Ranks,
    remote: RemoteGenerators | None,
) -> ServiceClient:
    """The service with the config's engines; on several ranks the trainer is sharded over
    them and neither engine spreads over the cores (the ranks already use them). With
    generator ranks (`remote`), `generator` is theirs, and a KL reference loads there too
    (`create_scoring_client`)."""
    trainer, generator = config.trainer, config.generator
    if remote is None:
        check_generator_ranks(generator, ranks=ranks, field="RLJob.Config.generator")
    else:
        generator = GeneratorChoice.Config()
    if ranks.world_size > 1:
        trainer = dataclasses.replace(trainer, sharding=config.sharding, shard_threads=1)
    return model.service_client(
        storage_dir=run_dir / CHECKPOINTS_DIR,
        sampler=rank_sampler(_sampler(config)),
        trainer=trainer,
        generator=generator,
        remote=remote,
        sleep_generator=config.sleep_generator,
    )


def _check_routing_replay(config: RLJob.Config, *, training: TrainingClient) -> None:
    """Replay needs a MoE policy: a ValueError naming the field otherwise, before the
    warm-up (the trainer would refuse the first RL step)."""
    if config.rl.routing_replay != "off" and training.engine.route_shape is None:
        raise ValueError(
            f"RLSteps.Config.routing_replay={config.rl.routing_replay!r} (--rl.routing_replay) "
            "replays a MoE policy's routes, but the model has no MoE layers; use 'off'"
        )


def _sampler(config: RLJob.Config) -> SamplerEngine.Config:
    """The engine's settings, recording routes when the steps replay them."""
    if config.rl.routing_replay == "sampler":
        return dataclasses.replace(config.sampler, record_routes=True)
    return config.sampler


def _log_memory_plan(
    config: RLJob.Config, *, placement: Placement, role: Role, decoder: DecoderConfig
) -> None:
    """Every rank says what memory it plans to hold (job/memory_plan.py), on stderr."""
    memory = rank_memory_gib(config.model.device, ranks=placement.world_size)
    settings = _plan_settings(config, placement, gpu_memory_gib=memory)
    print(memory_plan_line(settings, role=role, decoder=decoder), file=sys.stderr, flush=True)


def _plan_settings(
    config: RLJob.Config,
    placement: Placement,
    *,
    nnodes: int = 1,
    gpu_memory_gib: float,
    headroom: float = PlanSettings.headroom,
) -> PlanSettings:
    """The memory plan's settings of this job (the startup log's and `temper plan`'s)."""
    return plan_settings(
        placement,
        nnodes=nnodes,
        model=config.model,
        sampler=config.sampler,
        trainer=config.trainer,
        sharding=config.sharding,
        generator=config.generator,
        batch=config.rl.prompts_per_step * config.rl.group_size,
        # In-flight sampling holds one engine beside the trainer's, as async's older snapshot.
        mode="sync" if config.mode == "sync" else "async",
        kl_reference=config.rl.kl_coef > 0,
        gpu_memory_gib=gpu_memory_gib,
        headroom=headroom,
    )


def _check_ranks(config: RLJob.Config, *, num_ranks: int) -> None:
    """Settings that depend on the number of (trainer) ranks; raises the same error on every
    rank."""
    if num_ranks == 1:
        return
    dims = config.sharding.dims.build(world_size=num_ranks)  # degrees vs world size
    if dims.tp_enabled:
        raise ValueError(
            f"RLJob.Config.sharding.dims.tp={dims.tp}: the RL loop runs data-parallel only "
            "(every rank samples its own groups); use tp=1 and dp_shard/dp_replicate"
        )
    if dims.ep_enabled:  # against the model's experts: its config alone, nothing built
        dims.check_model(model_shapes(config.model))
    Ranks(rank=0, world_size=num_ranks).share(
        config.rl.prompts_per_step, field="RLJob.Config.rl.prompts_per_step"
    )
