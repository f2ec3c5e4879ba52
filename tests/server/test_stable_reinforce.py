"""stable_reinforce through `temper serve`, driven by the tinker SDK.

Sampling with `record_stability_info` records each sequence; training requests name them
with provenance spans laid out as tinker-cookbook's rl_loop does (single turn: the input is
prompt + sampled[:-1], the targets are placeholder zeros on the prompt, then the sampled
tokens). Spans that do not resolve are a 400 naming the datum and the span, and a model that
took them trains on bitwise like its twin.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

from tests.server.conftest import start_server
from tests.server.test_bad_input import PROTOBUF, assert_user_error, post, tensor

ADAM = types.AdamParams(learning_rate=1e-2)
PARAMS = types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])


def rl_datum(
    prompt: list[int],
    sequence,
    advantage: float,
    *,
    sequence_id: str | None = None,
    client_logprobs: list[float] | None = None,
) -> types.Datum:
    """rl_loop's datum and `with_sampled_provenance` spans for one sampled sequence."""
    sampled = list(sequence.tokens)
    num_prompt, num_sampled = len(prompt), len(sampled)
    sequence_id = sequence.sequence_id if sequence_id is None else sequence_id
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + sampled[:-1]),
        loss_fn_inputs={
            "target_tokens": [0] * (num_prompt - 1) + sampled,
            "logprobs": [0.0] * (num_prompt - 1)
            + list(client_logprobs if client_logprobs is not None else sequence.logprobs),
            "advantages": [0.0] * (num_prompt - 1) + [advantage] * num_sampled,
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=num_prompt),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=num_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled),
        ],
    )


def replaced(datum: types.Datum, **fields) -> types.Datum:
    """`datum` with fields replaced, spans not re-checked for tiling (as a raw client could)."""
    values = {
        "model_input": datum.model_input,
        "loss_fn_inputs": datum.loss_fn_inputs,
        "model_input_spans": datum.model_input_spans,
        "loss_fn_input_spans": datum.loss_fn_input_spans,
        **fields,
    }
    return types.Datum(**values)


def with_input(datum: types.Datum, name: str, index: int, value) -> types.Datum:
    inputs = dict(datum.loss_fn_inputs)
    array = inputs[name].to_numpy().copy()
    array[index] = value
    inputs[name] = types.TensorData.from_numpy(array)
    return replaced(datum, loss_fn_inputs=inputs)


def sample(sampler, prompt: list[int], num_samples: int = 2):
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples, PARAMS).result()


@pytest.fixture(scope="module")
def twins(server, model_dir):
    """Two models created alike in one session, and a recording sampler on the base model."""
    service = server.service()
    pair = [
        service.create_lora_training_client(str(model_dir), rank=4, seed=7).result()
        for _ in range(2)
    ]
    sampler = service.create_sampling_client(
        base_model=str(model_dir), record_stability_info=True
    ).result()
    yield service, pair, sampler
    service.close("success").result()


def test_recorded_logprobs_are_the_behaviour_policy_not_the_clients(twins):
    _, (model, _), sampler = twins
    prompt = model.get_tokenizer().encode("12=")
    sequences = sample(sampler, prompt).sequences
    assert all(sequence.sequence_id for sequence in sequences)
    honest = [rl_datum(prompt, sequence, 1.0) for sequence in sequences]
    # The client's logprobs are ignored on sampled positions: -50 would cap every weight.
    lying = [
        rl_datum(prompt, sequence, 1.0, client_logprobs=[-50.0] * len(sequence.tokens))
        for sequence in sequences
    ]
    outputs = [model.forward(data, "stable_reinforce").result() for data in (honest, lying)]
    assert outputs[0].metrics == outputs[1].metrics
    # The model has not trained: trainer and sampler agree, every weight is 1, and the loss
    # is REINFORCE's -sum(A * lp) over the sampled tokens.
    expected = 0.0
    for output, sequence in zip(outputs[0].loss_fn_outputs, sequences, strict=True):
        logprobs = output["logprobs"].to_numpy()[len(prompt) - 1 :]
        np.testing.assert_allclose(logprobs, sequence.logprobs, atol=1e-4)
        expected -= float(logprobs.sum())
    assert outputs[0].metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    # kl_coeff's k3 term is ~0 where trainer and sampler agree, and off on prompt targets
    # (whose client logprobs are placeholder zeros).
    with_kl = model.forward(honest, "stable_reinforce", {"kl_coeff": 0.5}).result()
    assert with_kl.metrics["loss:sum"] == pytest.approx(expected, rel=1e-3)


def test_a_one_token_completion_has_an_empty_sampled_input_span(twins):
    _, (model, _), sampler = twins
    prompt = model.get_tokenizer().encode("9=")
    params = types.SamplingParams(max_tokens=1, temperature=1.0, seed=0, stop=[])
    sequence = sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    datum = rl_datum(prompt, sequence, 1.0)
    assert datum.model_input_spans[1].length == 0
    model.forward([datum], "stable_reinforce").result()


