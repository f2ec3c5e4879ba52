"""The RL job (GRPO-style) and its synchronous loop, written only against the public client API.

One step: a sampling client on the current weights -> `group_size` completions for each of
`prompts_per_step` problems (one batched decode) -> rewards -> group-relative advantages
(optionally a KL penalty to the initial policy) -> `forward_backward(loss_fn)` -> `optim_step`.
An optional supervised warm-up runs first. The step functions live in steps.py; this module
runs them in lock-step (`mode="sync"`), loop_async.py overlaps sampling with training
(`mode="async"`). The same job runs in-process (here) or against a Tinker-compatible server.

Several ranks (SPMD, `temper train RECIPE --nproc N` or torchrun): every rank runs this job
with the trainer sharded over all ranks (`sharding`); each samples its share of every step's
groups and of the warm-up batches and evaluation problems, and metrics are combined over ranks
(steps.py). Rank 0 alone writes metrics.jsonl, rollouts.jsonl, plots and the run state; the
training client's checkpoints are written by all ranks together (DCP).

Resume: every `checkpoint_every` steps (warm-up and RL steps counted together) the job saves
the training client's state and its own loop state (temper/checkpoint/run_state.py);
`run(run_dir=..., resume=True)` (`temper train --resume RUN_DIR`) continues from the last one,
bitwise equal to a run that never stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from rich.console import Console

from temper.checkpoint.model_source import DType
from temper.checkpoint.run_state import (
    RunState,
    load_run_state,
    rng_from_json,
    rng_to_json,
    save_run_state,
    truncate_jsonl,
)
from temper.client.service_client import ServiceClient
from temper.config.configurable import Configurable
from temper.distributed.ranks import Ranks
from temper.observability import MetricsLogger, plot_metrics
from temper.observability.metrics import METRICS_FILE_NAME
from temper.rl.advantages import AdvantageMode
from temper.rl.kl import KLEstimator
from temper.rl.loop_async import run_async
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.tasks import SumDigits, TaskConfig
from temper.tasks.evaluation import greedy_accuracy, heldout_problems
from temper.trainer.engine import TrainerEngine
from temper.trainer.sharding import Sharding

ROLLOUTS_FILE_NAME = "rollouts.jsonl"


@dataclass(frozen=True)
class RLResult:
    warmup_accuracy: float | None
    final_accuracy: float
    reward_first: float
    reward_last: float
    sampler_path: str


class RLJob(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        base_model: str = "tiny"
        """Model directory, or a named size with a built-in vocabulary (e.g. 'tiny')."""
        lora_rank: int | None = None
        """LoRA rank; None trains every parameter."""
        device: str = "cpu"
        """Device of the trainer and sampler: 'cpu' or 'cuda' (under torchrun, each rank's GPU)."""
        dtype: DType = "float32"
        """Parameter dtype of the model ('bfloat16' on GPUs)."""
        task: TaskConfig = field(default_factory=SumDigits.Config)
        """The task problems and rewards come from."""
        warmup: SFTWarmup.Config = field(default_factory=SFTWarmup.Config)
        """Supervised warm-up before RL."""
        steps: int = 60
        """RL steps."""
        prompts_per_step: int = 16
        """Problems per RL step."""
        group_size: int = 8
        """Completions per problem, compared with each other (GRPO groups)."""
        num_substeps: int = 1
        """Optimizer steps per RL step: the step's problems split into this many equal
        minibatches (prompts_per_step must be divisible by it)."""
        max_tokens: int = 4
        """Most tokens per completion."""
        temperature: float = 1.0
        """Sampling temperature of rollouts."""
        loss_fn: Literal["ppo", "importance_sampling"] = "ppo"
        """Policy loss; the sampler's logprobs give the importance ratios."""
        learning_rate: float = 2e-4
        """AdamW learning rate of RL steps."""
        advantages: AdvantageMode = "grpo"
        """grpo (std-normalized), dr_grpo (mean baseline only) or rloo."""
        drop_uniform_groups: bool = True
        """Skip groups whose rewards are all equal (no signal)."""
        mode: Literal["sync", "async"] = "sync"
        """sync: sample, then train, every step. async: sample later steps while this one
        trains, from weights at most `max_staleness` steps old (the PPO / importance ratio
        against the sampler's logprobs corrects for the lag)."""
        max_staleness: int = 1
        """async: how many RL steps older than the trained policy the sampling weights may be
        (0 behaves exactly like sync)."""
        kl_coef: float = 0.0
        """Weight of the KL penalty to the policy at the start of RL (0 = off)."""
        kl_estimator: KLEstimator = "k3"
        """Per-token KL estimator of the penalty: k1 (log-ratio) or k3 (nonnegative)."""
        checkpoint_every: int = 0
        """Steps (warm-up and RL together) between full-state checkpoints that
        `temper train --resume` continues from; 0 = only at the end."""
        eval_every: int = 20
        """RL steps between held-out evaluations (plus one after warm-up and one at the end)."""
        eval_problems: int = 256
        """Held-out problems per evaluation (a fixed set)."""
        seed: int = 0
        """Seed of the problem stream and of LoRA initialization."""
        rollouts_per_step: int = 4
        """Decoded completions written to rollouts.jsonl per RL step."""
        sampler: SamplerEngine.Config = field(
            default_factory=lambda: SamplerEngine.Config(
                max_batch=256,
                max_seq_len=64,
                cpu=CpuDecoding.Config(num_threads=1, processes="auto"),
            )
        )
        """The sampling engine behind the sampling clients. On CPU each rollout batch is split
        over one process per core (`cpu.processes`), each decoding on one thread."""
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
        torchrun); data-parallel only (tp must be 1). Unused in one process."""

        def __post_init__(self) -> None:
            _check_config(self)

    runs_on_ranks: ClassVar[bool] = True
    """`temper train` may run this job on several ranks (torchrun, `--nproc`)."""

    def __init__(self, config: Config) -> None:
        self.config = config

    def run(self, *, run_dir: Path, resume: bool = False) -> RLResult:
        """Train into `run_dir`; with `resume`, continue from its last checkpoint."""
        config, run_dir = self.config, Path(run_dir)
        ranks = Ranks.current()
        _check_ranks(config, ranks)  # before any model is built, on every rank alike
        trainer, sampler = config.trainer, config.sampler
        if ranks.world_size > 1:  # the ranks already use the cores
            trainer = dataclasses.replace(trainer, sharding=config.sharding, shard_threads=1)
            sampler = dataclasses.replace(
                sampler, cpu=dataclasses.replace(sampler.cpu, processes=1)
            )
        service = ServiceClient(
            storage_dir=run_dir / "checkpoints",
            device=config.device,
            dtype=config.dtype,
            sampler=sampler,
            trainer=trainer,
        )
        state = load_run_state(run_dir) if resume else None
        if state is None:
            training = self._new_training_client(service)
            rng, loop = random.Random(config.seed), {"rewards": []}
        else:
            training = service.create_training_client_from_state_with_optimizer(state.train_state)
            rng, loop = rng_from_json(state.loop["rng"]), dict(state.loop)

            def truncate_logs() -> None:
                for name in (METRICS_FILE_NAME, ROLLOUTS_FILE_NAME):
                    truncate_jsonl(run_dir / name, before_step=state.step)

            ranks.on_writer(truncate_logs)
        start = 0 if state is None else state.step
        tokenizer, task = training.get_tokenizer(), config.task.build()
        heldout = heldout_problems(task, count=config.eval_problems)
        checkpoints = _Checkpoints(
            config,
            run_dir=run_dir,
            training=training,
            rng=rng,
            loop=loop,
            previous=state,
            ranks=ranks,
        )

        def evaluate() -> float:
            """Greedy accuracy on the held-out set, each rank scoring its part."""
            sampler = training.save_weights_and_get_sampling_client()
            mine = heldout[ranks.split(len(heldout))]
            total = 0.0
            if mine:
                _, examples = greedy_accuracy(
                    sampler, mine, task=task, tokenizer=tokenizer, max_tokens=config.max_tokens
                )
                total = sum(reward for _, _, reward in examples)
            return ranks.sum([total])[0] / len(heldout)

        num_warmup = config.warmup.steps
        with _metrics_logger(
            config.metrics, ranks=ranks, run_dir=run_dir, total_steps=num_warmup + config.steps
        ) as logger:
            if start < num_warmup:
                logger.console.print(f"SFT warm-up: {num_warmup} steps")
                logger.set_description("SFT warm-up")

                def on_warmup_step(step: int, metrics: dict[str, float]) -> None:
                    if step == num_warmup - 1:
                        metrics = {**metrics, "eval/accuracy": evaluate()}
                        loop["warmup_accuracy"] = metrics["eval/accuracy"]
                    logger.log(step, metrics)
                    checkpoints.step_done(step + 1)

                config.warmup.build().run(
                    training,
                    task=task,
                    tokenizer=tokenizer,
                    rng=rng,
                    on_step=on_warmup_step,
                    start_step=start,
                    ranks=ranks,
                )
            if config.kl_coef > 0 and "kl_reference" not in loop:
                loop["kl_reference"] = (
                    training.save_weights_for_sampler("kl_reference").result().path
                )
            reference = None
            if config.kl_coef > 0:
                reference = service.create_sampling_client(model_path=loop["kl_reference"])
            logger.console.print(
                f"RL ({config.loss_fn}, {config.advantages}, {config.mode}): {config.steps} steps"
            )
            logger.set_description("GRPO")
            with _rollouts_file(run_dir, ranks=ranks) as rollouts_file:
                steps = RLSteps(
                    config,
                    training=training,
                    task=task,
                    tokenizer=tokenizer,
                    rng=rng,
                    reference=reference,
                    logger=logger,
                    rollouts_file=rollouts_file,
                    evaluate=evaluate,
                    ranks=ranks,
                )

                def on_rl_step(steps_done: int) -> None:
                    loop["rewards"].append(logger.latest["reward/mean"])
                    checkpoints.step_done(num_warmup + steps_done)

                first = max(start - num_warmup, 0)
                if config.mode == "sync":
                    run_sync(steps, first=first, on_step_done=on_rl_step)
                else:
                    run_async(
                        steps,
                        first=first,
                        max_staleness=config.max_staleness,
                        barrier=checkpoints.rl_barrier,
                        on_step_done=on_rl_step,
                    )
            return self._finish(
                training, logger=logger, loop=loop, evaluate=evaluate, run_dir=run_dir, ranks=ranks
            )

    def _new_training_client(self, service: ServiceClient):
        config = self.config
        if config.lora_rank is None:
            return service.create_training_client(config.base_model)
        return service.create_lora_training_client(
            config.base_model, rank=config.lora_rank, seed=config.seed
        )

    def _finish(self, training, *, logger, loop, evaluate, run_dir: Path, ranks) -> RLResult:
        rewards, warmup_accuracy = loop["rewards"], loop.get("warmup_accuracy")
        final_accuracy = logger.latest.get("eval/accuracy", None)
        if final_accuracy is None:
            final_accuracy = evaluate()
        sampler_path = training.save_weights_for_sampler("final").result().path
        plots = ranks.on_writer(lambda: plot_metrics(run_dir))
        logger.summary(
            {
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
        logger.console.print(f"plots: {plots[0].parent}\nsampler weights: {sampler_path}")
        return RLResult(
            warmup_accuracy=warmup_accuracy,
            final_accuracy=final_accuracy,
            reward_first=rewards[0] if rewards else float("nan"),
            reward_last=rewards[-1] if rewards else float("nan"),
            sampler_path=sampler_path,
        )


def _metrics_logger(
    config: MetricsLogger.Config, *, ranks: Ranks, run_dir: Path, total_steps: int
) -> MetricsLogger:
    """Rank 0's logger writes and shows; the other ranks' log the same metrics silently."""
    console = None
    if not ranks.is_writer:
        config = dataclasses.replace(
            config, display="none", jsonl=False, tensorboard=False, progress_keys=()
        )
        console = Console(quiet=True)
    return MetricsLogger(
        config, run_dir=run_dir, total_steps=total_steps, description="GRPO", console=console
    )


def _rollouts_file(run_dir: Path, *, ranks: Ranks):
    """rollouts.jsonl, opened for appending on rank 0; None on the others."""
    if not ranks.is_writer:
        return contextlib.nullcontext(None)
    return (run_dir / ROLLOUTS_FILE_NAME).open("a")


def run_sync(steps: RLSteps, *, first: int, on_step_done) -> None:
    """Sample, then train, one RL step at a time, from RL step `first`."""
    for rl_step in range(first, steps.config.steps):
        steps.finish(steps.submit(rl_step, steps_done=rl_step))
        on_step_done(rl_step + 1)


class _Checkpoints:
    """Full-state checkpoints every `checkpoint_every` steps and at the end; keeps the last."""

    def __init__(self, config, *, run_dir: Path, training, rng, loop, previous, ranks) -> None:
        self.ranks = ranks
        self.every = config.checkpoint_every
        self.num_warmup = config.warmup.steps
        self.total = config.warmup.steps + config.steps
        self.run_dir, self.training, self.rng, self.loop = run_dir, training, rng, loop
        self.previous = None if previous is None else previous.train_state

    def due(self, steps_done: int) -> bool:
        return steps_done == self.total or (self.every > 0 and steps_done % self.every == 0)

    def rl_barrier(self, rl_step: int) -> int:
        """RL steps that must be done before sampling for `rl_step` may start: those up to
        the last checkpoint at or before it, so a resumed run samples what this one did."""
        if self.every == 0:
            return 0
        return max(0, (self.num_warmup + rl_step) // self.every * self.every - self.num_warmup)

    def step_done(self, steps_done: int) -> None:
        if not self.due(steps_done):
            return
        # Every rank writes its shards; rank 0 then records the run state and drops the
        # previous checkpoint (the RNG copies of all ranks are equal).
        path = self.training.save_state(f"step-{steps_done:06d}").result().path
        loop = {**self.loop, "rng": rng_to_json(self.rng)}
        previous = self.previous

        def record() -> None:
            save_run_state(self.run_dir, RunState(step=steps_done, train_state=path, loop=loop))
            if previous is not None and previous != path:
                self.training.service.storage.delete(previous)

        self.ranks.on_writer(record)
        self.previous = path


def _check_ranks(config: RLJob.Config, ranks: Ranks) -> None:
    """Settings that depend on the number of ranks; raises the same error on every rank."""
    if ranks.world_size == 1:
        return
    dims = config.sharding.dims.build(world_size=ranks.world_size)  # degrees vs world size
    if dims.tp_enabled:
        raise ValueError(
            f"RLJob.Config.sharding.dims.tp={dims.tp}: the RL loop runs data-parallel only "
            "(every rank samples its own groups); use tp=1 and dp_shard/dp_replicate"
        )
    ranks.share(config.prompts_per_step, field="RLJob.Config.prompts_per_step")


def _check_config(config: RLJob.Config) -> None:
    """Bad settings fail when the config is made, before any model is built."""
    name = "RLJob.Config"
    if config.group_size < 2:
        raise ValueError(
            f"{name}.group_size must be >= 2 (GRPO compares members of a group), "
            f"got {config.group_size}"
        )
    for field_name in ("prompts_per_step", "num_substeps", "max_tokens", "eval_every"):
        if getattr(config, field_name) < 1:
            raise ValueError(f"{name}.{field_name} must be >= 1, got {getattr(config, field_name)}")
    for field_name in ("steps", "max_staleness", "checkpoint_every", "eval_problems"):
        if getattr(config, field_name) < (1 if field_name == "eval_problems" else 0):
            raise ValueError(f"{name}.{field_name} is out of range: {getattr(config, field_name)}")
    if config.prompts_per_step % config.num_substeps:
        raise ValueError(
            f"{name}.prompts_per_step ({config.prompts_per_step}) must be divisible by "
            f"num_substeps ({config.num_substeps}): each substep trains on an equal share"
        )
    if config.lora_rank is not None and config.lora_rank < 1:
        raise ValueError(f"{name}.lora_rank must be >= 1 or None, got {config.lora_rank}")
    if config.mode not in ("sync", "async"):
        raise ValueError(f"{name}.mode must be 'sync' or 'async', got {config.mode!r}")
    if config.trainer.sharding is not None:
        raise ValueError(
            f"{name}.trainer.sharding is set by the loop on several ranks; configure it "
            f"through {name}.sharding (--sharding.* flags) and leave trainer.sharding:none"
        )
    if config.kl_coef < 0:
        raise ValueError(
            f"{name}.kl_coef must be >= 0 (0 turns the penalty off), got {config.kl_coef}"
        )
    if config.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"{name}.kl_estimator must be 'k1' or 'k3', got {config.kl_estimator!r}")
    if config.mode == "sync" and config.max_staleness != 1:
        warnings.warn(
            f"{name}.max_staleness={config.max_staleness} is ignored in mode='sync' "
            "(set mode='async')",
            stacklevel=3,
        )
