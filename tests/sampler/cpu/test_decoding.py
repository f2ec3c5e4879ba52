"""The CPU speed wing's config (`SamplerEngine.Config.cpu`) and the decode path it picks once
when the engine is built: what it runs on, and when a twin is made again (a new weights
generation, not a watched tensor)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import SamplingParams
from temper.models import materialize, qwen3_size
from temper.sampler.cpu.decoding import SMALL_STEP_WORK, CpuDecoding
from temper.sampler.cpu.fused_decoder import FusedDecoder
from temper.sampler.decoding import Decoding
from temper.sampler.engine import SamplerEngine
from temper.sampler.weight_source import WeightSource


def _model(seed=3):
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=37), init_std=0.1)
    return materialize(config, seed=seed, dtype="float32").eval()


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("num_threads", 0, "'auto', an int >= 1 or None"),
        ("num_threads", 1.5, "'auto', an int >= 1 or None"),
        ("num_threads", "all", "'auto', an int >= 1 or None"),
        ("packed_linear", "always", "'auto', 'on' or 'off'"),
        ("fused_projections", "yes", "True or False"),
        ("decode_shards", 0, "'auto' or an int >= 1"),
        ("decode_shards", True, "'auto' or an int >= 1"),
        ("decode_shard_min_rows", 0, "an int >= 1"),
        ("processes", -1, "'auto' or an int >= 1"),
        ("processes", "many", "'auto' or an int >= 1"),
        ("process_min_rows", 0, "an int >= 1"),
    ],
)
def test_bad_cpu_settings_name_the_field_path(field, value, valid):
    message = f"SamplerEngine.Config.cpu.{field} must be {valid}, got {value!r}"
    with pytest.raises(ValueError) as raised:
        CpuDecoding.Config(**{field: value})
    assert str(raised.value) == message


def test_the_cpu_settings_are_one_nested_config():
    config = SamplerEngine.Config()
    assert config.cpu == CpuDecoding.Config()
    assert (config.cpu.processes, config.cpu.decode_shards, config.cpu.num_threads) == (
        "auto",
        1,
        "auto",
    )
    assert CpuDecoding.Config(processes=3).num_processes() == 3
    assert CpuDecoding.Config(processes="auto").num_processes() >= 1
    with pytest.raises(TypeError, match=r"SamplerEngine\.Config\.cpu must be a CpuDecoding"):
        SamplerEngine.Config(cpu={"processes": 2})


ONE_PROCESS = CpuDecoding.Config(processes=1)
"""The engine alone (its decode path is what these tests read)."""


def test_auto_threads_put_small_calls_on_one_thread_and_large_ones_on_the_process_threads(
    monkeypatch,
):
    def threads_seen(num_threads, num_samples, *, parameters=None):
        cpu = CpuDecoding.Config(num_threads=num_threads, processes=1)
        engine = SamplerEngine.Config(max_batch=8, max_seq_len=32, cpu=cpu).build(model=_model())
        if parameters is not None:
            monkeypatch.setattr(engine.decoding, "num_parameters", parameters)
        seen = set()
        decode_step = engine._decode_step
        monkeypatch.setattr(
            engine, "_decode_step", lambda d: (seen.add(torch.get_num_threads()), decode_step(d))
        )
        params = SamplingParams(max_tokens=3, stop=[], seed=0)
        engine.sample([1, 2], params, num_samples=num_samples)
        assert torch.get_num_threads() == 3  # restored after the call
        return seen

    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        # The tiny model (~0.2M parameters) at 8 rows: far under the line.
        assert threads_seen("auto", 8) == {1}
        # A model of SMALL_STEP_WORK / 4 parameters: small at 3 rows, large from 4.
        assert threads_seen("auto", 3, parameters=SMALL_STEP_WORK // 4) == {1}
        assert threads_seen("auto", 4, parameters=SMALL_STEP_WORK // 4) == {3}
        # Rows count up to the engine's slots (8): 16 samples run 8 rows at a time.
        assert threads_seen("auto", 16, parameters=SMALL_STEP_WORK // 9) == {1}
        assert threads_seen(None, 8) == {3}  # always the process's
        assert threads_seen(2, 8, parameters=SMALL_STEP_WORK) == {2}
    finally:
        torch.set_num_threads(previous)


def test_the_decode_path_is_chosen_when_the_engine_is_built():
    model = _model()
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=32, cpu=ONE_PROCESS).build(model=model)
    assert isinstance(engine.decoding, CpuDecoding) and engine.decoding.twin == "fused"
    off = CpuDecoding.Config(fused_projections=False, processes=1)
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=32, cpu=off).build(model=model)
    assert engine.decoding.twin == "none"
    assert engine.decoding.decoder(engine.weights) is model
    # Without the wing (as on CUDA) the plain path decodes on the model, all rows at once.
    plain = Decoding()
    assert plain.decoder(engine.weights) is model
    assert plain.map_rows(lambda rows: rows, 7) == [range(7)]


def test_a_twin_is_made_again_only_for_a_new_weights_generation():
    model = _model()
    engine = SamplerEngine.Config(max_batch=4, max_seq_len=32, cpu=ONE_PROCESS).build(model=model)
    first = engine.decoding.decoder(engine.weights)
    assert isinstance(first, FusedDecoder)
    assert engine.decoding.decoder(engine.weights) is first
    engine.update_weights(model, version=0)  # same module, same version: still a new generation
    assert engine.decoding.decoder(engine.weights) is not first


def test_weights_generation_counts_updates_and_version_follows_the_caller():
    model = _model()
    weights = WeightSource(model)
    assert (weights.generation, weights.version) == (0, 0)
    weights.update(model, version=5)
    weights.update(_model(seed=4).state_dict(), version=2)  # a checkpoint set the version back
    assert (weights.generation, weights.version) == (2, 2)
    with pytest.raises(TypeError, match="update_weights takes"):
        weights.update([torch.zeros(1)], version=9)
    assert (weights.generation, weights.version) == (3, 2)
