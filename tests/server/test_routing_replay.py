"""Routing replay through `temper serve --routing-replay sampler` on a tiny Qwen3-MoE in bf16,
driven by the tinker SDK: a client cannot send routes, so the server replays the ones it
recorded when it sampled (record_stability_info) the sequence a datum's provenance names, for
single-turn datums and multi-turn ones (spans laid out as tinker-cookbook lays them out), and
says so (`routing/replayed:mean`); datums without such provenance train on the trainer's own
routing."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinker import types

from tests.server.conftest import start_server
from tests.server.test_stable_reinforce import rl_datum

PARAMS = types.SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[])


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from temper.checkpoint.model_source import init_model_dir

    model_dir = tmp_path_factory.mktemp("models") / "tiny-moe-digits"
    init_model_dir(model_dir, family="qwen3_moe", size="tiny", tokenizer="digits", seed=0)
    root = tmp_path_factory.mktemp("server")
    extra = ("--routing-replay", "sampler", "--dtype", "bfloat16")
    process = start_server(model_dir, root / "storage", root / "server.log", *extra)
    yield process, model_dir
    process.stop()


@pytest.fixture(scope="module")
def clients(moe_server):
    process, model_dir = moe_server
    service = process.service()
    training = service.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
    sampler = service.create_sampling_client(
        base_model=str(model_dir), record_stability_info=True
    ).result()
    yield training, sampler
    service.close("success").result()


def _sample(sampler, prompt: list[int], num_samples: int):
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples, PARAMS).result()


def _without_provenance(datum: types.Datum) -> types.Datum:
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs)


def test_single_turn_datums_replay_the_recorded_routes(clients):
    training, sampler = clients
    tokenizer = training.get_tokenizer()
    data = []
    for text in ("12=", "907=", "5531="):
        prompt = tokenizer.encode(text)
        for sequence in _sample(sampler, prompt, 4).sequences:
            data.append(rl_datum(prompt, sequence, 0.5))
    replayed = training.forward_backward(data, "importance_sampling").result().metrics
    assert replayed["routing/replayed:mean"] == 1.0
    assert replayed["routing/topk_diff:mean"] == 0.0
    assert "routing/router_topk_diff:mean" in replayed
    forward = training.forward(data, "importance_sampling").result().metrics
    assert forward["routing/replayed:mean"] == 1.0
    # Without provenance the server has no routes to give: the trainer routes by itself.
    plain = training.forward_backward(
        [_without_provenance(d) for d in data], "importance_sampling"
    ).result()
    assert plain.metrics["routing/replayed:mean"] == 0.0
    assert "routing/topk_diff:mean" not in plain.metrics
    # One datum without routes: the call is not replayed, the others' routes still compared.
    mixed = training.forward_backward(
        [_without_provenance(data[0]), *data[1:]], "importance_sampling"
    ).result()
    assert mixed.metrics["routing/replayed:mean"] == 0.0
    assert "routing/topk_diff:mean" in mixed.metrics


def test_a_multiturn_datum_replays_its_last_turns_routes(clients):
    """The cookbook's spans of a two-turn episode: the first request's prompt and action, the
    observation as the second request's prompt, its action but the last token. The second
    request's records cover the whole input (its prompt is the whole episode before it)."""
    training, sampler = clients
    tokenizer = training.get_tokenizer()
    first_prompt = tokenizer.encode("12=")
    first = _sample(sampler, first_prompt, 1).sequences[0]
    observation = tokenizer.encode("3+4=")
    second_prompt = [*first_prompt, *first.tokens, *observation]
    second = _sample(sampler, second_prompt, 1).sequences[0]
    tokens = [*second_prompt, *second.tokens]
    num_first = len(first_prompt) + len(first.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * (len(tokens) - 1),
            "advantages": [0.0] * (len(tokens) - 1),
        },
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=first.sequence_id, length=len(first_prompt)),
            types.SampledProvenanceSpan(sequence_id=first.sequence_id, length=len(first.tokens)),
            types.PromptProvenanceSpan(
                sequence_id=second.sequence_id, offset=num_first, length=len(observation)
            ),
            types.SampledProvenanceSpan(
                sequence_id=second.sequence_id, length=len(second.tokens) - 1
            ),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(
                sequence_id=first.sequence_id, offset=1, length=len(first_prompt) - 1
            ),
            types.SampledProvenanceSpan(sequence_id=first.sequence_id, length=len(first.tokens)),
            types.PromptProvenanceSpan(
                sequence_id=second.sequence_id, offset=num_first, length=len(observation)
            ),
            types.SampledProvenanceSpan(sequence_id=second.sequence_id, length=len(second.tokens)),
        ],
    )
    metrics = training.forward_backward([datum], "importance_sampling").result().metrics
    assert metrics["routing/replayed:mean"] == 1.0 and metrics["routing/topk_diff:mean"] == 0.0


def test_replay_needs_temper_engine(tmp_path: Path):
    from temper.server.state.config import ServerConfig

    with pytest.raises(ValueError, match="routing_replay='sampler' needs the sampler's routes"):
        ServerConfig(model=["x"], routing_replay="sampler", generator=_vllm())
    with pytest.raises(ValueError, match="routing_replay must be 'off' or 'sampler'"):
        ServerConfig(model=["x"], routing_replay="on")


def _vllm():
    from temper.generator.choice import GeneratorChoice

    return GeneratorChoice.Config(backend="vllm")
