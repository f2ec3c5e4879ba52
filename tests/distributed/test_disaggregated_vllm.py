"""The RL job with vLLM on the generator ranks of a disaggregated placement, on 3 gloo ranks:
- `run`: 1 trainer rank and 2 generator ranks, which make one tensor-parallel engine
  (generator_tp 2: rank 1 runs vLLM with tensor_parallel_size 2 in its own processes, rank 2
  lends it its device);
- `two_trainers`: 2 FSDP trainer ranks, each sending its own rows on its own channel, and 1
  vLLM generator rank, which loads whole tensors as their rows arrive, with no second copy
  (what it stages at once is a tensor or two, measured).
After every sync vLLM holds bitwise the trainer's weights (read back out of its workers), and
the logprobs vLLM reports for its samples are the trainer's own for those tokens (weights
that had not arrived would be far off). Its KL reference is scored on the generator rank by
Temper's code beside vLLM. `make test-vllm`."""

from __future__ import annotations

import dataclasses
import math

import pytest

from temper.generator import generator_rank
from temper.generator.choice import GeneratorChoice
from temper.observability import read_metrics
from tests.distributed.spawn import spawn
from tests.distributed.test_disaggregated import _rank_main, rl_config

pytest.importorskip("vllm", reason="the vllm extra is not installed (make vllm)")
pytestmark = pytest.mark.vllm

from temper.generator.vllm import VllmGenerator  # noqa: E402


def _rank_main_counting_engines(rank: int, directory, configs: dict) -> dict:
    """`_rank_main`, the tensor-parallel size of every vLLM engine this rank started, and of
    every load on a generator rank: whether it held a second copy, the bytes it staged, the
    model's largest tensor."""
    sizes, loads = [], []
    init, load = VllmGenerator.__init__, generator_rank.GeneratorRank._load_whole

    def counted(self, config, **kwargs):
        sizes.append(config.tensor_parallel_size)
        init(self, config, **kwargs)

    def measured(self, engine, *, version):
        load(self, engine, version=version)
        largest = max(math.prod(shape) * 4 for shape in self._shapes.values())  # fp32
        loads.append((self._next is not None, self.whole_tensors.peak_staged_bytes, largest))

    VllmGenerator.__init__ = counted
    generator_rank.GeneratorRank._load_whole = measured
    return _rank_main(rank, directory, configs) | {"vllm_tp": sizes, "loads": loads}


def _vllm(config):
    config.generator = GeneratorChoice.Config(
        backend="vllm", vllm=VllmGenerator.Config(kv_cache_mib=32)
    )
    return config


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("disaggregated_vllm")
    tp2 = _vllm(rl_config(placement="disaggregated", generators=2, steps=2))
    tp2.placement = dataclasses.replace(tp2.placement, generator_tp=2)
    two_trainers = _vllm(rl_config(placement="disaggregated", generators=1, steps=2))
    results = spawn(
        _rank_main_counting_engines,
        world_size=3,
        out_dir=tmp_path_factory.mktemp("ranks"),
        args=(directory, {"run": tp2, "two_trainers": two_trainers}),
        timeout_s=900,
    )
    return results, directory


@pytest.mark.parametrize("name, trainers", [("run", 1), ("two_trainers", 2)])
def test_vllm_holds_exactly_the_trainers_weights_after_every_step(vllm_run, name, trainers):
    results, _ = vllm_run
    for rank in range(trainers):  # each trainer rank checks its own share
        checks = results[rank]["checks"][name]
        assert [version for version, _ in checks] == [2, 3]  # after the warm-up, RL step 0
        assert all(same for _, same in checks)


def test_one_engine_spans_both_generator_ranks(vllm_run):
    results, _ = vllm_run
    assert [result["vllm_tp"] for result in results] == [[], [2], [1]]
    assert results[2]["results"]["run"] is None  # the lender served nothing


def test_a_vllm_generator_rank_loads_fsdp_rows_without_a_second_copy(vllm_run):
    results, _ = vllm_run
    loads = results[2]["loads"]  # two_trainers: two syncs on rank 2
    assert len(loads) == 2
    for second_copy, staged, largest in loads:
        assert not second_copy
        # Rows of FSDP-sharded tensors waited for the other channel's: at most a tensor or
        # two at once, never the model.
        assert 0 < staged <= 2 * largest, (staged, largest)


@pytest.mark.parametrize("name", ["run", "two_trainers"])
def test_vllm_samples_from_the_trainers_weights(vllm_run, name):
    results, directory = vllm_run
    assert results[0]["local_references"][name] == 0  # the KL reference is the generator's
    records = [r for r in read_metrics(directory / name / "metrics.jsonl") if "reward/mean" in r]
    assert len(records) == 2
    # vLLM's logprob of each sampled token against the trainer's (on the steps that trained
    # on some group: a step whose rewards are all equal has nothing to compare)
    diffs = [r["mismatch/logprob_diff_max"] for r in records if "mismatch/logprob_diff_max" in r]
    assert diffs and max(diffs) < 1e-3, diffs
    assert all("kl/k1" in r for r in records if "mismatch/logprob_diff_max" in r)
