"""Llama 3 under the shared dense parallelize plan: FSDP2, TP (no q/k norms to localize) and
LoRA under FSDP on 2 gloo ranks train like one process on all the data."""

from __future__ import annotations

import pytest

from temper.distributed.parallel_dims import ParallelDims
from tests.distributed import training
from tests.distributed.spawn import spawn
from tests.distributed.test_sharded_training import ALTERNATE, LORA, _assert_matches

SCENARIOS = {
    "fsdp": ({"dims": {"dp_shard": 2}}, ALTERNATE),
    "tp": ({"dims": {"dp_shard": 1, "tp": 2}}, None),
    "fsdp_lora": ({"dims": {"dp_shard": 2}, "lora": LORA}, ALTERNATE),
}


def _run_scenarios(rank: int) -> dict:
    results = {}
    for name, (kwargs, shares) in SCENARIOS.items():
        kwargs = {**kwargs, "dims": ParallelDims.Config(**kwargs["dims"])}
        engine = training.engine(family="llama", **kwargs)
        share = slice(None) if shares is None else shares[engine.sharding.dp_rank]
        results[name] = training.train(engine, share=share)
        del engine
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return spawn(_run_scenarios, world_size=2, out_dir=tmp_path_factory.mktemp("ranks"))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_two_ranks_train_llama_like_one_process(results, scenario):
    kwargs, _ = SCENARIOS[scenario]
    reference = training.train(training.engine(family="llama", lora=kwargs.get("lora")))
    for result in results:
        _assert_matches(result[scenario], reference)
