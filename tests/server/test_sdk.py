"""The unmodified tinker SDK trains, samples and checkpoints through `temper serve`.

Numbers are checked against the in-process client on the same model directory: the server is
a translation, so the same calls give the same losses, logprobs and tokens.
"""

from __future__ import annotations

import math

import pytest
from tinker import types

import temper
from temper.api import types as temper_types

PROMPT = "12="


def datum(tokenizer, text: str, *, module=types):
    tokens = [*tokenizer.encode(text), tokenizer.eos_token_id]
    weights = [0.0] * (len(tokens) - 3) + [1.0, 1.0]
    return module.Datum(
        model_input=module.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def rl_datum(tokenizer, text: str):
    tokens = [*tokenizer.encode(text), tokenizer.eos_token_id]
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [-2.0] * n,
            "advantages": [0.5] * (n - 1) + [-1.0],
        },
    )


@pytest.fixture(scope="module")
def service(server):
    client = server.service()
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def training(service, model_dir):
    return service.create_lora_training_client(str(model_dir), rank=8, seed=3).result()


@pytest.fixture(scope="module")
def tokenizer(training):
    return training.get_tokenizer()


def test_tokenizer_and_info_work_offline(training, model_dir):
    info = training.get_info()
    assert info.model_data.model_name == str(model_dir.resolve())
    assert info.is_lora and info.lora_rank == 8
    tokenizer = training.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("12=3")) == "12=3"


def test_forward_backward_matches_in_process(training, tokenizer, model_dir, tmp_path):
    data = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    local_service = temper.ServiceClient(storage_dir=tmp_path)
    local = local_service.create_lora_training_client(str(model_dir.resolve()), rank=8, seed=3)
    local_data = [datum(local.get_tokenizer(), t, module=temper_types) for t in ("12=3", "45=9")]

    remote_out = training.forward(data, "cross_entropy").result()
    local_out = local.forward(local_data, "cross_entropy").result()
    assert remote_out.metrics["loss:sum"] == pytest.approx(local_out.metrics["loss:sum"], abs=1e-5)
    for remote, ours in zip(remote_out.loss_fn_outputs, local_out.loss_fn_outputs, strict=True):
        assert remote["logprobs"].tolist() == pytest.approx(ours["logprobs"].tolist(), abs=1e-5)


