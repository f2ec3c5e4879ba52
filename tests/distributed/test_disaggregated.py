"""The RL job with a disaggregated placement on gloo ranks: trainer ranks train, generator
ranks sample, weights are streamed in buckets after every step.

- 2 trainer ranks + 1 generator rank: after every sync the generator holds bitwise the
  trainer's gathered (sampler) weights, and the run is bitwise the colocated 2-rank run.
- 1 trainer rank + 2 generator ranks: each batch is split over both generators; the tokens
  are the single-process run's, logprobs within float rounding (another batch shape).
- Async mode: sampling never runs more than max_staleness versions behind; with
  `overlap_sync` (weights sent while the old version samples) the run is bitwise the same.
- The KL reference (every run has a KL penalty) loads and scores on the generator ranks: no
  trainer rank loads it, and its logprobs are bitwise the colocated run's.
- Settings that do not fit the world fail on every rank before any collective.
"""

from __future__ import annotations

import pytest
import torch

from temper.client.service_client import ServiceClient
from temper.distributed.placement import Placement
from temper.distributed.weight_pieces import WeightRows, as_rows
from temper.generator import remote
from temper.observability import read_metrics
from temper.rl.job import RLJob
from tests.distributed.rl_runs import run_in_process, skip_plots
from tests.distributed.spawn import spawn
from tests.rl.conftest import comparable_metrics, final_weights, tiny_rl_config

LOGPROB_KEYS = ("rollout/entropy", "optim/grad_norm")
MISMATCH_KEYS = "mismatch/"
"""The sampler-trainer gap (max and KL of the logprob differences): float rounding is its size
(0-5e-7), so another batch composition of the generators moves it by a rounding step (seen on
an AVX-512 VM: max 2.4e-7 in one process, 4.8e-7 split), not by a relative amount."""
KL_KEYS = "kl/"
"""Means of log-ratios that start at 0: float rounding of the logprobs (1e-7) is their size."""


def rl_config(
    *, placement: str = "colocated", generators: int = 1, overlap_sync: bool = False, **changes
) -> RLJob.Config:
    settings = dict(steps=3, prompts_per_step=4, eval_every=3, eval_problems=8, kl_coef=0.05)
    config = tiny_rl_config(**(settings | changes))
    config.warmup.steps = 2
    config.placement = Placement.Config(
        mode=placement, generator_ranks=generators, bucket_mb=0.05, overlap_sync=overlap_sync
    )
    return config


_SEND, _COMMIT = remote.RemoteGenerator.send_weights, remote.RemoteGenerator.commit_weights


def _check_syncs(checks: list[tuple[int, bool]]) -> None:
    """Patch RemoteGenerator so that after each sync (send, then commit) every generator's
    weights are compared with this trainer rank's share of the gathered (and merged) weights
    it streamed (its own rows of the sharded tensors; rank 0: the rest, whole). The generator
    checked that the shares cover every tensor's rows once. The commit runs under the weight
    sync's lock once the old version's requests have run, so no request uses the links."""
    sent: list[WeightRows] = []

    def send(self, source, *, version):
        mine = [as_rows(piece) for piece in remote._pieces(source)]
        sent[:] = [WeightRows(name=r.name, start=r.start, value=r.value.clone()) for r in mine]
        _SEND(self, iter(sent), version=version)

    def commit(self, *, version):
        _COMMIT(self, version=version)
        for theirs in self.generator_weights():
            same = all(torch.equal(theirs[r.name][r.start : r.stop], r.value) for r in sent)
            checks.append((version, same and bool(sent)))  # every FSDP rank sends rows

    remote.RemoteGenerator.send_weights = send
    remote.RemoteGenerator.commit_weights = commit


def _count_local_samplers(loads: list[str]) -> None:
    """Patch the service so that every sampler loaded on this rank from a path is recorded."""
    create = ServiceClient.create_sampling_client

    def counted(self, model_path=None, base_model=None):
        loads.append(model_path)
        return create(self, model_path=model_path, base_model=base_model)

    ServiceClient.create_sampling_client = counted


def _rank_main(rank: int, directory, configs: dict) -> dict:
    skip_plots()
    loads: list[str] = []
    _count_local_samplers(loads)
    errors = {}
    for name, config in configs.pop("bad", {}).items():
        try:
            RLJob(config).run(run_dir=directory / name)
        except ValueError as error:
            errors[name] = str(error)
    checks: dict[str, list[tuple[int, bool]]] = {}  # per run: (version, equal) per generator
    results, local_references = {}, {}
    for name, config in configs.items():
        _check_syncs(checks.setdefault(name, []))
        results[name] = RLJob(config).run(run_dir=directory / name)
        local_references[name] = sum("kl_reference" in str(path) for path in loads)
        loads.clear()
    return {
        "errors": errors,
        "results": results,
        "checks": checks,
        "local_references": local_references,
    }


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("disaggregated")
    configs = {
        "bad": {
            "too_many_generators": rl_config(placement="disaggregated", generators=3),
            "prompts": rl_config(placement="disaggregated", prompts_per_step=5),
        },
        "two_plus_one": rl_config(placement="disaggregated", generators=1),
        "one_plus_two": rl_config(placement="disaggregated", generators=2),
        "async": rl_config(placement="disaggregated", mode="async"),
        "async_overlap": rl_config(placement="disaggregated", mode="async", overlap_sync=True),
    }
    results = spawn(
        _rank_main,
        world_size=3,
        out_dir=tmp_path_factory.mktemp("ranks3"),
        args=(directory, configs),
    )
    return results, directory