def test_spans_are_accepted_on_every_loss_without_records(twins):
    _, (model, _), _ = twins
    prompt = model.get_tokenizer().encode("34=")
    unrecorded = SimpleNamespace(tokens=[5, 6, 7], logprobs=[-1.0] * 3, sequence_id="none-0")
    data = [rl_datum(prompt, unrecorded, 1.0)]
    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        model.forward(data, loss_fn).result()


def test_bad_spans_are_400s_naming_datum_and_span_and_change_nothing(server, model_dir, twins):
    service, (hit, twin), sampler = twins
    tokenizer = hit.get_tokenizer()
    prompt = tokenizer.encode("56=")
    sequences = sample(sampler, prompt).sequences
    good = [rl_datum(prompt, sequence, 0.5) for sequence in sequences]
    for model in (hit, twin):  # moments, and gradients waiting for a step
        model.forward_backward(good, "stable_reinforce")
        model.optim_step(ADAM).result()
        model.forward_backward(good, "stable_reinforce").result()

    first, second = sequences
    num_prompt, num_sampled = len(prompt), len(second.tokens)
    last_target = num_prompt - 1 + num_sampled - 1
    unrecorded = service.create_sampling_client(base_model=str(model_dir)).result()
    plain = sample(unrecorded, prompt, 1).sequences[0]
    foreign_service = server.service()
    foreign_sampler = foreign_service.create_sampling_client(
        base_model=str(model_dir), record_stability_info=True
    ).result()
    foreign = sample(foreign_sampler, prompt, 1).sequences[0]
    shifted_spans = [
        types.PromptProvenanceSpan(sequence_id=second.sequence_id, offset=1, length=num_prompt - 1),
        types.SampledProvenanceSpan(sequence_id=second.sequence_id, offset=1, length=num_sampled),
    ]
    bad = {
        "unknown id": (
            rl_datum(prompt, second, 0.5, sequence_id=f"{second.sequence_id}9"),
            f"datum 1: model_input_spans[0] (prompt_tokens of sequence "
            f"'{second.sequence_id}9', offset 0, length {num_prompt}): unknown sequence",
        ),
        "sampled without record_stability_info": (
            rl_datum(prompt, plain, 0.5),
            f"unknown sequence {plain.sequence_id!r}: no sequence with this id was sampled "
            "with record_stability_info=True",
        ),
        "another session's sequence": (
            rl_datum(prompt, foreign, 0.5),
            f"datum 1: model_input_spans[0] (prompt_tokens of sequence {foreign.sequence_id!r}"
            f", offset 0, length {num_prompt}): sequence "
            f"{foreign.sequence_id!r} was sampled in another session",
        ),
        "sampled span past the sequence's end": (
            replaced(rl_datum(prompt, second, 0.5), loss_fn_input_spans=shifted_spans),
            f"datum 1: loss_fn_input_spans[1] (sampled_tokens of sequence "
            f"{second.sequence_id!r}, offset 1, length {num_sampled}): out of range; the "
            f"sequence's sampled completion has {num_sampled} tokens",
        ),
        "sampled target not the recorded token": (
            with_input(
                rl_datum(prompt, second, 0.5),
                "target_tokens",
                last_target,
                (second.tokens[-1] + 1) % 10,
            ),
            f"datum 1: loss_fn_input_spans[1] (sampled_tokens of sequence "
            f"{second.sequence_id!r}, offset 0, length {num_sampled}): target token "
            f"{(second.tokens[-1] + 1) % 10} at position {last_target} differs from the "
            f"recorded token {second.tokens[-1]}",
        ),
        "advantage on a prompt target": (
            with_input(rl_datum(prompt, second, 0.5), "advantages", 1, 2.0),
            f"datum 1: loss_fn_input_spans[0] (prompt_tokens of sequence "
            f"{second.sequence_id!r}, offset 1, length {num_prompt - 1}): advantage 2 at "
            "target position 1; stable_reinforce only takes nonzero advantages on sampled",
        ),
        "spans that do not tile the targets": (
            replaced(rl_datum(prompt, second, 0.5), loss_fn_input_spans=shifted_spans[1:]),
            f"datum 1: loss_fn_input_spans cover {num_sampled} positions, but the datum has "
            f"{num_prompt - 1 + num_sampled} target_tokens; the spans must tile them",
        ),
        "no spans": (
            types.Datum(model_input=good[1].model_input, loss_fn_inputs=good[1].loss_fn_inputs),
            "datum 1: stable_reinforce needs provenance (model_input_spans and "
            "loss_fn_input_spans)",
        ),
    }
    for name, (datum, message) in bad.items():
        with pytest.raises(tinker.BadRequestError) as error:
            hit.forward_backward([rl_datum(prompt, first, 0.5), datum], "stable_reinforce").result()
        assert message in str(error.value), (name, str(error.value))
    for name, body, message in raw_bad_bodies(hit.model_id, prompt, first):
        response = post(server, "forward_backward", content=body, headers=PROTOBUF)
        assert response.status_code == 400, (name, response.text)
        assert_user_error(response, 400, message)
    foreign_service.close("success").result()

    steps = [model.optim_step(ADAM).result().metrics for model in (hit, twin)]
    assert steps[0] == steps[1]  # the same pending gradients, the same moments
    outputs = [model.forward(good, "stable_reinforce").result() for model in (hit, twin)]
    assert outputs[0].metrics == outputs[1].metrics
    for a, b in zip(outputs[0].loss_fn_outputs, outputs[1].loss_fn_outputs, strict=True):
        assert a["logprobs"].tolist() == b["logprobs"].tolist()