def test_every_builtin_loss_and_custom_loss(training, tokenizer):
    rl = [rl_datum(tokenizer, "12=3"), rl_datum(tokenizer, "7=7")]
    configs = {
        "importance_sampling": None,
        "ppo": {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
        "cispo": None,
        "dro": {"beta": 0.1},
    }
    for loss_fn, config in configs.items():
        output = training.forward_backward(rl, loss_fn, config).result()
        assert math.isfinite(output.metrics["loss:sum"]), loss_fn
        assert [len(o["logprobs"].tolist()) for o in output.loss_fn_outputs] == [4, 3]
    ce = training.forward_backward([datum(tokenizer, "12=3")], "cross_entropy").result()
    expected = -sum(
        lp * w
        for lp, w in zip(
            ce.loss_fn_outputs[0]["logprobs"].tolist(), [0.0, 0.0, 1.0, 1.0], strict=True
        )
    )
    assert ce.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    def custom(data, logprobs_list):
        loss = sum(-(lp * 2.0).sum() for lp in logprobs_list)
        return loss, {"twice:sum": float(loss.detach())}

    custom_out = training.forward_backward_custom([datum(tokenizer, "12=3")], custom).result()
    full_nll = -sum(ce.loss_fn_outputs[0]["logprobs"].tolist())
    assert custom_out.metrics["twice:sum"] == pytest.approx(2 * full_nll, rel=1e-4)
    training.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clears the gradients


def test_training_lowers_the_loss(service, model_dir, tokenizer):
    client = service.create_lora_training_client(str(model_dir), rank=8, seed=0).result()
    data = [datum(tokenizer, "12=3"), datum(tokenizer, "45=9")]
    losses = []
    for _ in range(4):
        fb = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["grad_norm:mean"] > 0
    assert losses[-1] < losses[0]


def test_lora_clients_on_one_base_are_independent(service, model_dir, tokenizer):
    first = service.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
    second = service.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
    data = [datum(tokenizer, "12=3")]
    before = second.forward(data, "cross_entropy").result().metrics["loss:sum"]
    for _ in range(2):
        first.forward_backward(data, "cross_entropy")
        first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert second.forward(data, "cross_entropy").result().metrics["loss:sum"] == before
    assert first.forward(data, "cross_entropy").result().metrics["loss:sum"] < before


def test_sampling_params_and_logprobs(training, tokenizer):
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode(PROMPT))
    params = types.SamplingParams(max_tokens=6, temperature=0.8, seed=11)
    response = sampler.sample(
        prompt,
        3,
        params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=2,
    ).result()
    again = sampler.sample(prompt, 3, params).result()
    assert [s.tokens for s in response.sequences] == [s.tokens for s in again.sequences]
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        assert len(sequence.logprobs) == len(sequence.tokens)
        assert len(sequence.topk_logprobs) == len(sequence.tokens)
    assert response.prompt_logprobs[0] is None and len(response.prompt_logprobs) == prompt.length
    assert response.topk_prompt_logprobs[0] is None
    assert all(len(row) == 2 for row in response.topk_prompt_logprobs[1:])
    scored = sampler.compute_logprobs(prompt).result()
    assert scored[1:] == pytest.approx(response.prompt_logprobs[1:], abs=1e-5)

    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    tokens = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    assert len(tokens) == 8
    stop_token = tokens[2]
    stopped = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_token])
    ).result()
    first = tokens.index(stop_token)
    assert stopped.sequences[0].tokens == tokens[: first + 1]
    assert stopped.sequences[0].stop_reason == "stop"
    stop_text = tokenizer.decode(tokens[first : first + 1])
    by_string = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_text])
    ).result()
    assert tokenizer.decode(by_string.sequences[0].tokens).endswith(stop_text)


@pytest.mark.filterwarnings("ignore:DEPRECATED")
def test_checkpoints_round_trip(service, training, tokenizer, server):
    data = [datum(tokenizer, "12=3")]
    training.forward_backward(data, "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    reference = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    state = training.save_state("ckpt-1").result().path
    sampler_path = training.save_weights_for_sampler("ckpt-1").result().path
    assert state == f"tinker://{training.model_id}/weights/ckpt-1"

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == reference
    fresh = service.create_training_client_from_state(state).result()
    assert fresh.get_info().lora_rank == 8

    # Optimizer state travels with the checkpoint: one more identical step agrees.
    for client in (training, resumed):
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    stepped = training.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == stepped

    training.load_state(state).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == reference
    training.load_state_with_optimizer(state).result()
    assert training.forward(data, "cross_entropy").result().metrics["loss:sum"] == reference

    greedy = types.SamplingParams(max_tokens=5, temperature=0.0)
    prompt = types.ModelInput.from_ints(tokenizer.encode(PROMPT))
    live = training.save_weights_and_get_sampling_client().result()
    from_disk = service.create_sampling_client(model_path=sampler_path).result()
    assert from_disk.get_base_model() == training.get_info().model_data.model_name
    assert [s.tokens for s in from_disk.sample(prompt, 1, greedy).result().sequences] == [
        s.tokens for s in live.sample(prompt, 1, greedy).result().sequences
    ]
    base_model = training.get_info().model_data.model_name
    base = service.create_sampling_client(base_model=base_model).result()
    assert base.sample(prompt, 1, greedy).result().sequences[0].tokens

    rest = server.rest()
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert {c.checkpoint_id for c in listed} >= {"weights/ckpt-1", "sampler_weights/ckpt-1"}
    run = rest.get_training_run_by_tinker_path(state).result()
    assert run.is_lora and run.lora_rank == 8 and run.last_checkpoint is not None
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    listed = rest.list_checkpoints(training.model_id).result().checkpoints
    assert "sampler_weights/ckpt-1" not in {c.checkpoint_id for c in listed}
