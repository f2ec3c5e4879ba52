"""The two RL loops over the step functions (steps.py): synchronous and asynchronous.

`run_sync` (`mode="sync"`) samples, then trains, one RL step at a time. `run_async`
(`mode="async"`) overlaps sampling for later steps with training on this one: a batch for RL
step j may be sampled as soon as the policy is at most `max_staleness` steps behind the one
that will train on it (j - max_staleness steps done) - and, so that a resumed run samples
exactly what an uninterrupted one did, not before the last checkpoint at or before j
(`barrier(j)` steps done). The asynchronous loop keeps every batch it may already sample in
flight: its requests run on the sampling client's worker, concurrently with `forward_backward`
on the training worker. Old sampling clients stay valid while the trainer steps
(copy-on-write in temper/client/), and the loss corrects for the lag with the sampler's
logprobs (PPO / importance ratio).

`run_async(kind="inflight")` (`mode="inflight"`) is PipelineRL-style: every batch samples on
the training client's one in-flight target (temper/client/inflight.py), and each submission,
right after an optimizer step, moves it to the newest weights, for the episodes of earlier
batches still decoding as well (they continue on the new weights over their cached keys and
values). The sampler's logprobs are those of the weights each token was drawn with, so the
same loss corrects for the lag, which is shorter than with snapshots.

Both submit batches in step order from the main thread, so the problem stream and sample
seeds are the same; with `max_staleness=0` every batch is sampled right before its own step
and the asynchronous run equals the synchronous one bitwise. After each RL step both call
`on_step_done(steps_done)` (the job logs rewards and saves checkpoints there).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from temper.rl.steps import RLSteps, SamplerKind, SubmittedStep


def run_sync(steps: RLSteps, *, first: int, on_step_done: Callable[[int], None]) -> None:
    """Sample, then train, one RL step at a time, from RL step `first`."""
    for rl_step in range(first, steps.config.steps):
        steps.finish(steps.submit(rl_step, steps_done=rl_step))
        on_step_done(rl_step + 1)


def run_async(
    steps: RLSteps,
    *,
    first: int,
    max_staleness: int,
    barrier: Callable[[int], int],
    on_step_done: Callable[[int], None],
    kind: SamplerKind = "snapshot",
) -> None:
    """RL steps `first`.. with up to `max_staleness` later batches in flight. `kind`
    'inflight' (PipelineRL-style): the batches share the in-flight target, and each
    submission moves it to the newest weights, for the episodes still decoding too."""
    num_steps = steps.config.steps
    in_flight: deque[SubmittedStep] = deque()
    next_batch = first
    for rl_step in range(first, num_steps):
        # rl_step steps are done: submit every batch that may be sampled from these weights.
        while (
            next_batch < num_steps
            and next_batch - max_staleness <= rl_step
            and barrier(next_batch) <= rl_step
        ):
            in_flight.append(steps.submit(next_batch, steps_done=rl_step, kind=kind))
            next_batch += 1
        submitted = in_flight.popleft()
        assert submitted.rl_step == rl_step, (submitted.rl_step, rl_step)
        steps.finish(submitted)
        on_step_done(rl_step + 1)
