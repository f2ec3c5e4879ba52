"""Multi-turn episodes through a real sampling client: a scripted env checks that the trainer
sees exactly the sampled tokens plus the observation tokens, with loss only on the sampled
ones, that trainer and sampler agree on every sampled token, that limits end episodes with
their reason, and that a raising env, or one returning a bad StepResult field, stops the batch
with an error naming it."""

from __future__ import annotations

import random

import pytest

from temper.api.types import SamplingParams
from temper.client.service_client import ServiceClient
from temper.rl.env import StepResult
from temper.rl.episodes import EnvStepError, EpisodeRunner, run_episodes
from temper.rl.job import RLJob
from temper.rl.rollout import policy_datum
from temper.rl.step_metrics import StepStats, episode_stats, mismatch_stats

OBSERVATION_TEXT = "+-"


class ScriptedEnv:
    """Answers every action with the same observation; ends after `num_turns` actions."""

    def __init__(self, tokenizer, *, num_turns: int = 3, raise_on_turn: int | None = None):
        self.tokenizer, self.num_turns, self.raise_on_turn = tokenizer, num_turns, raise_on_turn
        self.actions: list[list[int]] = []

    def initial_observation(self) -> list[int]:
        return self.tokenizer.encode("12=")

    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def step(self, action_tokens) -> StepResult:
        self.actions.append(list(action_tokens))
        if len(self.actions) == self.raise_on_turn:
            raise RuntimeError("scripted failure")
        done = len(self.actions) == self.num_turns
        return StepResult(
            reward=0.5,
            done=done,
            next_observation=self.tokenizer.encode(OBSERVATION_TEXT),
            metrics={"tool_calls": 1.0},
        )


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    service = ServiceClient(storage_dir=tmp_path_factory.mktemp("storage"))
    return service.create_training_client("tiny")


def _run(training, envs, *, group_size=2, **runner_fields):
    runner = EpisodeRunner.Config(**runner_fields).build()
    sampler = training.save_weights_and_get_sampling_client()
    groups = [envs[i : i + group_size] for i in range(0, len(envs), group_size)]
    params = SamplingParams(max_tokens=3, temperature=1.0)
    try:
        return run_episodes(runner, sampler, groups, params=params, rng=random.Random(0))
    finally:
        runner.close()


def test_trainer_sees_the_sampled_tokens_plus_observations_with_loss_on_actions_only(training):
    tokenizer = training.get_tokenizer()
    envs = [ScriptedEnv(tokenizer) for _ in range(4)]
    groups = _run(training, envs)
    observation = tokenizer.encode(OBSERVATION_TEXT)
    flat = [t for group in groups for t in group]
    for env, trajectory in zip(envs, flat, strict=True):
        assert len(env.actions) == 3
        # The context: the exact sampled actions with the observations between them (the last
        # step's observation is not appended: nothing samples after it).
        a1, a2, a3 = env.actions
        assert trajectory.prompt == tokenizer.encode("12=")
        assert trajectory.completion == a1 + observation + a2 + observation + a3
        mask = [1.0] * len(a1) + [0.0] * 2 + [1.0] * len(a2) + [0.0] * 2 + [1.0] * len(a3)
        assert trajectory.action_mask == mask
        assert all(
            lp == 0.0 for lp, m in zip(trajectory.sampler_logprobs, mask, strict=True) if not m
        )
        assert all(lp < 0.0 for lp, m in zip(trajectory.sampler_logprobs, mask, strict=True) if m)
        assert trajectory.reward == 1.5
        assert trajectory.metrics["turns"] == 3.0 and trajectory.metrics["end/done"] == 1.0
        assert trajectory.metrics["tool_calls"] == 3.0

        datum = policy_datum(trajectory, advantage=0.25)
        tokens = trajectory.prompt + trajectory.completion
        assert datum.model_input.to_ints() == tokens[:-1]
        inputs = {name: value.tolist() for name, value in datum.loss_fn_inputs.items()}
        assert inputs["target_tokens"] == tokens[1:]
        num_prompt_targets = len(trajectory.prompt) - 1
        assert inputs["advantages"] == [0.0] * num_prompt_targets + [0.25 * m for m in mask]
        assert inputs["logprobs"][num_prompt_targets:] == pytest.approx(trajectory.sampler_logprobs)

    # Trainer and sampler logprobs agree on every sampled token (the RL step's tolerance).
    data = [policy_datum(t, advantage=0.0) for t in flat]
    output = training.forward_backward(data, "ppo").result()
    stats = StepStats()
    mismatch_stats(stats, [(flat, output)])
    episode_stats(stats, groups)
    metrics = StepStats.combine([stats])
    assert metrics["mismatch/logprob_diff_max"] < 1e-4
    assert metrics["episode/turns"] == 3.0 and metrics["episode/end/done"] == 1.0
    assert metrics["episode/tool_calls"] == 3.0


