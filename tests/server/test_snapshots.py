"""Sampling snapshots (save_weights_and_get_sampling_client) stay valid while a client can
still use them: a DPO-style reference client outlives later snapshots on the server defaults,
and a snapshot evicted by the memory budget or by age answers 404 saying why and which
setting keeps it."""

from __future__ import annotations

import time

import pytest
import tinker
from tinker import types

from tests.server.conftest import start_server
from tests.server.test_sdk import datum

ADAM = types.AdamParams(learning_rate=5e-2)
GREEDY = types.SamplingParams(max_tokens=3, temperature=0.0)


def test_a_reference_client_outlives_later_snapshots_on_the_defaults(server, model_dir):
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    tokenizer = training.get_tokenizer()
    data = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    sequence = types.ModelInput.from_ints(tokenizer.encode("12=3"))
    prompt = types.ModelInput.from_ints(tokenizer.encode("4"))
    reference = training.save_weights_and_get_sampling_client().result()
    reference_logprobs = reference.compute_logprobs(sequence).result()

    policy_logprobs = []
    for _ in range(3):  # DPO: reference logprobs, a step, an evaluator's snapshot
        assert reference.compute_logprobs(sequence).result() == reference_logprobs
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(ADAM).result()
        evaluator = training.save_weights_and_get_sampling_client().result()
        evaluator.sample(prompt, 1, GREEDY).result()
        policy_logprobs.append(evaluator.compute_logprobs(sequence).result())

    assert reference.compute_logprobs(sequence).result() == reference_logprobs
    assert reference.sample(prompt, 2, GREEDY).result().sequences
    assert policy_logprobs[-1] != reference_logprobs  # the policy did move
    service.close("success").result()


@pytest.fixture(scope="module")
def tight_server(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tight")
    flags = ["--snapshot-memory-mb", "0", "--snapshot-idle-seconds", "3"]
    process = start_server(model_dir, root / "storage", root / "server.log", *flags)
    yield process
    process.stop()


def test_a_snapshot_evicted_by_the_budget_answers_404_saying_why(tight_server, model_dir):
    service = tight_server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("4"))
    older = training.save_weights_and_get_sampling_client().result()
    newer = training.save_weights_and_get_sampling_client().result()

    with pytest.raises(tinker.NotFoundError) as gone:
        older.sample(prompt, 1, GREEDY).result()
    message = str(gone.value)
    assert "snapshot memory budget (--snapshot-memory-mb 0" in message
    assert "raise --snapshot-memory-mb to keep more" in message
    assert newer.sample(prompt, 1, GREEDY).result().sequences  # the newest always stays
    # The server let go of the evicted one (its sampler copy with it).
    session = tight_server.rest().get_session(training.model_id.split(":")[0]).result()
    assert len(session.sampler_ids) == 1
    service.close("success").result()


def test_an_idle_snapshot_expires_and_answers_404_saying_why(tight_server, model_dir):
    service = tight_server.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints(training.get_tokenizer().encode("4"))
    snapshot = training.save_weights_and_get_sampling_client().result()
    snapshot.sample(prompt, 1, GREEDY).result()
    time.sleep(3.5)

    with pytest.raises(tinker.NotFoundError) as gone:
        snapshot.sample(prompt, 1, GREEDY).result()
    assert "expired after 3 s without a sample (--snapshot-idle-seconds)" in str(gone.value)
    service.close("success").result()
