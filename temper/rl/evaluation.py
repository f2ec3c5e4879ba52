"""Held-out evaluation of the RL job: greedy episodes on the env source's fixed held-out
environments (a single-turn task's held-out problems, or a multi-turn source's), played
through the same episode runner as the rollouts."""

from __future__ import annotations

from temper.api.types import SamplingParams
from temper.client.training_client import TrainingClient
from temper.distributed.ranks import Ranks
from temper.rl.env import EnvSource
from temper.rl.episodes import EpisodeRunner


class HeldoutSuccess:
    """The share of a source's fixed held-out episodes, played greedily, that succeed (the
    env's `correct`, at most 1 an episode; a single-turn task's reward), each rank playing its
    part. Every evaluation plays fresh envs from the source's `heldout_envs`: an env keeps its
    episode's state, so a played one cannot replay."""

    def __init__(
        self,
        *,
        training: TrainingClient,
        source: EnvSource,
        num_envs: int,
        episodes: EpisodeRunner,
        max_tokens: int,
        ranks: Ranks,
    ) -> None:
        if not source.heldout_envs(num_envs):
            raise ValueError("RLJob: the env source has no held-out environments to evaluate on")
        self.training, self.source, self.num_envs = training, source, num_envs
        self.episodes, self.ranks = episodes, ranks
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    def __call__(self) -> float:
        sampler = self.training.save_weights_and_get_sampling_client()
        envs = self.source.heldout_envs(self.num_envs)
        mine = envs[self.ranks.split(len(envs))]
        total = 0.0
        if mine:
            # Groups of one, each one request of one sample whatever the source's `turns`;
            # greedy, so the seeds change nothing.
            running = self.episodes.start(
                sampler, [[env] for env in mine], params=self.params, seeds=[0] * len(mine)
            )
            total = sum(min(group[0].metrics.get("correct", 0.0), 1.0) for group in running.wait())
        return self.ranks.sum([total])[0] / len(envs)