def test_max_turns_and_context_end_episodes_with_their_reason(training):
    tokenizer = training.get_tokenizer()
    (group,) = _run(training, [ScriptedEnv(tokenizer, num_turns=10) for _ in range(2)], max_turns=2)
    assert all(t.metrics["turns"] == 2.0 and t.metrics["end/max_turns"] == 1.0 for t in group)
    # Room for the prompt (3 tokens) and a few more: the context runs out first.
    envs = [ScriptedEnv(tokenizer, num_turns=10) for _ in range(2)]
    (group,) = _run(training, envs, max_turns=10, max_context=9)
    for env, trajectory in zip(envs, group, strict=True):
        assert trajectory.metrics["end/context"] == 1.0
        assert len(trajectory.prompt) + len(trajectory.completion) <= 9
        assert trajectory.num_action_tokens == sum(len(a) for a in env.actions)


def test_an_env_that_raises_stops_the_batch_with_an_error_naming_it(training):
    tokenizer = training.get_tokenizer()
    envs = [ScriptedEnv(tokenizer), ScriptedEnv(tokenizer, raise_on_turn=2)]
    with pytest.raises(EnvStepError, match=r"ScriptedEnv \(group 0, episode 1\).*turn 2") as info:
        _run(training, envs)
    assert "scripted failure" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)


class BadResultEnv(ScriptedEnv):
    """Returns a StepResult with one field of the wrong kind."""

    def __init__(self, tokenizer, **fields):
        super().__init__(tokenizer)
        self.fields = fields

    def step(self, action_tokens) -> StepResult:
        result = super().step(action_tokens)
        return StepResult(**{**result.__dict__, **self.fields})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"reward": "yes"}, r"StepResult\.reward must be a finite number, got 'yes'"),
        ({"reward": float("nan")}, r"StepResult\.reward must be a finite number, got nan"),
        ({"metrics": {"correct": None}}, r"StepResult\.metrics\['correct'\] must be a finite"),
        ({"next_observation": "+-"}, r"StepResult\.next_observation must be a list of token ids"),
    ],
)
def test_a_bad_step_result_is_an_error_naming_the_env_and_field(training, fields, message):
    envs = [ScriptedEnv(training.get_tokenizer()), BadResultEnv(training.get_tokenizer(), **fields)]
    with pytest.raises(EnvStepError, match=r"BadResultEnv \(group 0, episode 1\) in turn 1: "):
        _run(training, envs)
    with pytest.raises(EnvStepError, match=message):
        _run(training, envs[1:], group_size=1)


def test_seeded_episodes_repeat_whatever_order_steps_finish_in(training):
    tokenizer = training.get_tokenizer()
    first = _run(training, [ScriptedEnv(tokenizer) for _ in range(4)], env_workers=1)
    second = _run(training, [ScriptedEnv(tokenizer) for _ in range(4)], env_workers=4)
    assert [[t.completion for t in g] for g in first] == [[t.completion for t in g] for g in second]


def test_turn_batching_must_be_a_known_mode():
    with pytest.raises(ValueError, match=r"turn_batching must be 'as_ready' or 'by_turn'"):
        EpisodeRunner.Config(turn_batching="lockstep")


def test_max_context_defaults_to_the_samplers_whole_context():
    from temper.rl.envs import GuessNumber
    from temper.rl.episodes import DEFAULT_MAX_CONTEXT

    # The job's defaults fit together for any env: the sampler's 64 positions, not 256.
    config = RLJob.Config(env=GuessNumber.Config())
    assert config.episodes.max_context is None and config.sampler.max_seq_len == 64
    assert config.episodes.build(max_seq_len=64).config.max_context == 64
    assert EpisodeRunner.Config(max_context=32).build(max_seq_len=64).config.max_context == 32
    assert EpisodeRunner.Config().build().config.max_context == DEFAULT_MAX_CONTEXT
    with pytest.raises(ValueError, match=r"episodes.max_context \(128\) exceeds"):
        RLJob.Config(env=GuessNumber.Config(), episodes=EpisodeRunner.Config(max_context=128))
