"""Episodes: the one rollout path of RL, single-turn problems and multi-turn environments alike.

Many episodes are in flight at once, each turn sampled as soon as the last step returned.

Shapes: C completion tokens of an episode (every token after its initial observation: the
policy's actions and the environment's observations between them).

An episode starts from its env's initial observation. Each turn the runner asks the sampling
client for one action (the env's stop tokens end it), hands the exact sampled tokens to
`env.step` on a thread pool, appends the observation tokens it returns and asks for the next
turn; the context is only ever extended, never re-tokenized, so the trainer scores exactly the
sequence the sampler produced. An episode ends when the env says `done`, after `max_turns`
actions, or when the context has no room for another action (`max_context` tokens); the reason
is recorded. The last observation is appended only when another action follows it.

Concurrency: one driver thread per batch of episodes sends every live episode's next request
as soon as its env step returns. The sampling client coalesces the requests that arrive while
it decodes into its next batch (temper/api/futures.py), so the next turns of all live episodes
decode together; env steps run on the pool, so a slow step (I/O, a tool, a subprocess) holds up
only its own episode. When the sampler is idle and steps that started together are still
running, the driver waits up to `batch_window_s` for them, so a fast env's next turns are not
split into a lone first request and the rest.

`start` sends every episode's first turn before it returns (so the batches of successive
starts never mix) and `wait` collects the trajectories. The caller gives one seed per group.
A group of a multi-turn source (`turns="multi"`) draws one seed per episode from it, and each
episode's turns are seeded from its own, so a seeded run's tokens are reproducible whatever
order the steps finish in (the engine's draws depend only on a row's
seed and position, not on the batch). Its logprobs are not: the engine's results depend on the
batch at rounding level, and which turns share a batch depends on when env steps return.
`turn_batching="by_turn"` makes them reproducible too (a resumed run then equals an
uninterrupted one bitwise): episodes advance in lockstep, every live episode's next turn is
sent, in episode order, inside one `SamplingClient.batch()` once all steps of the turn have
returned, so a slow step holds up every episode of the batch.

A group of a single-turn source (`turns="single"`, env.py) is one request of `group_size`
completions of its shared prompt, seeded with the group's seed: one prefill for the group.
Every group's request is sent at once and `wait` scores each completion by its env's one step
on the caller's thread, group by group (a problem's reward is cheap and no later turn waits
for it: a driver thread or the pool would cost more than the step). Its trajectories carry the
env's metrics only (no turns, end reasons or env seconds: there is one turn and nothing else to
end it) and no action mask.

An env whose `step` raises stops the batch with an `EnvStepError` naming the env, the group,
the episode and the turn.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from temper.api.types import ModelInput, RoutedExperts, SamplingParams
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.rl.env import Env, StepResult, Turns
from temper.rl.rollout import Trajectory
from temper.tasks.problem import finite_float

END_REASONS = ("done", "max_turns", "context")
"""Why an episode ended, besides reasons an env gives itself (`StepResult.end_reason`)."""


class EnvStepError(RuntimeError):
    """An environment's `step` raised, or returned something other than a StepResult or one
    with a field of the wrong kind (a reward that is not a finite number, text as tokens)."""


DEFAULT_MAX_CONTEXT = 256
"""`EpisodeRunner.Config.max_context` of a runner built without the sampler's max_seq_len."""


