"""Which figures a run's metrics make: one per question a person asks of a run, as specs.

A `FigureSpec` names its file, the question it answers (its title), a one-line caption and its
panels; a `PanelSpec` names its metrics, the y-axis label with units and how to draw them
(smoothed or raw, log scale, a 0..1 axis for fractions). plots.py draws them; the choice lives
here so tests can assert on it without reading pixels.

Figures, each only when it has something to show:
- `learning`: is it learning? Rollout reward, held-out accuracy, train and held-out loss.
- `sampling`: is sampling faithful to training? Sampler-trainer logprob mismatch and, in an
  asynchronous run, the staleness of the sampled batches.
- `rollouts`: what do the samples look like? Lengths, entropy, accuracy, spread of rewards.
- `optimizer`: is the optimizer healthy? Gradient norm, the learning rate of each phase on its
  own panel (drawn raw: it is a schedule, not a noisy measurement), KL to the reference policy.
- `time`: where does the time go? Seconds per step by phase, throughput.
- `router`: are the experts used evenly? (MoE models) The load-balancing loss, the largest
  expert's load and the router entropy, over layers and, as heatmaps, per layer.
- `other`: any metric no figure above names (a recipe's own), one panel each.

A metric whose value never changes (async staleness 0 in a synchronous run, a stop rate of 1)
gets no panel, except the learning rate and per-layer metrics (a heatmap row each). Phases: a
run with `warmup/*` metrics had an SFT warm-up over their steps, and RL over the steps of
`reward/*`; other runs have one phase and no marks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from temper.observability.metrics import PER_LAYER
from temper.observability.series import Series

UNIT_RANGE_KEYS = ("accuracy", "stopped", "groups_kept")
"""Name parts of metrics that are fractions (drawn on a 0..1 axis)."""
LEARNING_RATE_KEY = "optim/lr"


@dataclasses.dataclass(frozen=True)
class RunPhase:
    """Steps `first_step` .. `last_step` of a run, marked on the figures as `name`."""

    name: str
    first_step: int
    last_step: int


@dataclasses.dataclass(frozen=True)
class LineSpec:
    key: str
    """The metric drawn."""
    label: str
    """Its legend entry."""
    smooth: bool = True
    """Raw values faint plus a moving average (dense noisy series); else the raw values only
    (schedules, sparse evaluations)."""


@dataclasses.dataclass(frozen=True)
class PanelSpec:
    title: str
    ylabel: str
    """The y-axis label, with units."""
    lines: tuple[LineSpec, ...]
    unit_range: bool = False
    """The y axis covers 0..1 (fractions), so noise does not fill it."""
    log_y: bool = False
    phase: RunPhase | None = None
    """Only the points of this phase (a learning rate per phase), else all."""
    heatmap: bool = False
    """Each line is a row (a layer) of a heatmap over steps, its value a colour: dozens of
    layers stay readable where dozens of lines would not."""


@dataclasses.dataclass(frozen=True)
class FigureSpec:
    name: str
    """File stem: the figure is written as `<name>.png`."""
    title: str
    """The question the figure answers."""
    caption: str
    panels: tuple[PanelSpec, ...]
    phases: tuple[RunPhase, ...] = ()
    """The run's phases, marked on every panel whose steps they overlap."""


def run_phases(series: Mapping[str, Series]) -> tuple[RunPhase, ...]:
    """The SFT warm-up (`warmup/*` steps) and RL (`reward/*` steps) of a run that had both."""
    warmup = [s for name, s in series.items() if name.startswith("warmup/")]
    rl = [s for name, s in series.items() if name.startswith("reward/")]
    if not warmup or not rl:
        return ()
    return (
        RunPhase("SFT warm-up", min(s.steps[0] for s in warmup), max(s.steps[-1] for s in warmup)),
        RunPhase("RL", min(s.steps[0] for s in rl), max(s.steps[-1] for s in rl)),
    )


def figure_specs(series: Mapping[str, Series]) -> list[FigureSpec]:
    """The figures worth drawing for `series` (name -> points), in reading order."""
    phases = run_phases(series)
    shown = {name: points for name, points in series.items() if _worth_showing(name, points)}
    builders: list[Callable[[Mapping[str, Series], tuple[RunPhase, ...]], FigureSpec]] = [
        _learning,
        _sampling,
        _rollouts,
        _episodes,
        _optimizer,
        _time,
        _router,
    ]
    figures = [builder(shown, phases) for builder in builders]
    used = {line.key for figure in figures for panel in figure.panels for line in panel.lines}
    figures.append(_other(sorted(set(shown) - used), phases))
    return [figure for figure in figures if figure.panels]


