"""Several base models per `temper serve`, driven by the unmodified tinker SDK.

The server serves the tiny student (`--model`), a smaller model of another shape (`--model`,
the teacher of the distillation step) and a third shape sample-only (`--sample-only-model`);
all share the digits vocabulary. A second server with a small `--model-memory-mb` shows a
sampler released to make room and the 503 of a model that cannot fit.
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

import pytest
import tinker
import torch
from tinker import types

from tests.server.conftest import start_server

PROMPT = "12="


def write_model(directory: Path, *, dim: int, num_layers: int, ffn_dim: int, seed: int) -> Path:
    """A random Qwen3 of its own shape with the digits vocabulary."""
    from temper.checkpoint.hf import save_pretrained
    from temper.models.build import materialize
    from temper.models.registry import family
    from temper.tokenizer import build_builtin_tokenizer

    tokenizer = build_builtin_tokenizer("digits")
    config = dataclasses.replace(
        family("qwen3").sizes["tiny"],
        vocab_size=tokenizer.vocab_size,
        dim=dim,
        num_layers=num_layers,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        ffn_dim=ffn_dim,
    )
    model = materialize(config, device="cpu", dtype="float32", seed=seed)
    save_pretrained(model, directory, tokenizer=tokenizer)
    return directory


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    return write_model(
        tmp_path_factory.mktemp("models") / "teacher-digits",
        dim=64,
        num_layers=2,
        ffn_dim=128,
        seed=1,
    )


@pytest.fixture(scope="module")
def grader_dir(tmp_path_factory) -> Path:
    return write_model(
        tmp_path_factory.mktemp("models") / "grader-digits",
        dim=96,
        num_layers=1,
        ffn_dim=96,
        seed=2,
    )


@pytest.fixture(scope="module")
def multi(model_dir, teacher_dir, grader_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("multi")
    process = start_server(
        model_dir,
        root / "storage",
        root / "server.log",
        *("--model", str(teacher_dir), "--sample-only-model", str(grader_dir)),
        *("--model-idle-seconds", "2", "--checkpoint-sweep-seconds", "0.2"),
    )
    yield process
    process.stop()


@pytest.fixture(scope="module")
def service(multi):
    client = multi.service()
    yield client
    client.close("success").result()


def loaded_lines(server, model: Path) -> list[str]:
    return [
        line
        for line in server.log.read_text().splitlines()
        if f"base model {model.resolve()} loaded" in line
    ]


def released_lines(server, model: Path) -> list[str]:
    return [
        line
        for line in server.log.read_text().splitlines()
        if f"base model {model.resolve()} released" in line
    ]


def base_model_of(server, sampler) -> str:
    """The sampler's base model as the server reports it (GET samplers/{id})."""
    return server.rest().get_sampler(sampler._sampling_session_id).result().base_model


def sample_tokens(sampler, tokenizer, *, num_samples: int = 1, max_tokens: int = 4):
    prompt = types.ModelInput.from_ints(tokenizer.encode(PROMPT))
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0)
    return sampler.sample(prompt, num_samples, params).result()


def test_capabilities_list_every_model_with_its_flags(
    service, model_dir, teacher_dir, grader_dir, multi
):
    capabilities = multi.rest().get_server_capabilities().result()
    models = {m.model_name: m for m in capabilities.supported_models}
    assert set(models) == {str(d.resolve()) for d in (model_dir, teacher_dir, grader_dir)}
    student, teacher, grader = (
        models[str(d.resolve())] for d in (model_dir, teacher_dir, grader_dir)
    )
    assert student.trainable and student.sampleable
    assert teacher.trainable and teacher.sampleable
    assert not grader.trainable and grader.sampleable
    assert student.max_context_length == teacher.max_context_length == 2048
    # Nothing is loaded at startup: models load on first use.
    assert "loaded" not in multi.log.read_text()


def test_teacher_loads_on_first_use_and_is_released_when_idle(
    service, multi, model_dir, teacher_dir
):
    student = service.create_lora_training_client(str(model_dir), rank=4, seed=0).result()
    tokenizer = student.get_tokenizer()
    assert loaded_lines(multi, model_dir) and not loaded_lines(multi, teacher_dir)
    # Named by its directory's name: one of the names a client may use.
    teacher = service.create_sampling_client(base_model=teacher_dir.name).result()
    assert base_model_of(multi, teacher) == str(teacher_dir.resolve())
    assert len(loaded_lines(multi, teacher_dir)) == 1
    assert sample_tokens(teacher, tokenizer).sequences
    deadline = time.monotonic() + 10
    while not released_lines(multi, teacher_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert released_lines(multi, teacher_dir), "the idle teacher was not released"
    # Its sampling session stays valid: the next sample loads the model again.
    assert sample_tokens(teacher, tokenizer).sequences
    assert len(loaded_lines(multi, teacher_dir)) == 2
    # The student's training model holds its base model: it is never released.
    assert not released_lines(multi, model_dir)


def test_sample_second_model_while_training_first(service, model_dir, teacher_dir):
    student = service.create_lora_training_client(str(model_dir), rank=4, seed=1).result()
    tokenizer = student.get_tokenizer()
    teacher = service.create_sampling_client(base_model=str(teacher_dir)).result()
    tokens = [*tokenizer.encode("12=3"), tokenizer.eos_token_id]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [0, 0, 1, 1]},
    )
    losses = []
    for _ in range(3):
        backward = student.forward_backward([datum], "cross_entropy")
        samples = sample_tokens(teacher, tokenizer, num_samples=2)  # while the step runs
        losses.append(backward.result().metrics["loss:sum"])
        student.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert len(samples.sequences) == 2
    assert losses[-1] < losses[0]
    assert student.get_info().model_data.model_name == str(model_dir.resolve())