class EpisodeRunner(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        max_turns: int = 8
        """Most actions per episode; an episode still running after them ends ("max_turns")."""
        max_context: int | None = None
        """Most tokens in an episode's context (prompt, actions, observations); an episode
        without room for one more action token ends ("context"). At most the sampler's
        `max_seq_len`; None: all of it (the RL job passes its `sampler.max_seq_len`; a runner
        built alone takes `DEFAULT_MAX_CONTEXT`)."""
        env_workers: int = 8
        """Threads that run env steps (a slow step holds up only its own episode)."""
        batch_window_s: float = 0.002
        """How long an idle sampler waits for env steps started alongside the first one
        to return, so their next turns decode in one batch ("as_ready" only)."""
        turn_batching: Literal["as_ready", "by_turn"] = "as_ready"
        """'as_ready': an episode's next turn is sent as soon as its env step returns (a slow
        step holds up only its own episode; logprobs vary at rounding level with the timing).
        'by_turn': every episode's turn k decodes in one batch once all turn k-1 steps are
        back (reproducible logprobs, bitwise resume; the slowest step sets the pace)."""

        def __post_init__(self) -> None:
            owner = "EpisodeRunner.Config"
            for name in ("max_turns", "env_workers"):
                check_range(getattr(self, name), field=f"{owner}.{name}", at_least=1)
            check_range(self.max_context, field=f"{owner}.max_context", at_least=1, also=(None,))
            check_choice(
                self.turn_batching, field=f"{owner}.turn_batching", choices=("as_ready", "by_turn")
            )
            check_range(self.batch_window_s, field=f"{owner}.batch_window_s", at_least=0)

    def __init__(self, config: Config, *, max_seq_len: int | None = None) -> None:
        """`max_seq_len`: the sampler's, what `max_context=None` means."""
        max_context = config.max_context or max_seq_len or DEFAULT_MAX_CONTEXT
        self.config = dataclasses.replace(config, max_context=max_context)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.env_workers, thread_name_prefix="env-step"
        )

    def start(
        self,
        sampling_client: Any,
        groups: Sequence[Sequence[Env]],
        *,
        params: SamplingParams,
        seeds: Sequence[int],
        turns: Turns = "multi",
    ) -> RunningEpisodes:
        """Start every episode of `groups` (one seed per group, in order; `turns` as the groups'
        source says, env.py) and return once their first turns are sent."""
        if len(seeds) != len(groups):
            raise ValueError(f"EpisodeRunner.start: {len(seeds)} seeds for {len(groups)} groups")
        return RunningEpisodes(
            self.config, sampling_client=sampling_client, groups=groups, params=params,
            seeds=seeds, turns=turns, pool=self._pool,
        )  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(eq=False)
class _Episode:
    env: Env
    group: int
    index: int
    prompt: list[int]
    seeds: random.Random | None
    """Draws each turn's sampling seed (None: one turn, sampled with its group's request)."""
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str = "length"
    end_reason: str | None = None
    env_seconds: float = 0.0
    routed_experts: RoutedExperts | None = None
    support: list[list[int]] | None = None
    """The sampler's kept ids per completion token, when it returns them."""
    versions: tuple[int, ...] | None = None
    """The policy versions its actions were sampled with (in-flight clients only)."""

    @property
    def num_turns(self) -> int:
        return len(self.turn_rewards)

    def name(self) -> str:
        return f"{type(self.env).__name__} (group {self.group}, episode {self.index})"

    def trajectory(self, *, turns: Turns) -> Trajectory:
        if turns == "single":
            return Trajectory(
                prompt=self.prompt,
                completion=self.completion,
                sampler_logprobs=self.logprobs,
                reward=self.turn_rewards[0] if self.turn_rewards else 0.0,
                stop_reason=self.stop_reason,
                metrics=dict(self.metrics),
                routed_experts=self.routed_experts,
                sampler_support=self.support,
                weight_versions=self.versions,
            )
        metrics = dict(self.metrics)
        metrics["turns"] = float(self.num_turns)
        metrics["env_seconds"] = self.env_seconds
        metrics[f"end/{self.end_reason}"] = 1.0
        return Trajectory(
            prompt=self.prompt,
            completion=self.completion,
            sampler_logprobs=self.logprobs,
            reward=sum(self.turn_rewards),
            stop_reason=self.stop_reason,
            metrics=metrics,
            action_mask=self.mask,
            routed_experts=self.routed_experts,
            sampler_support=self.support,
            weight_versions=self.versions,
        )


