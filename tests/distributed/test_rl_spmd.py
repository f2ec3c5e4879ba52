"""The RL job on 2 gloo ranks (SPMD): each rank samples its share of the groups, metrics are
combined over ranks, rank 0 alone writes the run's files, and the run equals one process on
the same groups. Also: settings that do not fit the world size fail on every rank before any
work; a sharded LoRA trainer's sampler weights are gathered and written once.

One spawn runs every scenario (process start-up dominates on a small machine).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from temper.api import Datum, ModelInput
from temper.client.service_client import ServiceClient
from temper.distributed.parallel_dims import ParallelDims
from temper.observability import read_metrics
from temper.rl import steps
from temper.rl.job import RLJob
from temper.trainer import TrainerEngine
from temper.trainer.sharding import Sharding
from tests.distributed import training
from tests.distributed.rl_runs import run_in_process, skip_plots
from tests.distributed.spawn import spawn
from tests.rl.conftest import comparable_metrics, final_weights, tiny_rl_config

NUM_RANKS = 2
NUM_WARMUP = 30


def rl_config(**changes) -> RLJob.Config:
    # 3 substeps of 2 groups: rank 0 holds groups 0-2, rank 1 groups 3-5, so the middle
    # minibatch spans both ranks and each of the others leaves one rank without data.
    settings = dict(steps=3, prompts_per_step=6, num_substeps=3, kl_coef=0.05, checkpoint_every=10)
    config = tiny_rl_config(**(settings | changes))
    # Enough warm-up that every RL step has groups with signal (measured: 2-3 of 6 kept).
    config.warmup.steps, config.warmup.learning_rate = NUM_WARMUP, 3e-3
    return config


def bad_configs() -> dict[str, RLJob.Config]:
    return {
        "world_size": rl_config(sharding=Sharding.Config(dims=ParallelDims.Config(dp_shard=3))),
        "prompts": rl_config(prompts_per_step=5, num_substeps=1),
        "tp": rl_config(sharding=Sharding.Config(dims=ParallelDims.Config(dp_shard=1, tp=2))),
    }


def _rank_main(rank: int, directory) -> dict:
    skip_plots()
    errors = {}
    for name, config in bad_configs().items():
        try:
            RLJob(config).run(run_dir=directory / name)
        except ValueError as error:
            errors[name] = str(error)

    rollouts = []  # per RL step: this rank's groups as (reward, tokens, sum of logprobs)
    rollout_stats = steps.rollout_stats

    def recording_stats(stats, groups):
        rollouts.append(
            [[(t.reward, len(t.completion), sum(t.sampler_logprobs)) for t in g] for g in groups]
        )
        rollout_stats(stats, groups)

    steps.rollout_stats = recording_stats
    result = RLJob(rl_config()).run(run_dir=directory / "run")
    steps.rollout_stats = rollout_stats
    return {
        "errors": errors,
        "rollouts": rollouts,
        "result": result,
        "lora": _lora_sampler_weights(rank, directory),
    }


def _lora_sampler_weights(rank: int, directory) -> dict:
    """A sharded LoRA client after one step: its sampler's (merged) weights, the path of its
    saved sampler weights, and the error of saving the same name twice."""
    trainer = TrainerEngine.Config(sharding=Sharding.Config(dims=ParallelDims.Config()))
    service = ServiceClient(storage_dir=directory / "lora", trainer=trainer)
    client = service.create_lora_training_client("tiny", rank=4, seed=3)
    tokens = [1, 2, 3, 4, 5, 6][rank:]
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(training.ADAM).result()
    sampler = client.save_weights_and_get_sampling_client()
    path = client.save_weights_for_sampler("lora").result().path
    try:
        client.save_weights_for_sampler("lora").result()
        again = None
    except FileExistsError as error:
        again = str(error)
    return {
        "merged": {k: v.clone() for k, v in sampler.generator.model.state_dict().items()},
        "path": path,
        "again": again,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], object]:
    directory = tmp_path_factory.mktemp("spmd")
    results = spawn(
        _rank_main,
        world_size=NUM_RANKS,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(directory,),
    )
    return results, directory


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The same job in one process."""
    run_dir = tmp_path_factory.mktemp("single") / "run"
    return run_in_process(rl_config(), run_dir), run_dir


