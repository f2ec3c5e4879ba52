"""In-flight sampling clients (`save_weights_and_get_sampling_client(kind="inflight")`) driven by
the official SDK: every in-flight client samples the newest in-flight save, a save returns
while a long sample decodes and the sample goes on with the newer weights (the request log
names the versions each sequence spanned), a named save refuses kind='inflight', and the
model memory budget counts each model's in-flight target."""

from __future__ import annotations

import re

import httpx
import pytest
from tinker import types

from temper.server.state.server import ServedModel, Session, TemperServer
from tests.server.conftest import API_KEY, start_server
from tests.server.test_request_log import log_lines
from tests.server.test_sdk import datum

ADAM = types.AdamParams(learning_rate=5e-2)
GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def inflight_server(model_dir, tmp_path_factory):
    """The default server: LoRA models sample on the shared multi-LoRA sampler, where an
    in-flight target's call moves to a newer adapter version between decode steps (merged
    weights switch the same way: tests/client/test_inflight_clients.py)."""
    root = tmp_path_factory.mktemp("inflight")
    process = start_server(model_dir, root / "storage", root / "server.log")
    yield process
    process.stop()


def _step(training, tokenizer):
    data = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(ADAM).result()


def _greedy(sampler, prompt):
    sequence = sampler.sample(prompt, 1, GREEDY).result().sequences[0]
    return sequence.tokens, sequence.logprobs


def _versions(server, sequence_id: str) -> tuple[int, ...]:
    pattern = rf"inflight sample .* {re.escape(sequence_id)}=([\d,]+)"
    [line] = log_lines(server, pattern, wait_s=10)
    return tuple(int(v) for v in re.search(pattern, line).group(1).split(","))


def every_client_samples_the_newest_save(server, model_dir) -> None:
    """Two in-flight clients, made before and after a step, sample what a snapshot of the
    newest save samples; the request log names the version (also on a disaggregated
    server: tests/server/test_disaggregated.py)."""
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("4"))
    first = training.save_weights_and_get_sampling_client(kind="inflight").result()
    before = _greedy(first, prompt)
    _step(training, tokenizer)
    second = training.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot = training.save_weights_and_get_sampling_client().result()
    expected = _greedy(snapshot, prompt)
    assert expected[1] != before[1]
    for sampler in (first, second):
        tokens, logprobs = _greedy(sampler, prompt)
        assert tokens == expected[0]
        assert logprobs == pytest.approx(expected[1], abs=1e-5)
    response = first.sample(prompt, 1, GREEDY).result()
    assert _versions(server, response.sequences[0].sequence_id) == (1,)
    service.close("success").result()


def a_long_sample_spans_a_save(server, model_dir) -> None:
    """A save made while a long sample decodes returns at once, and the sample goes on with
    the newer weights: the request log names both versions for it."""
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("4"))
    sampler = training.save_weights_and_get_sampling_client(kind="inflight").result()
    start = 0
    # Long enough to be decoding when the save lands; on a busy machine the sample may
    # still end first, or start after it: then try again, longer.
    for max_tokens in (400, 1000, 1900):
        params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, stop=[])
        future = sampler.sample(prompt, 1, params)
        _step(training, tokenizer)
        training.save_weights_and_get_sampling_client(kind="inflight").result()
        sequence = future.result().sequences[0]
        versions = _versions(server, sequence.sequence_id)
        assert list(versions) == sorted(set(versions)) and versions[0] >= start
        assert set(versions) <= {start, start + 1}
        start += 1
        if len(versions) == 2:
            break
    assert versions == (start - 1, start)
    service.close("success").result()


def test_every_inflight_client_samples_the_newest_save(inflight_server, model_dir):
    every_client_samples_the_newest_save(inflight_server, model_dir)


def test_a_save_while_a_long_sample_decodes_is_spanned_by_it(inflight_server, model_dir):
    a_long_sample_spans_a_save(inflight_server, model_dir)


def test_a_named_save_refuses_kind_inflight(inflight_server, model_dir):
    service = inflight_server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    body = {"model_id": training.model_id, "path": "named", "kind": "inflight"}
    answer = httpx.post(
        f"{inflight_server.base_url}/api/v1/save_weights_for_sampler",
        json=body,
        headers={"X-API-Key": API_KEY},
    )
    assert answer.status_code == 400 and "kind='inflight'" in answer.text
    service.close("success").result()


def test_an_inflight_target_counts_in_the_model_memory_budget(model_dir, tmp_path):
    config = TemperServer.Config(model=[str(model_dir)], storage=str(tmp_path / "storage"))
    server = TemperServer(config, backend=object())  # no model runs here
    server.sessions["s"] = Session(session_id="s", user="default")
    base = server.base_models.first
    models = {}
    for model_id, rank in (("lora", 4), ("full", None)):
        models[model_id] = ServedModel(
            model_id=model_id,
            session_id="s",
            owner="default",
            base=base,
            is_lora=rank is not None,
            lora_rank=rank,
        )
        server.add_model(models[model_id])
    held = server.memory.loaded()[base.name]
    # On the multi-LoRA sampler: the adapter version decoding and a newer one offered.
    adapters = 2 * 4 * base.lora_bytes_per_rank
    for _ in range(2):  # counted once per model, at its first in-flight save
        server.admit_inflight(models["lora"])
    assert server.memory.loaded()[base.name] == held + adapters
    server.admit_inflight(models["full"])  # a sampler copy of its own
    assert server.memory.loaded()[base.name] == held + adapters + base.sampler_bytes
    server.drop_model("lora")
    server.drop_model("full")
    assert base.name not in server.memory.loaded()
