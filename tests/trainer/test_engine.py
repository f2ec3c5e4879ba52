"""The trainer engine: loss outputs, gradient accumulation and micro-batching, AdamW, LoRA,
custom losses, and failed calls that change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper.api import AdamParams, Datum, ModelInput
from temper.models import materialize, qwen3_size
from temper.models.common.logprobs import forward_logprobs
from temper.trainer import LoraConfig, TrainerEngine

VOCAB = 31


def _model(seed: int = 0):
    config = dataclasses.replace(qwen3_size("tiny", vocab_size=VOCAB), init_std=0.1)
    return materialize(config, seed=seed)


def _engine(*, lora: LoraConfig | None = None, max_tokens: int = 8192, seed: int = 0):
    config = TrainerEngine.Config(max_tokens_per_microbatch=max_tokens)
    return config.build(model=_model(seed), lora=lora)


def _datum(tokens, *, weights=None, **extra):
    inputs = {"target_tokens": tokens[1:], **extra}
    inputs["weights"] = weights if weights is not None else [1.0] * (len(tokens) - 1)
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


def _batch(seed: int = 0, count: int = 6):
    generator = torch.Generator().manual_seed(seed)
    data = []
    for index in range(count):
        length = 4 + (index * 3) % 9
        tokens = torch.randint(0, VOCAB, (length,), generator=generator).tolist()
        data.append(_datum(tokens))
    return data


def _rl_datum(tokens, *, seed, **extra):
    generator = torch.Generator().manual_seed(seed)
    n = len(tokens) - 1
    return Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": (-torch.rand(n, generator=generator) * 3).tolist(),
            "advantages": torch.randn(n, generator=generator).tolist(),
            **extra,
        },
    )


def _assert_close_to_scale(actual, expected, *, rel=1e-5):
    # Summation order differs between micro-batch layouts: compare to the gradient's scale.
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= rel * scale, (actual - expected).abs().max()


def _grads(engine):
    return [None if p.grad is None else p.grad.clone() for p in engine.trainable]


def test_outputs_are_trainer_logprobs_and_loss_is_their_weighted_sum():
    engine = _engine()
    data = _batch()
    output = engine.forward_backward(data, "cross_entropy")
    total = 0.0
    for datum, record in zip(data, output.loss_fn_outputs, strict=True):
        tokens = datum.model_input.to_ints()
        targets = datum.loss_fn_inputs["target_tokens"].to_torch()
        with torch.no_grad():
            expected = forward_logprobs(engine.model, torch.tensor([tokens]), targets[None])[0]
        logprobs = record["logprobs"].to_torch()
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(record["elementwise_loss"].to_torch(), -logprobs)
        total += float(-logprobs.sum())
    assert output.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)


def test_micro_batches_and_split_calls_give_the_whole_batch_gradient():
    data = _batch(count=8)
    whole = _engine()
    whole.forward_backward(data, "cross_entropy")
    tiny_budget = _engine(max_tokens=16)  # one or two datums per micro-batch
    tiny_budget.forward_backward(data, "cross_entropy")
    accumulated = _engine()
    accumulated.forward_backward(data[:3], "cross_entropy")
    accumulated.forward_backward(data[3:], "cross_entropy")
    for reference, micro, split in zip(
        _grads(whole), _grads(tiny_budget), _grads(accumulated), strict=True
    ):
        _assert_close_to_scale(micro, reference)
        _assert_close_to_scale(split, reference)


def test_forward_does_not_touch_gradients():
    engine = _engine()
    engine.forward(_batch(), "cross_entropy")
    assert all(p.grad is None for p in engine.trainable)


@pytest.mark.parametrize(
    ("loss_fn", "config"),
    [
        ("importance_sampling", None),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("cispo", None),
        ("dro", {"beta": 0.1}),
    ],
)
def test_rl_losses_run_and_report_logprobs(loss_fn, config):
    engine = _engine()
    data = [_rl_datum([1, 5, 7, 9, 2, 4], seed=s) for s in range(3)]
    output = engine.forward_backward(data, loss_fn, config)
    assert len(output.loss_fn_outputs) == 3
    assert all(p.grad is not None for p in engine.trainable)
    assert torch.isfinite(torch.tensor(output.metrics["loss:sum"]))


def test_custom_loss_gradient_equals_the_built_in_one():
    data = _batch(seed=3)
    built_in = _engine()
    built_in.forward_backward(data, "cross_entropy")
    custom = _engine(max_tokens=20)

    def negative_log_likelihood(datums, logprobs):
        weights = [d.loss_fn_inputs["weights"].to_torch() for d in datums]
        loss = -sum((lp * w).sum() for lp, w in zip(logprobs, weights, strict=True))
        return loss, {"custom_metric:sum": 1.0}

    output = custom.forward_backward_custom(data, negative_log_likelihood)
    assert output.metrics["custom_metric:sum"] == 1.0
    for a, b in zip(_grads(custom), _grads(built_in), strict=True):
        _assert_close_to_scale(a, b)


def test_optim_step_is_adamw_with_the_calls_hyperparameters():
    engine = _engine()
    reference_model = _model()
    # torch's foreach AdamW, as the engine uses for plain CPU/CUDA parameters: bitwise equal.
    reference = torch.optim.AdamW(
        reference_model.parameters(),
        lr=3e-3,
        betas=(0.8, 0.9),
        eps=1e-8,
        weight_decay=0.1,
        foreach=True,
    )
    unfused_model = _model()
    unfused = torch.optim.AdamW(
        unfused_model.parameters(), lr=3e-3, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.1
    )
    params = AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1)
    for step in range(3):
        engine.forward_backward(_batch(seed=step), "cross_entropy")
        # The reference optimizer gets the engine's own gradients, so any difference is the
        # optimizer's.
        for theirs, unfused_param, ours in zip(
            reference_model.parameters(), unfused_model.parameters(), engine.trainable, strict=True
        ):
            theirs.grad = ours.grad.clone()
            unfused_param.grad = ours.grad.clone()
        reference.step()
        unfused.step()
        response = engine.optim_step(params)
        assert response.metrics["policy_version:max"] == step + 1
        assert response.metrics["learning_rate:mean"] == 3e-3
    for ours, theirs, unfused_param in zip(
        engine.model.parameters(),
        reference_model.parameters(),
        unfused_model.parameters(),
        strict=True,
    ):
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, unfused_param, rtol=1e-6, atol=1e-7)
    assert all(p.grad is None for p in engine.trainable)


def test_grad_clipping_reports_the_norm_before_clipping():
    engine = _engine()
    engine.forward_backward(_batch(), "cross_entropy")
    norm = torch.nn.utils.get_total_norm([p.grad for p in engine.trainable]).item()
    before = [p.detach().clone() for p in engine.trainable]
    response = engine.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=norm / 10))
    assert response.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    assert any(not torch.equal(a, p) for a, p in zip(before, engine.trainable, strict=True))


def test_lora_trains_only_adapters():
    engine = _engine(lora=LoraConfig(rank=4, seed=1))
    base_before = {
        n: p.detach().clone() for n, p in engine.model.named_parameters() if "lora" not in n
    }
    for _ in range(3):
        engine.forward_backward(_batch(), "cross_entropy")
        engine.optim_step(AdamParams(learning_rate=1e-2))
    for name, parameter in engine.model.named_parameters():
        if "lora" in name:
            assert parameter.requires_grad
        else:
            assert not parameter.requires_grad and torch.equal(parameter, base_before[name]), name
    assert any("lora_B" in n and p.abs().sum() > 0 for n, p in engine.model.named_parameters())


@pytest.mark.parametrize(
    ("make_data", "loss_fn", "message"),
    [
        (
            lambda: [_datum([1, 2, 3]), _datum([1, 2, 3], weights=[1.0])],
            "cross_entropy",
            r"datum 1: loss_fn_inputs\['weights'\] has shape \[1\], but model_input has 2 tokens",
        ),
        (lambda: _batch(), "cross_entropyy", "unknown loss"),
        (
            lambda: [_datum([1, 2, 3])],
            "importance_sampling",
            r"datum 0: loss_fn_inputs is missing \['logprobs', 'advantages'\]",
        ),
        (
            lambda: [
                _rl_datum([1, 2, 3], seed=0),
                Datum(
                    model_input=ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={
                        "target_tokens": [2, 3],
                        "logprobs": [0.0, 0.0],
                        "advantages": [1.0, float("nan")],
                    },
                ),
            ],
            "importance_sampling",
            r"datum 1: loss_fn_inputs\['advantages'\] has a non-finite value \(nan\) at position 1",
        ),
        (
            lambda: [_datum([1, 2, 3]), _datum([1, 2, VOCAB + 5])],
            "cross_entropy",
            rf"datum 1: loss_fn_inputs\['target_tokens'\]: token {VOCAB + 5} at position 1 is "
            rf"outside the vocabulary; valid ids are 0..{VOCAB - 1}",
        ),
        (lambda: [_datum([1, 99, 3])], "cross_entropy", r"datum 0: model_input: token 99"),
        (lambda: [], "cross_entropy", "data is empty"),
        (
            lambda: [
                _rl_datum([1, 2, 3], seed=0),
                _rl_datum([1, 2, 3], seed=1, clip_low_threshold=[0.5, 0.5]),
            ],
            "ppo",
            r"datum 0: loss_fn_inputs lacks 'clip_low_threshold', which other datums of this "
            r"call carry",
        ),
    ],
    ids=[
        "lengths",
        "unknown-loss",
        "missing-inputs",
        "nan",
        "target-vocab",
        "input-vocab",
        "empty",
        "optional-on-some",
    ],
)
def test_bad_calls_name_the_datum_and_field_and_change_nothing(make_data, loss_fn, message):
    engine = _engine()
    engine.forward_backward(_batch(), "cross_entropy")  # gradients already accumulated
    grads = _grads(engine)
    params = [p.detach().clone() for p in engine.trainable]
    with pytest.raises(ValueError, match=message):
        engine.forward_backward(make_data(), loss_fn)
    for before, parameter in zip(grads, engine.trainable, strict=True):
        assert torch.equal(parameter.grad, before)
    assert all(torch.equal(a, p) for a, p in zip(params, engine.trainable, strict=True))


def test_a_failure_midway_restores_the_accumulated_gradients(monkeypatch):
    engine = _engine(max_tokens=16)
    engine.forward_backward(_batch(seed=1), "cross_entropy")
    grads = _grads(engine)
    calls = []
    original = engine._logprobs_N

    def failing_third_micro_batch(batch):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated out-of-memory")
        return original(batch)

    monkeypatch.setattr(engine, "_logprobs_N", failing_third_micro_batch)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.forward_backward(_batch(seed=2), "cross_entropy")
    assert len(calls) == 3  # two micro-batches had already back-propagated
    for before, parameter in zip(grads, engine.trainable, strict=True):
        assert torch.equal(parameter.grad, before)


def test_bad_adam_params_are_named():
    with pytest.raises(ValueError, match=r"AdamParams.beta2 must be in \[0, 1\), got 1.5"):
        AdamParams(beta2=1.5)
    with pytest.raises(ValueError, match=r"AdamParams.learning_rate must be >= 0"):
        AdamParams(learning_rate=-1.0)
