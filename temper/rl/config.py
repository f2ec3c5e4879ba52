"""The RL job's settings, `RLJobConfig`, defined here, below the job (temper/rl/job.py).

The step functions (steps.py) and loops (loops.py) read them, and the job imports those; a
type both sides need lives in the lower module. So every field is declared here, and
`RLJob.Config`, the config that recipes make and config.json names, is this class nested in
its owner without fields of its own (only it builds an `RLJob`). Bad settings fail when the
config is made, before any model is built.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.distributed.placement import Placement
from temper.generator.choice import GeneratorChoice
from temper.job import ModelChoice
from temper.observability import MetricsLogger
from temper.rl.advantages import AdvantageMode
from temper.rl.envs import EnvConfig
from temper.rl.episodes import EpisodeRunner
from temper.rl.kl import KLEstimator
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine
from temper.tasks import SumDigits, TaskConfig
from temper.trainer.engine import TrainerEngine
from temper.trainer.sharding import Sharding


@dataclass(kw_only=True)
class RLJobConfig(Configurable.Config):
    """Every setting of the RL job; make the job's configs as `RLJob.Config`."""

    model: ModelChoice.Config = field(default_factory=ModelChoice.Config)
    """The model trained: base model, LoRA, device, dtype."""
    task: TaskConfig = field(default_factory=SumDigits.Config)
    """The task problems and rewards come from (single-turn; unused when `env` is set)."""
    env: EnvConfig | None = None
    """A multi-turn environment source to roll out against instead of `task` (its episodes,
    held-out envs and warm-up demonstrations); None: the single-turn `task`."""
    episodes: EpisodeRunner.Config = field(default_factory=EpisodeRunner.Config)
    """How multi-turn episodes run (turn and context limits, env step threads); only with
    `env`."""
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
    """Most tokens per completion (per action, in a multi-turn episode)."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    loss_fn: Literal["ppo", "importance_sampling", "stable_reinforce"] = "ppo"
    """Policy loss; the sampler's logprobs give the importance ratios (stable_reinforce:
    truncated-importance-weighted REINFORCE, docs/server.md)."""
    learning_rate: float = 2e-4
    """AdamW learning rate of RL steps (the peak, under a schedule)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """constant, or cosine decay from `learning_rate` to a tenth of it at the last RL step."""
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
    """Seed of the problem stream, and of LoRA initialization unless `model.lora_seed` is
    set."""
    rollouts_per_step: int = 4
    """Decoded completions written to rollouts.jsonl per RL step."""
    sampler: SamplerEngine.Config = field(
        default_factory=lambda: SamplerEngine.Config(
            max_batch=256, max_seq_len=64, cpu=CpuDecoding.Config(num_threads=1, processes="auto")
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
    torchrun); data-parallel only (tp must be 1). Unused in one process."""
    placement: Placement.Config = field(default_factory=Placement.Config)
    """Where trainer and generator run on several ranks: 'colocated' (every rank does both)
    or 'disaggregated' (the last `placement.generator_ranks` ranks generate, the others
    train; weights are streamed to the generators after every step)."""
    sleep_generator: bool = False
    """Release the generator's KV cache while the trainer steps (colocated, mode 'sync'):
    less peak memory, a re-allocation before each sampling."""

    def __post_init__(self) -> None:
        _check_config(self)

    @property
    def total_steps(self) -> int:
        """Warm-up and RL steps together: the run's step count (logs, checkpoints)."""
        return self.warmup.steps + self.steps


_LEAST = {
    "prompts_per_step": 1,
    "num_substeps": 1,
    "max_tokens": 1,
    "eval_every": 1,
    "eval_problems": 1,
    "steps": 0,
    "max_staleness": 0,
    "checkpoint_every": 0,
}
"""The smallest valid value of each integer count of the config."""


def _check_config(config: RLJobConfig) -> None:
    """Bad settings fail when the config is made, before any model is built."""
    name = "RLJob.Config"
    check_range(
        config.group_size,
        field=f"{name}.group_size",
        at_least=2,
        hint="GRPO compares members of a group",
    )
    for field_name, least in _LEAST.items():
        check_range(getattr(config, field_name), field=f"{name}.{field_name}", at_least=least)
    # 0 is allowed (a run that only samples)
    check_range(config.learning_rate, field=f"{name}.learning_rate", at_least=0)
    if config.prompts_per_step % config.num_substeps:
        raise ValueError(
            f"{name}.prompts_per_step ({config.prompts_per_step}) must be divisible by "
            f"num_substeps ({config.num_substeps}): each substep trains on an equal share"
        )
    check_choice(config.mode, field=f"{name}.mode", choices=("sync", "async"))
    if config.trainer.sharding is not None:
        raise ValueError(
            f"{name}.trainer.sharding is set by the loop on several ranks; configure it "
            f"through {name}.sharding (--sharding.* flags) and leave trainer.sharding:none"
        )
    check_range(config.kl_coef, field=f"{name}.kl_coef", at_least=0, hint="0 turns the penalty off")
    check_choice(config.lr_schedule, field=f"{name}.lr_schedule", choices=("constant", "cosine"))
    check_choice(config.kl_estimator, field=f"{name}.kl_estimator", choices=("k1", "k3"))
    max_context = config.episodes.max_context
    if (
        config.env is not None
        and max_context is not None
        and max_context > config.sampler.max_seq_len
    ):
        raise ValueError(
            f"{name}.episodes.max_context ({max_context}) exceeds "
            f"{name}.sampler.max_seq_len ({config.sampler.max_seq_len}); an episode's context "
            "must fit the sampler's cache"
        )
    placement, generator = config.placement, config.generator
    if placement.generator_tp > 1 and generator.backend != "vllm":
        raise ValueError(
            f"{name}.placement.generator_tp={placement.generator_tp} needs "
            f"{name}.generator.backend='vllm' (Temper's engine has no tensor parallelism)"
        )
    if placement.mode == "disaggregated" and generator.vllm.tensor_parallel_size != 1:
        raise ValueError(
            f"{name}.generator.vllm.tensor_parallel_size is set by the placement on generator "
            f"ranks: use {name}.placement.generator_tp (--placement.generator_tp) instead"
        )
    if config.sleep_generator and config.mode != "sync":
        raise ValueError(
            f"{name}.sleep_generator needs mode='sync': in mode='async' sampling runs while "
            "the trainer steps"
        )
    if config.mode == "sync" and config.max_staleness != 1:
        warnings.warn(
            f"{name}.max_staleness={config.max_staleness} is ignored in mode='sync' "
            "(set mode='async')",
            stacklevel=3,
        )
