"""The disaggregated RL job on a MoE policy with expert parallelism on its trainer ranks: 2
trainer ranks (dp_shard=2, ep=2: 4 of the 8 experts of every layer each) and 1 generator rank,
on gloo. Weights go to the generator as for a dense model: each trainer rank streams its own
rows of the sharded tensors (its experts), rank 0 the rest, and after every sync the generator
holds bitwise the trainer's weights. A dense model with ep > 1 fails on every rank before any
model is trained."""

from __future__ import annotations

import pytest

from temper.distributed.parallel_dims import ParallelDims
from temper.distributed.weight_pieces import as_rows
from temper.generator import remote
from temper.models.common import parallelize
from temper.rl.job import RLJob
from tests.distributed.rl_runs import skip_plots
from tests.distributed.spawn import spawn
from tests.distributed.test_disaggregated import _check_syncs, rl_config

MOE = "qwen3_moe/tiny"  # 4 layers, each with 8 routed experts


def _config(*, base_model: str = MOE):
    config = rl_config(placement="disaggregated", generators=1)
    config.model.base_model = base_model
    config.sharding.dims = ParallelDims.Config(ep=2)
    return config


def _record(splits: list[int], sent: list[list[tuple[str, int, int]]]) -> None:
    """Patch the EP plan to record each ep mesh's size, and RemoteGenerator to record the
    expert rows a trainer rank streams."""
    apply = parallelize.apply_expert_parallel

    def recording_apply(experts, *, mesh):
        splits.append(mesh.size())
        apply(experts, mesh=mesh)

    parallelize.apply_expert_parallel = recording_apply
    send = remote.RemoteGenerator.send_weights

    def recording_send(self, source, *, version):
        pieces = [as_rows(piece) for piece in remote._pieces(source)]
        rows = {(p.name, p.start, p.value.shape[0]) for p in pieces if ".experts." in p.name}
        sent.append(sorted(rows))
        send(self, iter(pieces), version=version)

    remote.RemoteGenerator.send_weights = recording_send


def _rank_main(rank: int, directory) -> dict:
    skip_plots()
    checks: list[tuple[int, bool]] = []
    _check_syncs(checks)
    splits: list[int] = []
    sent: list[list[tuple[str, int, int]]] = []
    _record(splits, sent)
    error = None
    try:
        RLJob(_config(base_model="tiny")).run(run_dir=directory / "dense")
    except ValueError as caught:
        error = str(caught)
    result = RLJob(_config()).run(run_dir=directory / "moe")
    return {"error": error, "checks": checks, "splits": splits, "sent": sent, "result": result}


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    directory = tmp_path_factory.mktemp("disaggregated_ep")
    results = spawn(
        _rank_main, world_size=3, out_dir=tmp_path_factory.mktemp("ranks"), args=(directory,)
    )
    return results, directory


def test_expert_parallel_trainers_stream_their_experts_to_the_generator(three_ranks):
    results, directory = three_ranks
    trainers, generator = results[:2], results[2]
    for rank, result in enumerate(trainers):
        assert result["splits"] == [2] * 4  # every layer's experts split over ep=2
        # A sync after the warm-up and after every step, each bitwise on the generator.
        versions = [version for version, _ in result["checks"]]
        assert len(set(versions)) >= 2 and all(same for _, same in result["checks"])
        # Each sync: this rank's 4 experts of each of the 3 weights of the 4 layers.
        for rows in result["sent"]:
            assert {(start, count) for _, start, count in rows} == {(4 * rank, 4)}
            assert len(rows) == 4 * 3
    assert generator["result"] is None and generator["splits"] == []
    assert trainers[0]["result"].sampler_path
    assert (directory / "moe" / "metrics.jsonl").exists()


def test_a_dense_model_with_expert_parallelism_fails_on_every_rank(three_ranks):
    results, directory = three_ranks
    for result in results:  # the generator rank too: it is told before it starts serving
        assert "ParallelDims.Config.ep=2 needs a model with routed experts" in result["error"]
    assert not (directory / "dense").exists()