def test_on_policy_distillation_step(service, model_dir, teacher_dir):
    """tinker_cookbook distillation/train_on_policy.py: the student samples, the teacher
    scores the student's sequences with prompt logprobs, and the student trains on the
    negative reverse KL as its advantages."""
    student = service.create_lora_training_client(str(model_dir), rank=4, seed=2).result()
    tokenizer = student.get_tokenizer()
    teacher = service.create_sampling_client(base_model=str(teacher_dir.resolve())).result()
    prompt = tokenizer.encode(PROMPT)

    def teacher_logprobs(full: list[int]) -> list[float]:
        logprobs = teacher.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert logprobs[0] is None and len(logprobs) == len(full)
        return logprobs[1:]

    def step(*, learning_rate: float) -> list[list[int]]:
        sampler = student.save_weights_and_get_sampling_client()
        result = sample_tokens(sampler, tokenizer, num_samples=8, max_tokens=5)
        data = []
        for sequence in result.sequences:
            full = prompt + list(sequence.tokens)
            sampled_T = torch.tensor([0.0] * (len(prompt) - 1) + list(sequence.logprobs))
            mask_T = torch.tensor([0.0] * (len(prompt) - 1) + [1.0] * len(sequence.tokens))
            reverse_kl_T = (sampled_T - torch.tensor(teacher_logprobs(full))) * mask_T
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={
                        "target_tokens": full[1:],
                        "logprobs": sampled_T.tolist(),
                        "advantages": (-reverse_kl_T).tolist(),
                    },
                )
            )
        output = student.forward_backward(data, "importance_sampling").result()
        for datum, out in zip(data, output.loss_fn_outputs, strict=True):
            trained = out["logprobs"].tolist()[len(prompt) - 1 :]
            sampled = datum.loss_fn_inputs["logprobs"].tolist()[len(prompt) - 1 :]
            assert trained == pytest.approx(sampled, abs=1e-3)  # on-policy: they agree
        student.optim_step(types.AdamParams(learning_rate=learning_rate)).result()
        return [prompt + list(sequence.tokens) for sequence in result.sequences]

    def gap(sequences: list[list[int]]) -> float:
        """Mean squared student-teacher logprob difference on the completions."""
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:]},
            )
            for full in sequences
        ]
        outputs = student.forward(data, "cross_entropy").result().loss_fn_outputs
        diffs = [
            (s - t) ** 2
            for full, out in zip(sequences, outputs, strict=True)
            for s, t in zip(
                out["logprobs"].tolist()[len(prompt) - 1 :],
                teacher_logprobs(full)[len(prompt) - 1 :],
                strict=True,
            )
        ]
        return sum(diffs) / len(diffs)

    held_out = step(learning_rate=0.0)
    gap_before = gap(held_out)
    for _ in range(5):
        step(learning_rate=2e-4)
    assert gap(held_out) < 0.5 * gap_before  # about 0.079 -> 0.017


def test_checkpoint_of_second_model_samples_on_its_base(service, multi, teacher_dir):
    training = service.create_lora_training_client(str(teacher_dir), rank=4, seed=0).result()
    assert training.get_info().model_data.model_name == str(teacher_dir.resolve())
    path = training.save_weights_for_sampler("t1").result().path
    run = multi.rest().get_training_run(training.model_id).result()
    assert run.base_model == str(teacher_dir.resolve())
    sampler = service.create_sampling_client(model_path=path).result()
    assert base_model_of(multi, sampler) == str(teacher_dir.resolve())
    assert sample_tokens(sampler, training.get_tokenizer()).sequences
    # A checkpoint of one base model does not load into a model of another.
    other = service.create_lora_training_client(str(multi_student(multi)), rank=4).result()
    state = training.save_state("t1").result().path
    with pytest.raises(tinker.BadRequestError, match="trained on base model"):
        other.load_state(state).result()


def multi_student(server) -> str:
    models = server.rest().get_server_capabilities().result().supported_models
    return next(m.model_name for m in models if "tiny-digits" in m.model_name)


