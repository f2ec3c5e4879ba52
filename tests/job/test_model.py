"""ModelChoice: the model a job trains, and the clients it builds for it."""

from __future__ import annotations

import pytest
import torch

from temper.generator.choice import GeneratorChoice
from temper.job import ModelChoice
from temper.sampler.engine import SamplerEngine
from temper.trainer.engine import TrainerEngine


def _adapters(choice: ModelChoice.Config, tmp_path, *, job_seed: int) -> dict[str, torch.Tensor]:
    model = choice.build()
    service = model.service_client(
        storage_dir=tmp_path / f"storage-{job_seed}-{choice.lora_seed}",
        sampler=SamplerEngine.Config(max_batch=4, max_seq_len=32),
        trainer=TrainerEngine.Config(),
    )
    training = model.training_client(service, train_state=None, job_seed=job_seed)
    return {
        name: parameter.detach().clone()
        for name, parameter in training.engine.model.named_parameters()
        if parameter.requires_grad
    }


def test_lora_adapters_are_seeded_by_the_job_unless_lora_seed_is_set(tmp_path):
    by_job = _adapters(ModelChoice.Config(lora_rank=2), tmp_path, job_seed=3)
    by_field = _adapters(ModelChoice.Config(lora_rank=2, lora_seed=3), tmp_path, job_seed=0)
    other = _adapters(ModelChoice.Config(lora_rank=2), tmp_path, job_seed=4)
    assert by_job.keys() == by_field.keys() == other.keys() and by_job
    assert all(torch.equal(by_job[name], by_field[name]) for name in by_job)
    assert not all(torch.equal(by_job[name], other[name]) for name in by_job)


def test_full_fine_tuning_trains_every_parameter_and_lora_only_adapters(tmp_path):
    full = _adapters(ModelChoice.Config(), tmp_path, job_seed=0)
    lora = _adapters(ModelChoice.Config(lora_rank=2), tmp_path, job_seed=0)
    assert "embed.weight" in full and not any("lora" in name for name in full)
    assert lora and all("lora" in name for name in lora)


def test_a_bad_lora_rank_is_named():
    with pytest.raises(ValueError, match=r"ModelChoice.Config.lora_rank must be >= 1 or None"):
        ModelChoice.Config(lora_rank=0)


@pytest.mark.parametrize(
    ("device", "dtype", "resolved"),
    [
        ("cuda", "auto", "bf16-mixed"),
        ("cpu", "auto", "float32"),
        ("cuda", "bfloat16", "bfloat16"),
        ("cpu", "bf16-mixed", "bf16-mixed"),
    ],
)
def test_the_default_precision_is_bf16_mixed_on_cuda_and_fp32_on_cpu(device, dtype, resolved):
    # No GPU needed: resolving the precision reads the device's name only.
    assert ModelChoice.Config().dtype == "auto"
    assert ModelChoice.Config(device=device, dtype=dtype).precision.name == resolved


def test_a_bf16_mixed_job_model_trains_fp32_weights_and_samples_bf16(tmp_path):
    choice = ModelChoice.Config(dtype="bf16-mixed")
    model = choice.build()
    service = model.service_client(
        storage_dir=tmp_path,
        sampler=SamplerEngine.Config(max_batch=4, max_seq_len=32),
        trainer=TrainerEngine.Config(),
    )
    training = model.training_client(service, train_state=None, job_seed=0)
    assert {p.dtype for p in training.engine.model.parameters()} == {torch.float32}
    sampler = training.save_weights_and_get_sampling_client()
    assert {p.dtype for p in sampler.generator.model.parameters()} == {torch.bfloat16}


def test_a_bad_precision_is_named():
    with pytest.raises(ValueError, match=r"ModelChoice\.Config\.dtype"):
        ModelChoice.Config(dtype="float16")


@pytest.mark.parametrize("backend", ["temper", "vllm"])
def test_a_lora_job_samples_adapters_on_vllm_and_merged_weights_on_temper(tmp_path, backend):
    """vLLM takes a LoRA job's adapters (its syncs carry adapter bytes only); Temper's engine
    decodes merged weights faster than its multi-LoRA sampler."""
    service = (
        ModelChoice.Config(lora_rank=2)
        .build()
        .service_client(
            storage_dir=tmp_path,
            sampler=SamplerEngine.Config(max_batch=4, max_seq_len=32),
            trainer=TrainerEngine.Config(),
            generator=GeneratorChoice.Config(backend=backend),
        )
    )
    assert service.multi_lora_config.enabled == (backend == "vllm")