def _learning(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    loss_lines = [
        LineSpec("warmup/loss", "train (SFT warm-up)"),
        LineSpec("train/loss", "train"),
        LineSpec("eval/loss", "held-out", smooth=False),
        LineSpec("eval/initial_loss", "held-out, before training", smooth=False),
    ]
    rewards = shown["reward/mean"].values if "reward/mean" in shown else []
    panels = [
        _panel(
            shown,
            "rollout reward",
            "mean reward per completion",
            [LineSpec("reward/mean", "")],
            unit_range=bool(rewards) and min(rewards) >= 0.0 and max(rewards) <= 1.0,
        ),
        _panel(
            shown,
            "held-out accuracy",
            "fraction correct (greedy)",
            [LineSpec("eval/accuracy", "", smooth=False)],
            unit_range=True,
        ),
        _panel(shown, "loss", "cross-entropy (nats/token)", loss_lines, log_y=True),
    ]
    return FigureSpec(
        name="learning",
        title="Is it learning?",
        caption="Rollout reward per RL step, greedy accuracy on held-out problems, and the "
        "loss: training (SFT steps or an RL run's warm-up) and held-out where the run "
        "evaluates it.",
        panels=_present(panels),
        phases=phases,
    )


def _sampling(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    panels = [
        _panel(
            shown,
            "largest logprob difference",
            "max |trainer - sampler| (nats)",
            [LineSpec("mismatch/logprob_diff_max", "")],
            log_y=True,
        ),
        _panel(
            shown,
            "KL(sampler || trainer)",
            "k3 estimate (nats/token)",
            [LineSpec("mismatch/kl", "")],
            log_y=True,
        ),
        _panel(
            shown,
            "staleness of sampled batches",
            "policy lag (steps)",
            [LineSpec("async/staleness", "", smooth=False)],
        ),
    ]
    return FigureSpec(
        name="sampling",
        title="Is sampling faithful to training?",
        caption="The sampler's and the trainer's logprobs of the sampled tokens (near 0 when "
        "they agree) and, when sampling runs ahead, how many steps old its weights were.",
        panels=_present(panels),
        phases=phases,
    )


def _rollouts(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    panels = [
        _panel(shown, "correct completions", "fraction", [LineSpec("rollout/accuracy", "")]),
        _panel(shown, "reward spread", "std of rewards", [LineSpec("reward/std", "")]),
        _panel(shown, "completion length", "tokens", [LineSpec("rollout/response_length", "")]),
        _panel(shown, "entropy", "nats/token", [LineSpec("rollout/entropy", "")]),
        _panel(shown, "stopped at end of text", "fraction", [LineSpec("rollout/stopped", "")]),
        _panel(
            shown,
            "groups with a learning signal",
            "fraction of groups kept",
            [LineSpec("rollout/groups_kept", "")],
        ),
    ]
    return FigureSpec(
        name="rollouts",
        title="What do the samples look like?",
        caption="Per RL step: how many completions are correct, how rewards spread within "
        "groups, completion length and entropy, and how many groups carry a learning signal.",
        panels=_present(panels),
        phases=phases,
    )


def _episodes(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    end_keys = sorted(key for key in shown if key.startswith("episode/end/"))
    panels = [
        _panel(shown, "turns per episode", "turns", [LineSpec("episode/turns", "")]),
        _panel(
            shown,
            "tool calls per episode",
            "calls",
            [
                LineSpec("episode/tool_calls", "calls"),
                LineSpec("episode/tool_failures", "failed or timed out"),
            ],
        ),
        _panel(
            shown,
            "why episodes ended",
            "fraction of episodes",
            [LineSpec(key, key.removeprefix("episode/end/")) for key in end_keys],
            unit_range=True,
        ),
        _panel(shown, "env time per episode", "seconds", [LineSpec("episode/env_seconds", "")]),
    ]
    return FigureSpec(
        name="episodes",
        title="How do multi-turn episodes go?",
        caption="Per RL step: turns per episode, tool calls and failed calls, the share of "
        "episodes ending for each reason, and seconds spent in env steps per episode.",
        panels=_present(panels),
        phases=phases,
    )


def _optimizer(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    panels = [
        _panel(
            shown,
            "gradient norm",
            "L2 norm before clipping",
            [LineSpec("optim/grad_norm", "")],
            log_y=True,
        )
    ]
    lr_line = [LineSpec(LEARNING_RATE_KEY, "", smooth=False)]
    if phases and LEARNING_RATE_KEY in shown:
        lr_steps = shown[LEARNING_RATE_KEY].steps
        panels += [
            _panel(shown, f"learning rate, {p.name}", "learning rate", lr_line, phase=p)
            for p in phases
            if any(p.first_step <= step <= p.last_step for step in lr_steps)
        ]
    else:
        panels.append(_panel(shown, "learning rate", "learning rate", lr_line))
    kl_lines = [
        LineSpec("kl/k1", "k1"),
        LineSpec("kl/k3", "k3"),
        LineSpec("kl/penalty_max", "largest penalty"),
    ]
    panels.append(_panel(shown, "KL to the reference policy", "nats/token", kl_lines))
    return FigureSpec(
        name="optimizer",
        title="Is the optimizer healthy?",
        caption="Gradient norm (before clipping), the learning rate as scheduled (raw), and "
        "the KL penalty's divergence from the reference policy.",
        panels=_present(panels),
        phases=phases,
    )


def _time(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    phase_keys = [key for key in sorted(shown) if key.startswith("time/") and key != "time/total"]
    # Each phase's share of all the time its figure shows, in its legend entry.
    seconds = {key: sum(shown[key].values) for key in phase_keys}
    total = sum(seconds.values())
    phase_lines = [
        LineSpec(key, f"{key.removeprefix('time/')} ({seconds[key] / total:.0%})")
        for key in phase_keys
    ]
    panels = [
        _panel(shown, "seconds per step", "seconds", [LineSpec("time/total", "total")]),
        _panel(shown, "seconds per step, by phase", "seconds", phase_lines),
        _panel(
            shown,
            "throughput",
            "tokens/s",
            [
                LineSpec("throughput/tokens_per_s", "sampled"),
                LineSpec("train/tokens_per_s", "trained"),
            ],
        ),
    ]
    return FigureSpec(
        name="time",
        title="Where does the time go?",
        caption="Wall-clock seconds per step, split by phase of the step, and tokens per second.",
        panels=_present(panels),
        phases=phases,
    )


def _router(shown: Mapping[str, Series], phases: tuple[RunPhase, ...]) -> FigureSpec:
    panels = [
        _panel(
            shown,
            "load-balancing loss",
            "E * sum_e f_e * P_e (top-k if even)",
            [LineSpec("moe/aux_loss", "")],
        ),
        _panel(
            shown,
            "largest expert's load, worst layer",
            "assignments / even share (1 = even)",
            [LineSpec("moe/max_load", "")],
        ),
        _panel(
            shown,
            "router entropy, mean over layers",
            "nats/token (ln E if uniform)",
            [LineSpec("moe/entropy", "")],
        ),
        _layer_heatmap(shown, "largest expert's load by layer", metric="max_load"),
        _layer_heatmap(shown, "router entropy by layer", metric="entropy"),
    ]
    return FigureSpec(
        name="router",
        title="Are the experts used evenly?",
        caption="MoE models, per training step over the trained tokens: the load-balancing "
        "loss, each layer's busiest expert's share of the top-k assignments over an even "
        "share, and the router's entropy; the heatmaps show every sparse layer (rows) over "
        "the steps.",
        panels=_present(panels),
        phases=phases,
    )


def _layer_heatmap(shown: Mapping[str, Series], title: str, *, metric: str) -> PanelSpec | None:
    """A heatmap of `moe/layer_<i>/<metric>`, a row per layer in layer order."""
    keys = sorted(
        key for key in shown if key.startswith(f"moe{PER_LAYER}") and key.endswith(f"/{metric}")
    )
    lines = [LineSpec(key, key.split("/")[1].removeprefix("layer_")) for key in keys]
    panel = _panel(shown, title, "layer", lines)
    return None if panel is None else dataclasses.replace(panel, heatmap=True)


def _other(keys: list[str], phases: tuple[RunPhase, ...]) -> FigureSpec:
    panels = tuple(
        PanelSpec(
            title=key,
            ylabel=_unit_guess(key),
            lines=(LineSpec(key, ""),),
            unit_range=any(part in key for part in UNIT_RANGE_KEYS),
        )
        for key in keys
    )
    return FigureSpec(
        name="other",
        title="Other metrics",
        caption="Metrics no figure above shows: " + ", ".join(keys) + ".",
        panels=panels,
        phases=phases,
    )


def _panel(
    shown: Mapping[str, Series],
    title: str,
    ylabel: str,
    lines: list[LineSpec],
    *,
    unit_range: bool = False,
    log_y: bool = False,
    phase: RunPhase | None = None,
) -> PanelSpec | None:
    """A panel of the `lines` whose metrics are shown; None when none is."""
    present = tuple(line for line in lines if line.key in shown)
    if not present:
        return None
    unit_range = unit_range or ylabel.startswith("fraction")
    return PanelSpec(title, ylabel, present, unit_range=unit_range, log_y=log_y, phase=phase)


def _present(panels: list[PanelSpec | None]) -> tuple[PanelSpec, ...]:
    return tuple(panel for panel in panels if panel is not None)


def _worth_showing(name: str, points: Series) -> bool:
    """Not a constant, unless it is an evaluation, the learning rate (values a reader looks
    for even when they do not move) or one layer's value (a heatmap row: a layer left out
    would shift the others)."""
    if name.startswith("eval/") or name == LEARNING_RATE_KEY or len(points.values) == 1:
        return True
    if PER_LAYER in name:
        return True
    return min(points.values) != max(points.values)


def _unit_guess(key: str) -> str:
    name = key.rpartition("/")[2]
    if name.endswith("_per_s"):
        return "per second"
    if key.startswith("time/"):
        return "seconds"
    if name.endswith("tokens"):
        return "tokens"
    if name.endswith("loss"):
        return "loss (nats/token)"
    if any(part in key for part in UNIT_RANGE_KEYS):
        return "fraction"
    return name
