"""`temper serve` on a directory of each family beyond Qwen3 (Llama 3, Qwen3-MoE, Qwen3.5 and
Qwen3.5-MoE), driven by the unmodified tinker SDK: two LoRA users on the one base train
independently, a trained adapter samples (on a MoE base the adapters include every routed
expert's; on Qwen3.5 the Gated DeltaNet's projections, the sampler carrying its recurrent
state), and `compute_logprobs` scores a sampled sequence as the trainer's forward does."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker import types

from tests.server.conftest import start_server
from tests.server.test_sdk import PROMPT, datum


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "qwen3_5", "qwen3_5_moe"])
def family_dir(request, tmp_path_factory) -> Path:
    from temper.checkpoint.model_source import init_model_dir

    directory = tmp_path_factory.mktemp("models") / f"{request.param}-digits"
    init_model_dir(directory, family=request.param, size="tiny", tokenizer="digits", seed=0)
    return directory


@pytest.fixture(scope="module")
def service(family_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("family-server")
    process = start_server(family_dir, root / "storage", root / "server.log")
    client = process.service()
    yield client
    client.close("success").result()
    process.stop()


def test_two_lora_users_train_one_base_and_sample(service, family_dir):
    first = service.create_lora_training_client(str(family_dir), rank=4, seed=1).result()
    second = service.create_lora_training_client(str(family_dir), rank=4, seed=1).result()
    tokenizer = first.get_tokenizer()
    data = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    before = second.forward(data, "cross_entropy").result().metrics["loss:sum"]
    losses = []
    for _ in range(3):
        fb = first.forward_backward(data, "cross_entropy")
        first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0]
    assert second.forward(data, "cross_entropy").result().metrics["loss:sum"] == before

    sampler = first.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode(PROMPT))
    params = types.SamplingParams(max_tokens=5, temperature=0.0)
    response = sampler.sample(prompt, 2, params).result()
    assert len(response.sequences) == 2
    assert response.sequences[0].tokens == response.sequences[1].tokens
    assert len(response.sequences[0].tokens) == len(response.sequences[0].logprobs) > 0

    # The sampled sequence scored by the full forward: its logprobs are the sampler's own to
    # the gap between the sampler's decode and the full forward (for Qwen3.5, its recurrent
    # form against the chunked one).
    sequence = response.sequences[0]
    scored = sampler.compute_logprobs(
        types.ModelInput.from_ints(prompt.to_ints() + sequence.tokens)
    ).result()
    assert scored[0] is None and len(scored) == prompt.length + len(sequence.tokens)
    assert scored[prompt.length :] == pytest.approx(sequence.logprobs, abs=1e-4)
