"""The RL job with vLLM on the generator ranks of a disaggregated placement: 1 trainer rank
and 2 generator ranks on gloo, which make one tensor-parallel engine (generator_tp 2: rank 1
runs vLLM with tensor_parallel_size 2 in its own processes, rank 2 lends it its device).
After every sync the weights vLLM was given are bitwise the trainer's, and the logprobs vLLM
reports for its samples are the trainer's own for those tokens (weights that had not arrived
would be far off). Its KL reference is scored on the generator rank by Temper's code beside
vLLM. `make test-vllm`."""

from __future__ import annotations

import dataclasses

import pytest

from temper.generator.choice import GeneratorChoice
from temper.observability import read_metrics
from tests.distributed.spawn import spawn
from tests.distributed.test_disaggregated import _rank_main, rl_config

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402


def _rank_main_counting_engines(rank: int, directory, configs: dict) -> dict:
    """`_rank_main`, and the tensor-parallel size of every vLLM engine this rank started."""
    sizes, init = [], VllmGenerator.__init__

    def counted(self, config, **kwargs):
        sizes.append(config.tensor_parallel_size)
        init(self, config, **kwargs)

    VllmGenerator.__init__ = counted
    return _rank_main(rank, directory, configs) | {"vllm_tp": sizes}


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("disaggregated_vllm")
    config = rl_config(placement="disaggregated", generators=2, steps=2)
    config.placement = dataclasses.replace(config.placement, generator_tp=2)
    config.generator = GeneratorChoice.Config(
        backend="vllm", vllm=VllmGenerator.Config(kv_cache_mib=32)
    )
    results = spawn(
        _rank_main_counting_engines,
        world_size=3,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(directory, {"run": config}),
        timeout_s=600,
    )
    return results, directory / "run"


def test_vllm_is_given_exactly_the_trainers_weights_after_every_step(vllm_run):
    results, _ = vllm_run
    checks = results[0]["checks"]["run"]
    assert [version for version, _ in checks] == [2, 3]  # after the warm-up, RL step 0
    assert all(same for _, same in checks)


def test_one_engine_spans_both_generator_ranks(vllm_run):
    results, _ = vllm_run
    assert [result["vllm_tp"] for result in results] == [[], [2], []]
    assert results[2]["results"]["run"] is None  # the lender served nothing


def test_vllm_samples_from_the_trainers_weights(vllm_run):
    results, run_dir = vllm_run
    assert results[0]["local_references"]["run"] == 0  # the KL reference is the generator's
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert len(records) == 2
    # vLLM's logprob of each sampled token against the trainer's (on the steps that trained
    # on some group: a step whose rewards are all equal has nothing to compare)
    diffs = [r["mismatch/logprob_diff_max"] for r in records if "mismatch/logprob_diff_max" in r]
    assert diffs and max(diffs) < 1e-3, diffs
    assert all("kl/k1" in r for r in records if "mismatch/logprob_diff_max" in r)
