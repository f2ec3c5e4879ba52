"""The RL job on multi-turn envs: the tool-use and guessing-game recipes learn (held-out, fixed
seed), and tool failures and timeouts become observations, never a crash, in the asynchronous
loop too; held-out evaluations play fresh envs each time."""

from __future__ import annotations

import time

from temper.cli import main
from temper.client.service_client import ServiceClient
from temper.distributed.ranks import Ranks
from temper.observability import MetricsLogger, read_metrics
from temper.rl.env import StepResult
from temper.rl.envs import ToolArithmetic
from temper.rl.episodes import EpisodeRunner
from temper.rl.evaluation import HeldoutSuccess
from temper.rl.job import RLJob
from temper.rl.steps import RLSteps
from temper.rl.warmup import SFTWarmup
from temper.sampler.cpu.decoding import CpuDecoding
from temper.sampler.engine import SamplerEngine


def _evals(records, *, warmup_steps):
    evals = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    after_warmup = next(acc for step, acc in evals if step == warmup_steps - 1)
    return after_warmup, evals[-1][1]


def test_tool_arithmetic_recipe_learns_to_use_the_calculator(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "tool_arithmetic", "--run-dir", str(run_dir), "--metrics.display", "none"]
    assert main(argv) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    after_warmup, final = _evals(records, warmup_steps=300)
    # Measured with this seed: 0.66 held-out success after the warm-up (half the
    # demonstrations answer without the calculator, mostly wrongly), 1.0 after 20 GRPO steps.
    assert final >= after_warmup + 0.2, (after_warmup, final)
    rl = [r for r in records if "reward/mean" in r]
    assert rl[-1]["episode/tool_calls"] > rl[0]["episode/tool_calls"]
    assert max(r["mismatch/logprob_diff_max"] for r in rl) < 1e-4  # on-policy
    assert (run_dir / "plots" / "episodes.png").is_file()


def test_guess_number_recipe_learns_binary_search(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "guess_number", "--run-dir", str(run_dir), "--metrics.display", "none"]
    assert main(argv) == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    after_warmup, final = _evals(records, warmup_steps=250)
    # Measured with this seed: 0.47 held-out success after the warm-up (it plays the slower
    # quarter-point search most demonstrations show), 1.0 after 20 and 40 GRPO steps (seeds
    # 1 and 2: 0.47 -> 1.0 and 0.47 -> 0.95).
    assert final >= after_warmup + 0.3, (after_warmup, final)
    rl = [r for r in records if "reward/mean" in r]
    assert rl[-1]["rollout/accuracy"] > rl[0]["rollout/accuracy"] + 0.1
    # A step whose groups all had uniform rewards (drop_uniform_groups) trains on nothing and
    # logs no gap (seen on an AVX-512 VM, where the run's rounding takes another path).
    gaps = [r["mismatch/logprob_diff_max"] for r in rl if "mismatch/logprob_diff_max" in r]
    assert gaps and max(gaps) < 1e-4  # on-policy


def _flaky_calculator(expression: str) -> str:
    if len(expression) % 3 == 0:
        raise ZeroDivisionError("flaky")
    if len(expression) % 3 == 1:
        time.sleep(0.2)  # over the timeout
    return str(sum(int(term) for term in expression.split("+")))


def test_tool_failures_and_timeouts_do_not_stop_a_run(tmp_path, monkeypatch, no_plots):
    monkeypatch.setattr("temper.rl.envs.tool_arithmetic.calculate", _flaky_calculator)
    config = RLJob.Config(
        env=ToolArithmetic.Config(min_digits=1, max_digits=2, tool_timeout_s=0.05),
        episodes=EpisodeRunner.Config(max_turns=3, max_context=48),
        warmup=SFTWarmup.Config(steps=40, batch_size=32, eval_every=0),
        rl=RLSteps.Config(steps=3, prompts_per_step=4, group_size=4, max_tokens=10, eval_every=3),
        mode="async",
        max_staleness=1,
        eval_problems=8,
        sampler=SamplerEngine.Config(
            max_batch=64, max_seq_len=48, cpu=CpuDecoding.Config(num_threads=1)
        ),
        metrics=MetricsLogger.Config(display="none"),
    )
    RLJob(config).run(run_dir=tmp_path / "run")
    rl = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert [r["async/staleness"] for r in rl] == [0.0, 1.0, 1.0]
    assert sum(r["episode/tool_calls"] for r in rl) > 0
    assert sum(r["episode/tool_failures"] for r in rl) > 0


class _OneEpisodeEnv:
    """An env that keeps its episode's state, as most do: it cannot be played twice."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.played = tokenizer, False

    def initial_observation(self) -> list[int]:
        return self.tokenizer.encode("1:")

    def stop_token_ids(self) -> list[int]:
        return [self.tokenizer.eos_token_id]

    def step(self, action_tokens) -> StepResult:
        assert not self.played, "a played env was handed out again"
        self.played = True
        return StepResult(reward=1.0, done=True, metrics={"correct": 1.0})


class _OneEpisodeSource:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def heldout_envs(self, count: int) -> list[_OneEpisodeEnv]:
        return [_OneEpisodeEnv(self.tokenizer) for _ in range(count)]


def test_every_heldout_evaluation_plays_fresh_envs(tmp_path):
    training = ServiceClient(storage_dir=str(tmp_path)).create_training_client("tiny")
    evaluate = HeldoutSuccess(
        training=training,
        source=_OneEpisodeSource(training.get_tokenizer()),
        num_envs=3,
        episodes=EpisodeRunner.Config(max_turns=2, max_context=16).build(),
        max_tokens=2,
        ranks=Ranks.single(),
    )
    assert [evaluate(), evaluate()] == [1.0, 1.0]
