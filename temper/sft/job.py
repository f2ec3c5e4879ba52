"""Supervised fine-tuning through the public client API, on a task or on JSONL conversations.

The loop only calls `ServiceClient` and its clients: `forward_backward(data, "cross_entropy")`
and `optim_step` to train, `forward` for the held-out loss, a sampling client for greedy
held-out accuracy, `save_weights_for_sampler` for the final weights. So the same loop runs
in-process (here) or against a Tinker-compatible server. Loss weights are 1 on answer tokens
(task) or on assistant tokens (conversations, see `temper/tokenizer/renderers`), divided by
the batch's count of such tokens: `train/loss` and `eval/loss` are mean losses per token
(`eval/initial_loss`, logged with step 0, is the held-out loss before training).

Full-state checkpoints (`checkpoint_every`, and always at the end; temper/job/run_checkpoints.py,
shared with the RL job) hold the weights and the optimizer (`save_state`) plus `SFTState` (data
position and held-out history) in RUN_DIR/run_state (temper/checkpoint/run_state.py);
`run(resume=True)` (`temper train --resume RUN_DIR`) continues from the last one and equals an
uninterrupted run bitwise. The model (`model`: base model, LoRA, device, dtype) is the same
`ModelChoice` the RL job uses (temper/job/model.py).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from temper.api.types import AdamParams
from temper.checkpoint.run_state import truncate_jsonl
from temper.checkpoint.storage import CheckpointStorage
from temper.client.sampler_weights import SAMPLER_FILE
from temper.client.service_client import ServiceClient
from temper.client.training_client import TrainingClient
from temper.config.checks import check_range
from temper.config.configurable import Configurable
from temper.distributed.ranks import Ranks
from temper.generator.choice import GeneratorChoice
from temper.job import (
    CHECKPOINTS_DIR,
    ModelChoice,
    RunCheckpoints,
    check_generator_model,
    state_to_resume,
)
from temper.job.long_lived import long_lived_objects_frozen
from temper.models.common.moe_stats import router_metrics
from temper.observability import MetricsLogger, PhaseTimer
from temper.observability.metrics import METRICS_FILE_NAME
from temper.sampler import SamplerEngine
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sft.batches import supervised_data
from temper.sft.datasets import ConversationDataset, DataPosition
from temper.sft.sources import ConversationSource, Example, TaskSource
from temper.tasks import SumDigits, TaskConfig
from temper.tokenizer import Tokenizer
from temper.trainer.engine import TrainerEngine
from temper.trainer.schedule import warmup_cosine


@dataclass(frozen=True)
class SFTResult:
    steps: int
    initial_heldout_loss: float
    heldout_loss: float
    heldout_accuracy: float
    best_heldout_accuracy: float
    sampler_path: str
    """`tinker://<run>/sampler_weights/final`."""
    model_dir: Path | None
    """The exported HF model directory (export='hf'), else None."""


@dataclass
class SFTState:
    """The loop's position and held-out history: all a resume needs besides the weights and
    optimizer state. Saved as the run state's `loop` (its `step` is the run state's)."""

    step: int
    """Optimizer steps done."""
    data: DataPosition
    initial_loss: float
    """Held-out loss before training."""
    accuracies: list[float] = field(default_factory=list)
    """Held-out accuracy of each evaluation so far."""

    def to_json(self) -> dict[str, Any]:
        return {
            "data": {"epoch": self.data.epoch, "index": self.data.index},
            "initial_loss": self.initial_loss,
            "accuracies": list(self.accuracies),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], *, step: int) -> SFTState:
        return cls(
            step=step,
            data=DataPosition(**data["data"]),
            initial_loss=data["initial_loss"],
            accuracies=list(data["accuracies"]),
        )


class SFTJob(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        model: ModelChoice.Config = field(default_factory=ModelChoice.Config)
        """The model trained: base model, LoRA, device, dtype."""
        source: Literal["task", "conversations"] = "task"
        """Train on the problems of `task`, or on the JSONL conversations of `conversations`."""
        task: TaskConfig = field(default_factory=SumDigits.Config)
        """The task whose problems are trained on and evaluated."""
        conversations: ConversationDataset.Config = field(
            default_factory=ConversationDataset.Config
        )
        """The conversation dataset and its chat format (source='conversations')."""
        steps: int = 400
        """Optimizer steps."""
        batch_size: int = 64
        """Problems or conversations per step."""
        learning_rate: float = 2e-3
        """Peak AdamW learning rate."""
        warmup_steps: int = 20
        """Steps of linear learning-rate warm-up; then cosine decay to 10% of the peak."""
        weight_decay: float = 0.0
        """AdamW weight decay."""
        grad_clip_norm: float = 1.0
        """Clip the global gradient norm to this (0 disables clipping)."""
        eval_every: int = 50
        """Steps between held-out evaluations (and one at the end)."""
        eval_problems: int = 256
        """Held-out problems per evaluation (a fixed set; source='task'). Conversations are
        evaluated on the whole held-out split."""
        max_new_tokens: int = 4
        """Most tokens generated per greedy held-out reply."""
        sampler: SamplerEngine.Config = field(
            default_factory=lambda: SamplerEngine.Config(
                max_batch=256, max_seq_len=64, cpu=CpuDecoding.Config(num_threads=1, processes=1)
            )
        )
        """Temper's engine behind the sampling clients (greedy held-out replies; generator
        backend 'temper'). One process on CPU: the evaluations are short and far apart, and
        a helper process's start (1-2 s) would cost a smoke run more than it saves."""
        generator: GeneratorChoice.Config = field(default_factory=GeneratorChoice.Config)
        """The generator backend: Temper's engine (set up by `sampler`) or vLLM (set up by
        `generator.vllm`)."""
        trainer: TrainerEngine.Config = field(default_factory=TrainerEngine.Config)
        """The engine behind the training client (micro-batch budget, CPU thread shards)."""
        seed: int = 0
        """Seed of the training data order, and of LoRA initialization unless
        `model.lora_seed` is set."""
        checkpoint_every: int = 0
        """Steps between full-state checkpoints (model, optimizer, data position) that
        `temper train --resume` continues from; 0 = only at the end."""
        export: Literal["hf", "none"] = "hf"
        """'hf' also copies the final weights (a HF model directory) to RUN_DIR/model."""
        metrics: MetricsLogger.Config = field(
            default_factory=lambda: MetricsLogger.Config(
                progress_keys=("train/loss", "eval/loss", "eval/accuracy"), table_every=100
            )
        )
        """Console, metrics.jsonl and TensorBoard logging."""

        def __post_init__(self) -> None:
            for name in ("steps", "batch_size", "eval_every", "eval_problems", "max_new_tokens"):
                check_range(getattr(self, name), field=f"SFTJob.Config.{name}", greater_than=0)
            check_range(
                self.checkpoint_every,
                field="SFTJob.Config.checkpoint_every",
                at_least=0,
                hint="0 = only at the end",
            )
            check_range(self.learning_rate, field="SFTJob.Config.learning_rate", greater_than=0)
            if self.export == "hf" and self.model.lora_rank is not None:
                raise ValueError(
                    "SFTJob.Config.export='hf' writes a full model directory, but "
                    f"model.lora_rank={self.model.lora_rank} trains adapters; use export='none' "
                    "(on the command line: --export none; the adapters are saved as sampler "
                    "weights under RUN_DIR/checkpoints either way)"
                )

    def __init__(self, config: Config) -> None:
        self.config = config

    def check_model(self) -> None:
        """The settings refused for this model on this machine (a generator backend that
        cannot run it), from the model's config alone: by `temper train` before it writes the
        run directory, and by `run` before anything is built."""
        check_generator_model(self.config.model, self.config.generator)

    def run(self, *, run_dir: Path, resume: bool = False) -> SFTResult:
        """Train into `run_dir`; with `resume`, continue from its last checkpoint."""
        self.check_model()
        config, run_dir = self.config, Path(run_dir)
        storage_dir = run_dir / CHECKPOINTS_DIR
        saved = None
        if resume:
            storage = CheckpointStorage(storage_dir)
            saved = state_to_resume(run_dir, total_steps=config.steps, storage=storage)
        # Load and validate the dataset first: a bad file fails before any model is built.
        dataset = config.conversations.build() if config.source == "conversations" else None
        model = config.model.build()
        service = model.service_client(
            storage_dir=storage_dir,
            sampler=config.sampler,
            trainer=config.trainer,
            generator=config.generator,
        )
        training = model.training_client(
            service,
            train_state=None if saved is None else saved.train_state,
            job_seed=config.seed,
        )
        source = self._source(training.get_tokenizer(), dataset=dataset)
        if saved is None:
            state = SFTState(
                step=0, data=source.position, initial_loss=self._heldout_loss(training, source)
            )
        else:
            state = SFTState.from_json(saved.loop, step=saved.step)
            source.position = state.data
            truncate_jsonl(run_dir / METRICS_FILE_NAME, before_step=saved.step)
        checkpoints = RunCheckpoints(
            run_dir=run_dir,
            training=training,
            every=config.checkpoint_every,
            total_steps=config.steps,
            previous=saved,
            ranks=Ranks.single(),
        )
        with (
            MetricsLogger(
                config.metrics, run_dir=run_dir, total_steps=config.steps, description=self._title()
            ) as logger,
            long_lived_objects_frozen(),
        ):
            if saved is None:
                logger.console.print(f"held-out loss before training: {state.initial_loss:.4f}")
            else:
                logger.console.print(
                    f"resuming {run_dir} at step {saved.step} of {config.steps} (its last "
                    f"checkpoint; held-out loss before training was {state.initial_loss:.4f})"
                )
            examples = self._train(
                training, source, state=state, logger=logger, checkpoints=checkpoints
            )
            self._show_examples(logger, examples[:4])
            conversations = isinstance(source, ConversationSource)
            template = source.renderer.chat_template if conversations else None
            # `temper sample` renders prompts as the run did only when told the format.
            sample_flags = f"--chat {source.renderer_name} " if conversations else ""
            return self._finish(
                service,
                state=state,
                logger=logger,
                checkpoints=checkpoints,
                template=template,
                sample_flags=sample_flags,
            )

    def _train(
        self,
        training: TrainingClient,
        source: TaskSource | ConversationSource,
        *,
        state: SFTState,
        logger: MetricsLogger,
        checkpoints: RunCheckpoints,
    ) -> list[Example]:
        """The steps not done yet, with evaluations and checkpoints; the last evaluation's
        examples."""
        config = self.config
        examples: list[Example] = []
        timer = PhaseTimer()
        while state.step < config.steps:
            with timer.phase("train"):
                metrics = self._train_step(training, source, step=state.step)
            state.data = source.position
            if state.step == 0:  # the held-out loss before training, for the plots
                metrics["eval/initial_loss"] = state.initial_loss
            last = state.step == config.steps - 1
            if (state.step + 1) % config.eval_every == 0 or last:
                with timer.phase("eval"):
                    eval_metrics, examples = self._evaluate(training, source)
                state.accuracies.append(eval_metrics["eval/accuracy"])
                metrics |= eval_metrics
            logger.log(state.step, metrics | timer.collect())
            state.step += 1
            checkpoints.step_done(state.step, state)
        return examples

    def _finish(
        self,
        service: ServiceClient,
        *,
        state: SFTState,
        logger: MetricsLogger,
        checkpoints: RunCheckpoints,
        template: str | None,
        sample_flags: str,
    ) -> SFTResult:
        """Save the final weights, export and plot them, print the summary. An export carries
        `template`, the chat format trained on, when it is not the tokenizer's own."""
        config, run_dir, accuracies = self.config, logger.run_dir, state.accuracies
        sampler_path = checkpoints.save_final()
        model_dir = None
        if config.export == "hf":
            model_dir = export_model_dir(service, sampler_path, out_dir=run_dir / "model")
            if template is not None:
                Tokenizer.replace_chat_template(model_dir, template)
        final_loss = logger.latest["eval/loss"]
        checkpoints.report(
            logger,
            sampler_path=sampler_path,
            summary={
                "held-out loss": {"before": state.initial_loss, "final": final_loss},
                "held-out accuracy": {"final": accuracies[-1], "best": max(accuracies)},
                "train/loss": {"final": logger.latest["train/loss"]},
            },
            title=f"SFT done: {config.steps} steps",
            sample_flags=sample_flags,
        )
        return SFTResult(
            steps=config.steps,
            initial_heldout_loss=state.initial_loss,
            heldout_loss=final_loss,
            heldout_accuracy=accuracies[-1],
            best_heldout_accuracy=max(accuracies),
            sampler_path=sampler_path,
            model_dir=model_dir,
        )

    def learning_rate(self, step: int) -> float:
        config = self.config
        factor = warmup_cosine(step, warmup_steps=config.warmup_steps, total_steps=config.steps)
        return config.learning_rate * factor

    def _title(self) -> str:
        config = self.config
        if config.source == "conversations":
            return f"SFT {Path(config.conversations.path).name} ({config.conversations.renderer})"
        return f"SFT {type(config.task).__qualname__.split('.')[0]}"

    def _source(
        self, tokenizer: Tokenizer, *, dataset: ConversationDataset | None
    ) -> TaskSource | ConversationSource:
        config = self.config
        if dataset is not None:
            return ConversationSource(dataset, tokenizer=tokenizer, seed=config.seed)
        return TaskSource(
            config.task.build(),
            tokenizer=tokenizer,
            seed=config.seed,
            num_heldout=config.eval_problems,
        )

    def _train_step(self, training: TrainingClient, source, *, step: int) -> dict[str, float]:
        config = self.config
        started = time.perf_counter()
        examples = source.next_batch(config.batch_size)
        learning_rate = self.learning_rate(step)
        backward = training.forward_backward(supervised_data(examples), "cross_entropy")
        optim = training.optim_step(
            AdamParams(
                learning_rate=learning_rate,
                beta2=0.95,
                weight_decay=config.weight_decay,
                grad_clip_norm=config.grad_clip_norm,
            )
        )
        metrics = backward.result().metrics
        grad_norm = optim.result().metrics["grad_norm:mean"]
        num_tokens = sum(len(e.tokens) - 1 for e in examples)
        return {
            "train/loss": metrics["loss:sum"],
            "train/trained_tokens": float(sum(e.num_weighted for e in examples)),
            "train/tokens_per_s": num_tokens / (time.perf_counter() - started),
            "optim/grad_norm": grad_norm,
            "optim/lr": learning_rate,
            **router_metrics(metrics),  # MoE models: moe/aux_loss, each layer's load, entropy
        }

    @staticmethod
    def _heldout_loss(training: TrainingClient, source) -> float:
        """Mean loss per trained token over the whole held-out set (no gradients)."""
        output = training.forward(supervised_data(source.heldout), "cross_entropy").result()
        return output.metrics["loss:sum"]

    def _evaluate(self, training: TrainingClient, source) -> tuple[dict[str, float], list]:
        loss = self._heldout_loss(training, source)
        sampler = training.save_weights_and_get_sampling_client()
        accuracy, examples = source.accuracy(sampler, max_tokens=self.config.max_new_tokens)
        return {"eval/loss": loss, "eval/accuracy": accuracy}, examples

    @staticmethod
    def _show_examples(logger: MetricsLogger, examples: list[Example]) -> None:
        for example in examples:
            mark = "ok" if example.correct else f"wrong, expected {example.reference!r}"
            logger.console.print(f"  {example.prompt!r} -> {example.reply!r}  ({mark})")


def export_model_dir(service: ServiceClient, sampler_path: str, *, out_dir: Path) -> Path:
    """Copy full-model sampler weights (a HF model directory) to `out_dir`.

    Local files only: it reads the service's checkpoint storage, so it needs the in-process
    client. Files are hard-linked where the file system allows (no second copy on disk).
    """
    _, directory = service.storage.existing(sampler_path)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; the export does not overwrite it")

    def link_or_copy(source: str, target: str) -> None:
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)

    shutil.copytree(
        directory,
        out_dir,
        copy_function=link_or_copy,
        ignore=shutil.ignore_patterns(SAMPLER_FILE),
    )
    return out_dir