class RunningEpisodes:
    """A batch of episodes in flight on one sampling client (its driver is a thread)."""

    def __init__(
        self,
        config: EpisodeRunner.Config,
        *,
        sampling_client: Any,
        groups: Sequence[Sequence[Env]],
        params: SamplingParams,
        seeds: Sequence[int],
        turns: Turns,
        pool: concurrent.futures.Executor,
    ) -> None:
        self.config, self.params, self.turns, self._pool = config, params, turns, pool
        self.sampler_version: int = sampling_client.version
        self._client = sampling_client
        self._max_turns = 1 if turns == "single" else config.max_turns
        self._groups = [
            _episodes(group, group_index=g, seed=seed, turns=turns)
            for g, (group, seed) in enumerate(zip(groups, seeds, strict=True))
        ]
        self._events: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self._num_sampling = self._num_stepping = 0
        self._error: BaseException | None = None
        # Single-turn: one request a group, all sent now; `wait` reads them in order and
        # scores each completion on the caller's thread (no driver: a reward is cheap).
        self._requests: list[tuple[list[_Episode], Any]] = []
        self._thread: threading.Thread | None = None
        if turns == "single":
            with self._client.batch():
                for group, seed in zip(self._groups, seeds, strict=True):
                    self._sample_group(group, seed=seed)
        else:
            self._next_turns([episode for group in self._groups for episode in group])
            self._thread = threading.Thread(target=self._drive, name="episodes", daemon=True)
            self._thread.start()

    def wait(self) -> list[list[Trajectory]]:
        """The episodes' trajectories, by group, once all have ended."""
        if self._thread is None:
            for group, future in self._requests:
                self._finish_group(group, future)
        else:
            self._thread.join()
            if self._error is not None:
                raise self._error
        self._client = None  # the version's snapshot may go (weight_sync copy-on-write)
        return [[e.trajectory(turns=self.turns) for e in group] for group in self._groups]

    # -- the driver thread -----------------------------------------------------------------

    def _drive(self) -> None:
        try:
            by_turn = self.config.turn_batching == "by_turn"
            waiting: list[_Episode] = []  # by_turn: episodes whose turn's step is back
            while self._num_sampling or self._num_stepping:
                ready = self._handle([self._events.get(), *self._drain()])
                if by_turn:
                    waiting += ready
                    if self._num_sampling or self._num_stepping:
                        continue
                    ready, waiting = sorted(waiting, key=lambda e: (e.group, e.index)), []
                elif ready and not self._num_sampling and self._num_stepping:
                    ready += self._linger()
                self._next_turns(ready)
        except BaseException as error:  # handed to wait(), on the caller's thread
            self._error = error
        finally:
            self._client = None

    def _drain(self) -> list[tuple[str, Any, Any]]:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def _linger(self) -> list[_Episode]:
        """Episodes whose steps return within the batch window (the sampler is idle)."""
        ready: list[_Episode] = []
        deadline = time.perf_counter() + self.config.batch_window_s
        while self._num_stepping and (left := deadline - time.perf_counter()) > 0:
            try:
                event = self._events.get(timeout=left)
            except queue.Empty:
                break
            ready += self._handle([event, *self._drain()])
        return ready

    def _handle(self, events: list[tuple[str, Any, Any]]) -> list[_Episode]:
        """Sampled actions go to their env; returned steps give the episodes to sample next."""
        ready = []
        for kind, episode, future in events:
            if kind == "sample":
                self._num_sampling -= 1
                self._start_step(episode, future.result().sequences[0])
            else:
                self._num_stepping -= 1
                if self._apply_step(episode, future):
                    ready.append(episode)
        return ready

    def _next_turns(self, episodes: list[_Episode]) -> None:
        """The next turn of each, sent as one batch (in this order)."""
        with self._client.batch():
            for episode in episodes:
                self._next_turn(episode)

    def _sample_group(self, group: list[_Episode], *, seed: int) -> None:
        """A single-turn group's one request: `len(group)` completions of its shared prompt."""
        first = group[0]
        room = self.config.max_context - len(first.prompt)
        if room < 1:
            for episode in group:
                episode.end_reason = "context"
            return
        params = dataclasses.replace(
            self.params,
            max_tokens=min(self.params.max_tokens, room),
            stop=list(first.env.stop_token_ids()),
            seed=seed,
        )
        future = self._client.sample(ModelInput.from_ints(first.prompt), len(group), params)
        self._requests.append((group, future))

    def _finish_group(self, group: list[_Episode], future: Any) -> None:
        """A single-turn group's completions, each scored by its env."""
        for member, sequence in zip(group, future.result().sequences, strict=True):
            self._step_inline(member, self._take_action(member, sequence))

    def _next_turn(self, episode: _Episode) -> None:
        room = self.config.max_context - len(episode.prompt) - len(episode.completion)
        if room < 1:
            episode.end_reason = "context"
            return
        assert episode.seeds is not None
        params = dataclasses.replace(
            self.params,
            max_tokens=min(self.params.max_tokens, room),
            stop=list(episode.env.stop_token_ids()),
            seed=episode.seeds.getrandbits(63),
        )
        context = ModelInput.from_ints(episode.prompt + episode.completion)
        future = self._client.sample(context, 1, params)
        self._num_sampling += 1
        future.add_done_callback(lambda done: self._events.put(("sample", episode, done)))

    def _take_action(self, episode: _Episode, sequence: Any) -> list[int]:
        """Append a sampled action to the episode; its tokens."""
        action = list(sequence.tokens)
        episode.completion += action
        episode.logprobs += list(sequence.logprobs)
        episode.mask += [1.0] * len(action)
        if sequence.support is not None:
            episode.support = (episode.support or []) + list(sequence.support)
        episode.stop_reason = sequence.stop_reason
        # The last action's routes cover its whole context, so the episode's datum's too.
        episode.routed_experts = sequence.routed_experts
        versions = getattr(sequence, "weight_versions", None)  # in-flight clients' sequences
        if versions:
            episode.versions = tuple(sorted({*(episode.versions or ()), *versions}))
        return action

    def _start_step(self, episode: _Episode, sequence: Any) -> None:
        action = self._take_action(episode, sequence)
        future = self._pool.submit(_timed_step, episode.env, action)
        self._num_stepping += 1
        future.add_done_callback(lambda done: self._events.put(("step", episode, done)))

    def _apply_step(self, episode: _Episode, future: concurrent.futures.Future) -> bool:
        """Record a step returned from the env pool; whether the episode goes on."""
        try:
            result, seconds = future.result()
        except Exception as error:
            raise _step_error(episode, error) from error
        return self._record_step(episode, result, seconds=seconds)

    def _step_inline(self, episode: _Episode, action: list[int]) -> bool:
        """Step the env on this thread (a single-turn reward: cheaper than a hand-off)."""
        try:
            result, seconds = _timed_step(episode.env, action)
        except Exception as error:
            raise _step_error(episode, error) from error
        return self._record_step(episode, result, seconds=seconds)

    def _record_step(self, episode: _Episode, result: StepResult, *, seconds: float) -> bool:
        """Record a step's result; whether the episode goes on."""
        turn = episode.num_turns + 1
        if not isinstance(result, StepResult):
            raise EnvStepError(
                f"environment {episode.name()} returned {type(result).__name__} from step in "
                f"turn {turn}; step must return a StepResult"
            )
        problem = _bad_step_field(result)
        if problem is not None:
            raise EnvStepError(f"environment {episode.name()} in turn {turn}: {problem}")
        episode.env_seconds += seconds
        episode.turn_rewards.append(float(result.reward))
        for name, value in result.metrics.items():
            episode.metrics[name] = episode.metrics.get(name, 0.0) + float(value)
        if result.done:
            episode.end_reason = result.end_reason or "done"
            return False
        if turn >= self._max_turns:
            episode.end_reason = "max_turns"
            return False
        observation = list(result.next_observation or [])
        if len(episode.prompt) + len(episode.completion) + len(observation) >= (
            self.config.max_context
        ):
            episode.end_reason = "context"
            return False
        episode.completion += observation
        episode.logprobs += [0.0] * len(observation)
        episode.mask += [0.0] * len(observation)
        if episode.support is not None:  # the environment's tokens: each its own support
            episode.support += [[token] for token in observation]
        return True