def test_settings_that_do_not_fit_the_ranks_fail_on_every_rank(ranks):
    results, directory = ranks
    expected = {
        "world_size": "world size is 2",
        "prompts": "prompts_per_step=5 must be divisible by the number of ranks (2)",
        "tp": "data-parallel only",
    }
    for result in results:
        for name, text in expected.items():
            assert text in result["errors"][name], result["errors"]
    assert results[0]["errors"] == results[1]["errors"]
    for name in expected:  # nothing was written
        assert not (directory / name).exists()


def test_metrics_are_pooled_over_the_ranks_shares(ranks):
    results, directory = ranks
    records = [r for r in read_metrics(directory / "run" / "metrics.jsonl") if "reward/mean" in r]
    assert len(records) == 3
    entropy_differs_from_mean_of_means = False
    for step, record in enumerate(records):
        shares = [[t for g in result["rollouts"][step] for t in g] for result in results]
        everything = shares[0] + shares[1]
        rewards = [reward for reward, _, _ in everything]
        assert record["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        assert record["reward/std"] == pytest.approx(std, abs=1e-9)
        tokens = [n for _, n, _ in everything]
        assert record["rollout/response_length"] == pytest.approx(sum(tokens) / len(tokens))
        # Entropy is a mean over tokens: the pooled one, not the mean of the ranks' means.
        entropy = -sum(lp for _, _, lp in everything) / sum(tokens)
        assert record["rollout/entropy"] == pytest.approx(entropy, rel=1e-9)
        rank_means = [-sum(lp for *_, lp in s) / sum(n for _, n, _ in s) for s in shares]
        if abs(sum(rank_means) / 2 - entropy) > 1e-6:
            entropy_differs_from_mean_of_means = True
    assert entropy_differs_from_mean_of_means  # the shares differ: the check above has teeth
    assert all(record["rollout/groups_kept"] > 0 for record in records)  # signal to train on


def test_rank0_alone_writes_the_run_files(ranks):
    results, directory = ranks
    run_dir = directory / "run"
    steps_logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps_logged == list(range(NUM_WARMUP + 3))  # once each: rank 1 wrote none
    rollouts = (run_dir / "rollouts.jsonl").read_text().splitlines()
    assert len(rollouts) == 3 * 3  # rank 0's 3 groups per step
    state = json.loads((run_dir / "run_state" / "state.json").read_text())
    assert state["step"] == NUM_WARMUP + 3
    # One run id on both ranks: the checkpoints of one run.
    assert results[0]["result"].sampler_path == results[1]["result"].sampler_path
    assert len(list((run_dir / "checkpoints").iterdir())) == 1


def test_two_ranks_train_like_one_process_on_the_same_groups(ranks, single):
    results, directory = ranks
    single_result, single_dir = single
    two = comparable_metrics(directory / "run")
    one = comparable_metrics(single_dir)
    assert [r.keys() for r in two] == [r.keys() for r in one]
    # Sums over two ranks round differently from one sum (measured: weights within 8e-6,
    # grad norms within 1.5e-4 relative after 33 steps); the samples are the same tokens.
    for record_two, record_one in zip(two, one, strict=True):
        for key, value in record_one.items():
            assert record_two[key] == pytest.approx(value, rel=1e-3, abs=1e-4), (key, record_one)
        assert record_two.get("reward/mean") == record_one.get("reward/mean")
    weights_two = final_weights(directory / "run", results[0]["result"])
    weights_one = final_weights(single_dir, single_result)
    assert weights_two.keys() == weights_one.keys()
    for key, value in weights_one.items():
        torch.testing.assert_close(weights_two[key], value, rtol=1e-3, atol=1e-4)
    assert results[0]["result"].final_accuracy == single_result.final_accuracy


def test_sharded_lora_sampler_weights_are_written_once_and_load_as_the_merged_model(ranks):
    results, directory = ranks
    lora = [result["lora"] for result in results]
    assert lora[0]["path"] == lora[1]["path"]
    for result in lora:
        assert "already exist" in result["again"]
    service = ServiceClient(storage_dir=directory / "lora")
    loaded = service.create_sampling_client(model_path=lora[0]["path"]).generator.model.state_dict()
    assert loaded.keys() == lora[0]["merged"].keys()
    for key, value in lora[0]["merged"].items():
        assert torch.equal(loaded[key], value), key