def test_unknown_model_is_404_naming_the_served_ones(service, model_dir, grader_dir):
    with pytest.raises(tinker.NotFoundError, match="not served here") as caught:
        service.create_sampling_client(base_model="no-such-model").result()
    assert str(model_dir.resolve()) in str(caught.value)
    assert f"{grader_dir.resolve()}' (sample-only)" in str(caught.value)
    with pytest.raises(tinker.NotFoundError, match="not served here"):
        service.create_lora_training_client("no-such-model").result()


def test_sample_only_model_refuses_training_and_samples(service, grader_dir, model_dir):
    with pytest.raises(tinker.BadRequestError, match="sampling only") as caught:
        service.create_lora_training_client(str(grader_dir)).result()
    assert str(model_dir.resolve()) in str(caught.value)  # the trainable ones are named
    grader = service.create_sampling_client(base_model=str(grader_dir)).result()
    tokenizer = service.create_sampling_client(base_model=str(model_dir)).result().get_tokenizer()
    logprobs = grader.compute_logprobs(
        types.ModelInput.from_ints(tokenizer.encode("12=3"))
    ).result()
    assert logprobs[0] is None and all(lp < 0 for lp in logprobs[1:])


def test_over_budget_is_503_naming_budget_and_holder(model_dir, teacher_dir, tmp_path):
    # The student's LoRA training model is estimated at about 292 MiB (the base weights and
    # the multi-LoRA sampler with the default KV and prefix caches its LoRA models share, its
    # adapters), the teacher's sampler at 96 MiB: one fits 300 MiB, not both.
    server = start_server(
        model_dir,
        tmp_path / "storage",
        tmp_path / "server.log",
        *("--model", str(teacher_dir), "--model-memory-mb", "300"),
    )
    try:
        service = server.service()
        teacher = service.create_sampling_client(base_model=str(teacher_dir)).result()
        tokenizer = teacher.get_tokenizer()
        assert sample_tokens(teacher, tokenizer).sequences
        # The idle teacher sampler makes room for the training model...
        student = service.create_lora_training_client(str(model_dir), rank=4).result()
        assert released_lines(server, teacher_dir)
        # ...which holds the budget until its session ends: the teacher cannot load again.
        with pytest.raises(tinker.APIStatusError) as caught:
            service.create_sampling_client(base_model=str(teacher_dir)).result()
        assert caught.value.status_code == 503
        # A session made before answers its sample's future with the same error (the SDK's
        # sampler would retry a 503 without end).
        with pytest.raises(tinker.RequestFailedError, match="--model-memory-mb 300"):
            sample_tokens(teacher, tokenizer)
        message = str(caught.value)
        assert "--model-memory-mb 300" in message
        assert f"training model {student.model_id}" in message
        assert "base weights and sampler its LoRA models share" in message
        assert str(teacher_dir.resolve()) in message
        service.close("success").result()
        # The session is over: its training model no longer holds the budget.
        again = server.service()
        assert sample_tokens(
            again.create_sampling_client(base_model=str(teacher_dir)).result(), tokenizer
        ).sequences
        again.close("success").result()
    finally:
        server.stop()


def test_a_lora_rank_the_budget_never_holds_is_400_naming_the_largest(model_dir, tmp_path):
    # 300 MiB hold the student's shared base weights and multi-LoRA sampler (about 291 MiB)
    # and the adapters of one LoRA model of a few dozen ranks (each rank x5 with its state).
    server = start_server(
        model_dir, tmp_path / "storage", tmp_path / "server.log", "--model-memory-mb", "300"
    )
    try:
        service = server.service()
        with pytest.raises(tinker.BadRequestError) as caught:
            service.create_lora_training_client(str(model_dir), rank=10**9).result()
        message = str(caught.value)
        assert "create_model: lora_config.rank 1000000000 does not fit" in message
        assert "more than the whole model memory budget (--model-memory-mb 300)" in message
        largest = int(re.search(r"the largest rank that fits is (\d+)", message).group(1))
        assert largest > 1
        with pytest.raises(
            tinker.BadRequestError, match=f"the largest rank that fits is {largest}'"
        ):
            service.create_lora_training_client(str(model_dir), rank=largest + 1).result()
        # The largest rank fits (the estimate the refusal used is the one the budget counts)...
        training = service.create_lora_training_client(str(model_dir), rank=largest).result()
        assert training.get_info().lora_rank == largest
        # ...and leaves no room for another model: that one would fit once this session ends,
        # so it is the server's 503, not the request's fault.
        with pytest.raises(tinker.APIStatusError) as taken:
            service.create_lora_training_client(str(model_dir), rank=1).result()
        assert taken.value.status_code == 503
        assert taken.value.body["category"] == "server"
        assert f"training model {training.model_id}" in str(taken.value)
        service.close("success").result()
    finally:
        server.stop()
