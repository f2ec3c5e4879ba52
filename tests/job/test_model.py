"""ModelChoice: the model a job trains, and the clients it builds for it."""

from __future__ import annotations

import pytest
import torch

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