@pytest.fixture(scope="module")
def colocated_two(tmp_path_factory):
    directory = tmp_path_factory.mktemp("colocated")
    results = spawn(
        _rank_main,
        world_size=2,
        out_dir=tmp_path_factory.mktemp("ranks2"),
        args=(directory, {"run": rl_config()}),
    )
    # The check below means something: colocated, each rank loads the reference itself.
    assert all(result["local_references"]["run"] == 1 for result in results)
    return directory / "run"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("single") / "run"
    return run_in_process(rl_config(), run_dir), run_dir


def test_settings_that_do_not_fit_the_world_fail_on_every_rank(three_ranks, tmp_path):
    results, directory = three_ranks
    for result in results:
        errors = result["errors"]
        assert (
            "generator_ranks=3 leaves no trainer rank in a world of 3"
            in errors["too_many_generators"]
        )
        assert (
            "prompts_per_step=5 must be divisible by the number of ranks (2)" in errors["prompts"]
        )
    assert not (directory / "too_many_generators").exists()


def test_generators_sample_from_exactly_the_trainers_weights_after_every_step(three_ranks):
    results, _ = three_ranks
    # A sync before the first sample (after the warm-up) and after every step that trained,
    # checked on each generator the trainer rank is linked to, by every trainer rank (each
    # checks its own share).
    for name, generators, trainers in (
        ("two_plus_one", 1, 2),
        ("one_plus_two", 2, 1),
        ("async", 1, 2),
        ("async_overlap", 1, 2),
    ):
        for rank in range(trainers):
            checks = results[rank]["checks"][name]
            versions = [version for version, _ in checks]
            distinct = sorted(set(versions))
            assert versions == [v for v in distinct for _ in range(generators)], (name, rank)
            assert len(distinct) >= 2, name
            assert all(same for _, same in checks), (name, rank)
    assert results[2]["results"]["two_plus_one"] is None  # the generator rank's


def test_two_trainers_one_generator_equal_the_colocated_run_bitwise(three_ranks, colocated_two):
    results, directory = three_ranks
    disaggregated = directory / "two_plus_one"
    assert comparable_metrics(disaggregated) == comparable_metrics(colocated_two)
    result = results[0]["results"]["two_plus_one"]
    weights = final_weights(disaggregated, result)
    reference = final_weights(colocated_two, _result_of(colocated_two))
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)


def test_the_kl_reference_loads_on_the_generator_ranks_only(three_ranks, colocated_two):
    results, directory = three_ranks
    for name in ("two_plus_one", "one_plus_two", "async", "async_overlap"):
        assert all(result["local_references"][name] == 0 for result in results), name
        assert any("kl/k1" in r for r in read_metrics(directory / name / "metrics.jsonl"))


def test_one_trainer_two_generators_match_one_process(three_ranks, single):
    _, directory = three_ranks
    _, single_dir = single
    split = comparable_metrics(directory / "one_plus_two")
    one = comparable_metrics(single_dir)
    assert [r.keys() for r in split] == [r.keys() for r in one]
    for record_split, record_one in zip(split, one, strict=True):
        for key, value in record_one.items():
            if key.startswith(LOGPROB_KEYS):
                assert record_split[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key
            elif key.startswith(MISMATCH_KEYS):
                assert record_split[key] == pytest.approx(value, rel=0, abs=1e-6), key
            elif key.startswith(KL_KEYS):
                assert record_split[key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
            else:  # the same tokens and rewards
                assert record_split[key] == value, key


def test_async_sampling_stays_within_max_staleness(three_ranks):
    _, directory = three_ranks
    for name in ("async", "async_overlap"):
        records = [
            r for r in read_metrics(directory / name / "metrics.jsonl") if "reward/mean" in r
        ]
        assert len(records) == 3
        staleness = [record["async/staleness"] for record in records]
        assert max(staleness) <= 1 and max(staleness) == 1  # it did overlap


def test_overlapping_the_transfer_with_sampling_changes_no_sample(three_ranks):
    _, directory = three_ranks
    overlap = comparable_metrics(directory / "async_overlap")
    assert overlap == comparable_metrics(directory / "async")


def _result_of(run_dir):
    """The colocated run's final sampler path, read from its run directory."""
    from types import SimpleNamespace

    (run,) = (run_dir / "checkpoints").iterdir()
    return SimpleNamespace(sampler_path=f"tinker://{run.name}/sampler_weights/final")
