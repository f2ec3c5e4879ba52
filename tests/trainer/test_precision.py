"""Mixed precision (trainer/precision.py) on CPU, where autocast supports bf16: fp32 master
weights keep the small AdamW updates that pure bf16 rounds away, a bf16-mixed step computes
about what the fp32 step does, and 'auto' picks bf16-mixed on CUDA and fp32 elsewhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from temper import ServiceClient
from temper.api import AdamParams, Datum, ModelInput, SamplingParams
from temper.models import materialize, qwen3_size
from temper.models.common.logprobs import target_logprobs
from temper.trainer import LoraConfig, TrainerEngine
from temper.trainer.precision import Precision
from tests.distributed import training
from tests.trainer.test_shared_prefix import _grpo_data

# Adam's first step moves every weight by about the learning rate: 1e-5 is under half a bf16
# spacing (2^-9 of a weight) for every weight of magnitude above ~0.002.
SMALL_STEP = AdamParams(learning_rate=1e-5)


def _model(dtype: str = "float32") -> torch.nn.Module:
    config = dataclasses.replace(
        qwen3_size("tiny", vocab_size=training.VOCAB), num_layers=2, init_std=0.02
    )
    return materialize(config, dtype=dtype, seed=0)


def _engine(precision: str, **config) -> TrainerEngine:
    resolved = Precision.resolve(precision, device="cpu")
    compute = getattr(torch, resolved.compute) if resolved.mixed else None
    return TrainerEngine.Config(**config).build(
        model=_model(resolved.parameters), lora=None, compute_dtype=compute
    )


def _matrices(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    """The block matrices (the norms' weights sit at 1.0, where no small step shows)."""
    return {
        name: parameter.detach().clone()
        for name, parameter in engine.model.named_parameters()
        if parameter.ndim == 2 and name.startswith("blocks.")
    }


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _changed_share(before: dict, after: dict) -> float:
    changed = sum(int((after[name] != before[name]).sum()) for name in before)
    return changed / sum(tensor.numel() for tensor in before.values())


@pytest.mark.parametrize(
    ("precision", "least", "most"), [("bf16-mixed", 0.95, 1.0), ("bfloat16", 0.0, 0.25)]
)
def test_an_update_below_half_a_bf16_spacing_survives_only_with_fp32_master_weights(
    precision, least, most
):
    engine = _engine(precision)
    before = _matrices(engine)
    engine.forward_backward(training.batch(0), "cross_entropy")
    if precision == "bf16-mixed":
        # Master weights and gradients stay fp32; only the matmuls ran in bf16.
        assert all(p.dtype == torch.float32 for p in engine.model.parameters())
        assert all(p.grad.dtype == torch.float32 for p in engine.trainable)
    engine.optim_step(SMALL_STEP)
    state = engine.optimizer.torch_optimizer.state
    expected = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    assert all(state[p]["exp_avg_sq"].dtype == expected for p in engine.trainable)
    # Pure bf16 keeps only the steps of weights near zero, where the spacing is finer.
    assert least <= _changed_share(before, _matrices(engine)) <= most


def test_a_bf16_mixed_step_computes_about_what_the_fp32_step_does():
    fp32, mixed = _engine("float32"), _engine("bf16-mixed")
    data = training.batch(0)
    reference = fp32.forward_backward(data, "cross_entropy")
    output = mixed.forward_backward(data, "cross_entropy")
    loss, expected = output.metrics["loss:sum"], reference.metrics["loss:sum"]
    assert loss == pytest.approx(expected, rel=1e-2)
    assert loss != expected  # the matmuls did run in bf16
    for got, want in zip(output.loss_fn_outputs, reference.loss_fn_outputs, strict=True):
        torch.testing.assert_close(
            got["logprobs"].to_torch(), want["logprobs"].to_torch(), rtol=0, atol=5e-2
        )
    for ours, theirs in zip(mixed.trainable, fp32.trainable, strict=True):
        assert _cosine(ours.grad, theirs.grad) > 0.99
    # The steps agree too: one optimizer step from the same weights.
    mixed.optim_step(SMALL_STEP)
    fp32.optim_step(SMALL_STEP)
    after = fp32.forward(training.batch(1), "cross_entropy").metrics["loss:sum"]
    assert mixed.forward(training.batch(1), "cross_entropy").metrics["loss:sum"] == pytest.approx(
        after, rel=1e-2
    )


def test_bf16_mixed_runs_autocast_on_every_shard_thread():
    """Autocast is per thread: the thread shards enter it themselves."""
    one, two = _engine("bf16-mixed"), _engine("bf16-mixed", shard_threads=2)
    data = training.batch(0)
    loss = one.forward_backward(data, "cross_entropy").metrics["loss:sum"]
    assert two.forward_backward(data, "cross_entropy").metrics["loss:sum"] == pytest.approx(
        loss, rel=1e-4
    )
    # Each shard's gradients come out of bf16 matmuls, rounded before they are summed.
    for a, b in zip(one.trainable, two.trainable, strict=True):
        assert _cosine(a.grad, b.grad) > 0.9999


def test_fp32_and_pure_bf16_engines_do_not_autocast():
    assert _engine("float32").compute_dtype == torch.float32
    assert _engine("bfloat16").compute_dtype == torch.bfloat16
    assert _engine("bf16-mixed").compute_dtype == torch.bfloat16


def test_chunked_logprobs_under_autocast_recompute_in_the_autocast_dtype():
    """Backward recomputes each chunk's log-softmax outside autocast: it must use the bf16
    matmul the forward used, so several chunks give the gradients of one."""
    torch.manual_seed(0)
    hidden_BTD = torch.randn(2, 6, 16, requires_grad=True)
    weight_VD = torch.randn(11, 16, requires_grad=True)
    targets_BT = torch.randint(0, 11, (2, 6))
    results = []
    for chunk_bytes in (11 * 4 * 3, 2**20):  # 3 rows a chunk, then one chunk
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs_BT = target_logprobs(
                hidden_BTD, weight_VD, targets_BT, chunk_bytes=chunk_bytes
            )
        grads = torch.autograd.grad(logprobs_BT.sum(), (hidden_BTD, weight_VD))
        results.append((logprobs_BT, *grads))
    for chunked, whole in zip(*results, strict=True):
        torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    # The matmul ran in bf16: not the fp32 logprobs.
    fp32 = target_logprobs(hidden_BTD, weight_VD, targets_BT)
    assert not torch.equal(results[0][0], fp32)
    torch.testing.assert_close(results[0][0], fp32, rtol=0, atol=0.5)


@pytest.mark.parametrize(
    ("name", "device", "resolved"),
    [
        ("auto", "cuda", "bf16-mixed"),
        ("auto", "cuda:1", "bf16-mixed"),
        ("auto", "cpu", "float32"),
        ("float32", "cuda", "float32"),
        ("bfloat16", "cpu", "bfloat16"),
        ("bf16-mixed", "cpu", "bf16-mixed"),
    ],
)
def test_auto_is_bf16_mixed_on_cuda_and_fp32_elsewhere(name, device, resolved):
    precision = Precision.resolve(name, device=device)
    assert precision.name == resolved
    dtypes = {
        "float32": ("float32", "float32"),
        "bf16-mixed": ("float32", "bfloat16"),
        "bfloat16": ("bfloat16", "bfloat16"),
    }
    assert (precision.parameters, precision.compute) == dtypes[resolved]
    assert precision.mixed == (resolved == "bf16-mixed")


def test_an_unknown_precision_names_the_field():
    with pytest.raises(ValueError, match=r"--model.dtype must be one of .*bf16-mixed.*'fp16'"):
        Precision.resolve("fp16", device="cpu", field="--model.dtype")


def test_a_bf16_mixed_lora_trainer_keeps_its_base_in_bf16_and_its_adapters_in_fp32():
    engine = TrainerEngine.Config().build(
        model=_model("bfloat16"), lora=LoraConfig(rank=4), compute_dtype=torch.bfloat16
    )
    frozen = [p for p in engine.model.parameters() if not p.requires_grad]
    assert {p.dtype for p in frozen} == {torch.bfloat16}  # no master copy: never updated
    assert {p.dtype for p in engine.trainable} == {torch.float32}
    before = [p.detach().clone() for p in engine.trainable]
    engine.forward_backward(training.batch(0), "cross_entropy")
    assert {p.grad.dtype for p in engine.trainable} == {torch.float32}
    engine.optim_step(SMALL_STEP)
    names = [name for name, p in engine.model.named_parameters() if p.requires_grad]
    for name, old, parameter in zip(names, before, engine.trainable, strict=True):
        # B starts at zero, so A's first gradient is zero; B moves by ~1e-5 from 0.
        assert torch.equal(old, parameter) == name.endswith("lora_A"), name


def test_compute_dtype_float32_is_refused():
    with pytest.raises(ValueError, match="compute_dtype float32"):
        TrainerEngine.Config().build(model=_model(), lora=None, compute_dtype=torch.float32)


@pytest.mark.gpu
def test_bf16_mixed_on_cuda_keeps_small_updates_and_samples_bf16(tmp_path):
    """The GPU default end to end on one GPU: 'auto' is bf16-mixed, the step keeps fp32 state
    and a below-half-spacing update, and the generator decodes a bf16 copy."""
    service = ServiceClient(storage_dir=tmp_path, device="cuda", dtype="auto")
    assert service.precision.name == "bf16-mixed"
    client = service.create_training_client("tiny")
    engine = client.engine
    before = _matrices(engine)
    tokens = client.get_tokenizer().encode("12+34=46")
    datum = Datum(
        model_input=ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    client.forward_backward([datum], "cross_entropy").result()
    client.optim_step(SMALL_STEP).result()
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert _changed_share(before, _matrices(engine)) > 0.9
    sampler = client.save_weights_and_get_sampling_client()
    assert {p.dtype for p in sampler.generator.model.parameters()} == {torch.bfloat16}
    prompt = ModelInput.from_ints(tokens[:3])
    result = sampler.sample(prompt, 1, SamplingParams(max_tokens=4, temperature=0)).result()
    assert result.sequences[0].tokens


def test_bf16_mixed_shared_prefix_batches_track_the_padded_path():
    """GRPO groups run their prompt once (packed) under autocast too: bf16 rounding apart, the
    logprobs and gradients of the padded path."""
    data = _grpo_data()
    padded, packed = (_engine("bf16-mixed", share_prefixes=share) for share in (False, True))
    expected = padded.forward_backward(data, "ppo")
    actual = packed.forward_backward(data, "ppo")
    for want, got in zip(expected.loss_fn_outputs, actual.loss_fn_outputs, strict=True):
        torch.testing.assert_close(
            got["logprobs"].to_torch(), want["logprobs"].to_torch(), rtol=0, atol=5e-2
        )
    for reference, parameter in zip(padded.trainable, packed.trainable, strict=True):
        assert _cosine(parameter.grad, reference.grad) > 0.999