def raw_bad_bodies(model_id: str, prompt: list[int], sequence):
    """(name, protobuf body, message): what the SDK's own checks would stop client-side."""
    sampled = list(sequence.tokens)
    tokens = prompt + sampled[:-1]
    inputs = {
        "target_tokens": tensor([0] * (len(prompt) - 1) + sampled, pb.DTYPE_INT64),
        "logprobs": tensor([0.0] * len(tokens)),
        "advantages": tensor([0.0] * (len(prompt) - 1) + [1.0] * len(sampled)),
    }

    def body(input_spans, target_spans):
        message = pb.ForwardBackwardRequest(
            model_id=model_id, seq_id=10_000, loss_fn="stable_reinforce"
        )
        item = message.data.add()
        item.model_input.add().encoded_text.tokens = np.asarray(tokens, np.int32).tobytes()
        for name, value in inputs.items():
            item.loss_fn_inputs[name].CopyFrom(value)
        for field, spans in (
            (item.model_input_spans, input_spans),
            (item.loss_fn_input_spans, target_spans),
        ):
            for kind, offset, length in spans:
                span = getattr(field.add(), kind)
                span.sequence_id, span.offset, span.length = sequence.sequence_id, offset, length
        return message.SerializeToString()

    num_prompt, num_sampled = len(prompt), len(sampled)
    input_spans = [("prompt_tokens", 0, num_prompt), ("sampled_tokens", 0, num_sampled - 1)]
    return [
        ("input spans alone", body(input_spans, []),
         "datum 0: model_input_spans and loss_fn_input_spans come as a pair; got 2 and 0"),
        ("negative offset", body(input_spans, [("prompt_tokens", -1, num_prompt - 1),
                                              ("sampled_tokens", 0, num_sampled)]),
         f"datum 0: loss_fn_input_spans[0]: offset (-1) and length ({num_prompt - 1}) must be "
         ">= 0"),
    ]  # fmt: skip


def test_an_expired_record_is_refused_saying_it_expired(model_dir, tmp_path):
    server = start_server(
        model_dir, tmp_path / "storage", tmp_path / "server.log", "--stability.ttl-s", "1"
    )
    try:
        service = server.service()
        model = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
        sampler = model.save_weights_and_get_sampling_client(record_stability_info=True).result()
        prompt = model.get_tokenizer().encode("78=")
        sequence = sample(sampler, prompt, 1).sequences[0]
        data = [rl_datum(prompt, sequence, 1.0)]
        time.sleep(1.5)
        with pytest.raises(tinker.BadRequestError, match=r"expired: it was not named") as error:
            model.forward_backward(data, "stable_reinforce").result()
        assert f"sequence {sequence.sequence_id!r} expired" in str(error.value)
        service.close("success").result()
    finally:
        server.stop()


def test_a_grpo_loop_on_stable_reinforce_raises_the_reward(server, model_dir):
    """test_rl_loop's task (reward: the share of completion tokens equal to the prompt's
    first token) on stable_reinforce with cookbook-style provenance."""
    service = server.service()
    training = service.create_lora_training_client(str(model_dir), rank=16, seed=0).result()
    tokenizer = training.get_tokenizer()
    prompts = [tokenizer.encode(f"{i}{(3 * i) % 10}=") for i in range(8)]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[])
    rewards = []
    for step in range(10):
        sampler = training.save_weights_and_get_sampling_client(record_stability_info=True).result()
        step_params = params.model_copy(update={"seed": step})
        futures = [
            sampler.sample(types.ModelInput.from_ints(prompt), 8, step_params) for prompt in prompts
        ]
        data, step_rewards = [], []
        for prompt, future in zip(prompts, futures, strict=True):
            sequences = future.result().sequences
            group = [sum(t == prompt[0] for t in s.tokens) / len(s.tokens) for s in sequences]
            mean = sum(group) / len(group)
            step_rewards += group
            data += [rl_datum(prompt, s, r - mean) for s, r in zip(sequences, group, strict=True)]
        training.forward_backward(data, "stable_reinforce")
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        rewards.append(sum(step_rewards) / len(step_rewards))
    # Measured with these seeds: 0.053 over the first 3 steps, 0.240 over the last 3 (4.5x);
    # the margin is test_rl_loop's.
    assert sum(rewards[-3:]) / 3 > 2 * sum(rewards[:3]) / 3, rewards
    service.close("success").result()
