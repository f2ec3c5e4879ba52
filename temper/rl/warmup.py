"""Supervised warm-up through the client API, before RL.

From random weights, RL alone does not find sum-of-digits (rewards stay near zero, see
DESIGN.md 7), so the recipe first trains on correct answers with `cross_entropy`, then hands
the model to the RL loop. Learning rate: linear warm-up, then cosine decay to 10%.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from temper.api.types import AdamParams, Datum, ModelInput
from temper.client.training_client import TrainingClient
from temper.config.checks import check_range
from temper.config.configurable import Configurable
from temper.distributed.ranks import Ranks
from temper.models.common.moe_stats import router_metrics
from temper.rl.env import Demonstration
from temper.trainer.schedule import warmup_cosine


class SFTWarmup(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        steps: int = 1000
        """Supervised steps before RL (0 skips the warm-up)."""
        batch_size: int = 64
        """Problems per step."""
        learning_rate: float = 2e-3
        """Peak AdamW learning rate."""
        warmup_steps: int = 20
        """Steps of linear learning-rate warm-up."""
        eval_every: int = 100
        """Steps between held-out evaluations during the warm-up (plus one after its last
        step); 0 = only after the last."""

        def __post_init__(self) -> None:
            owner = "SFTWarmup.Config"
            check_range(self.steps, field=f"{owner}.steps", at_least=0)
            check_range(self.batch_size, field=f"{owner}.batch_size", at_least=1)
            check_range(self.learning_rate, field=f"{owner}.learning_rate", greater_than=0)
            check_range(
                self.eval_every,
                field=f"{owner}.eval_every",
                at_least=0,
                hint="0 = only after the last step",
            )

    def evaluates_after(self, step: int) -> bool:
        """Whether held-out accuracy is measured after warm-up step `step`."""
        every = self.config.eval_every
        return step == self.config.steps - 1 or (every > 0 and (step + 1) % every == 0)

    def __init__(self, config: Config) -> None:
        self.config = config

    def learning_rate(self, step: int) -> float:
        config = self.config
        factor = warmup_cosine(step, warmup_steps=config.warmup_steps, total_steps=config.steps)
        return config.learning_rate * factor

    def run_demonstrations(
        self,
        training_client: TrainingClient,
        *,
        demonstrate: Callable[[random.Random], Demonstration],
        rng: random.Random,
        on_step: Callable[[int, dict[str, float]], None],
        start_step: int = 0,
        ranks: Ranks | None = None,
    ) -> None:
        """Train steps `start_step`..`steps - 1`, each on `batch_size` whole demonstrated
        episodes (`demonstrate(rng)`, an env source's: a single-turn task's problem and answer,
        or a multi-turn episode), weighted per policy token as the demonstration says; the loss
        is the mean over the batch's weighted tokens. `on_step(step, metrics)` after each (for
        logging, evals and checkpoints); a resumed run passes the steps already done.

        On several `ranks` every rank draws the whole batch (the RNG copies stay equal) and
        trains on its part; the loss is normalized by the whole batch's weighted tokens, so
        the summed gradient is the one-process gradient of the batch."""

        def batch(part: slice) -> list[Datum]:
            demos = [demonstrate(rng) for _ in range(self.config.batch_size)]
            num_targets = sum(sum(1 for w in demo.weights[1:] if w) for demo in demos)
            return [
                Datum(
                    model_input=ModelInput.from_ints(demo.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": demo.tokens[1:],
                        "weights": [w / num_targets for w in demo.weights[1:]],
                    },
                )
                for demo in demos[part]
            ]

        self._train(training_client, batch, on_step=on_step, start_step=start_step, ranks=ranks)

    def _train(
        self,
        training_client: TrainingClient,
        batch: Callable[[slice], list[Datum]],
        *,
        on_step: Callable[[int, dict[str, float]], None],
        start_step: int,
        ranks: Ranks | None,
    ) -> None:
        """Steps `start_step`.. on `batch(this rank's part)` each."""
        ranks = ranks or Ranks.single()
        part = ranks.split(self.config.batch_size)
        for step in range(start_step, self.config.steps):
            data = batch(part)
            backward = training_client.forward_backward(data, "cross_entropy")
            learning_rate = self.learning_rate(step)
            optim = training_client.optim_step(
                AdamParams(learning_rate=learning_rate, beta2=0.95, grad_clip_norm=1.0)
            )
            metrics = backward.result().metrics
            grad_norm = optim.result().metrics["grad_norm:mean"]
            on_step(
                step,
                {
                    "warmup/loss": metrics["loss:sum"],
                    "optim/grad_norm": grad_norm,
                    "optim/lr": learning_rate,
                    **router_metrics(metrics),  # MoE policies
                },
            )