def _bad_step_field(result: StepResult) -> str | None:
    """What is wrong with a step's result, naming the field; None if nothing is."""
    if finite_float(result.reward) is None:
        return f"StepResult.reward must be a finite number, got {result.reward!r}"
    for name, value in result.metrics.items():
        if finite_float(value) is None:
            return f"StepResult.metrics[{name!r}] must be a finite number, got {value!r}"
    observation = result.next_observation
    if observation is not None and (
        isinstance(observation, str) or not all(isinstance(t, int) for t in observation)
    ):
        return f"StepResult.next_observation must be a list of token ids, got {observation!r}"
    return None


def _timed_step(env: Env, action: list[int]) -> tuple[StepResult, float]:
    start = time.perf_counter()
    result = env.step(action)
    return result, time.perf_counter() - start


def _step_error(episode: _Episode, error: Exception) -> EnvStepError:
    turn = episode.num_turns + 1
    return EnvStepError(
        f"environment {episode.name()} raised in turn {turn}: {type(error).__name__}: {error}"
    )


def _episodes(group: Sequence[Env], *, group_index: int, seed: int, turns: Turns) -> list[_Episode]:
    """A group's episodes: a single-turn group's share its first env's prompt (a group starts
    alike) and its request's seed; a multi-turn group's draw their seeds from the group's."""
    if turns == "single":
        prompt = list(group[0].initial_observation())
        return [
            _Episode(env=env, group=group_index, index=i, prompt=list(prompt), seeds=None)
            for i, env in enumerate(group)
        ]
    rng = random.Random(seed)
    member_seeds = [rng.getrandbits(63) for _ in group]
    return [
        _Episode(
            env=env,
            group=group_index,
            index=i,
            prompt=list(env.initial_observation()),
            seeds=random.Random(member_seed),
        )
        for i, (env, member_seed) in enumerate(zip(group, member_seeds, strict=True))
    ]


def run_episodes(
    runner: EpisodeRunner,
    sampling_client: Any,
    groups: Sequence[Sequence[Env]],
    *,
    params: SamplingParams,
    rng: random.Random,
    turns: Turns = "multi",
) -> list[list[Trajectory]]:
    """Start and wait in one call, with every group's seed drawn from `rng` in order."""
    seeds = [rng.getrandbits(63) for _ in groups]
    return runner.start(sampling_client, groups, params=params, seeds=seeds, turns=turns).wait()
