"""A served model's memory estimates are the memory plan's (job/model_bytes.py): the same
weights, adapters, gradients and moments, and the same sampler (a LoRA model's merged, a full
fine-tuning model's on the trainer's own tensors)."""

from __future__ import annotations

import pytest

from temper.checkpoint.model_source import init_model_dir
from temper.job.memory_plan import PlanSettings, plan_memory
from temper.sampler.engine import SamplerEngine
from temper.server.http.errors import NotFound
from temper.server.state.base_models import BaseModels, load_base_model

SAMPLER = SamplerEngine.Config(max_batch=4, max_seq_len=64, prefix_cache_mib=1)


def _rows(model_dir, *, lora_rank: int | None) -> dict[str, int]:
    settings = PlanSettings(
        model=str(model_dir),
        lora_rank=lora_rank,
        dtype="float32",
        nproc_per_node=1,
        batch=SAMPLER.max_batch,
        max_seq_len=SAMPLER.max_seq_len,
        max_batch=SAMPLER.max_batch,
        prefix_cache_mib=SAMPLER.prefix_cache_mib,
    )
    rows = plan_memory(settings).role("colocated").rows
    return {row.item.split(",")[0].split(":")[0]: row.num_bytes for row in rows}


@pytest.mark.parametrize("lora_rank", [None, 3])
def test_a_training_models_estimate_is_the_plans_trainer_and_generator(model_dir, lora_rank):
    base = load_base_model(str(model_dir), trainable=True, sampler=SAMPLER, dtype="float32")
    rows = _rows(model_dir, lora_rank=lora_rank)
    trainer = rows["AdamW moments (2)"] + rows["gradients"]
    sampler = rows["generator weights"] + rows["KV cache"] + rows["prefix cache"]
    if lora_rank is None:
        assert rows["weights"] == base.weights_bytes
        trainer += rows["weights"]
        assert rows["generator weights"] == 0  # the trainer's own tensors
    else:
        assert rows["base weights (frozen)"] == base.weights_bytes
        assert rows["LoRA adapters"] == lora_rank * base.lora_bytes_per_rank
        trainer += rows["LoRA adapters"]
        assert sampler == base.merged_sampler_bytes
    # A LoRA model on its own base and sampler (a sharded trainer's) holds its base too.
    shared_base = lora_rank is None
    own_base = 0 if shared_base else base.weights_bytes
    estimate = base.training_bytes(lora_rank=lora_rank, shared_base=shared_base)
    assert estimate == trainer + own_base + sampler


def test_an_unsupported_family_is_refused_naming_its_directory(model_dir, tmp_path):
    import json
    import shutil

    other = tmp_path / "ssm"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="mamba2", architectures=["Mamba2ForCausalLM"])
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as raised:
        load_base_model(str(other), trainable=True, sampler=SAMPLER, dtype="float32")
    message = str(raised.value)
    assert message.startswith(f"model directory {other}: ")
    assert "'Mamba2ForCausalLM'" in message and "Qwen3_5ForCausalLM" in message


def test_a_served_directory_answers_to_its_hf_repo_id(tmp_path):
    """A download laid out as <org>/<model> is found by the name the tinker SDK gives it."""
    paths = [tmp_path / "Qwen" / "Qwen3-8B", tmp_path / "meta-llama" / "Llama-3.1-8B"]
    for path, family in zip(paths, ("qwen3", "llama"), strict=True):
        init_model_dir(path, family=family)
    models = BaseModels(
        [
            load_base_model(str(path), trainable=True, sampler=SAMPLER, dtype="float32")
            for path in paths
        ]
    )
    for path, repo_id in zip(paths, ("Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B"), strict=True):
        assert models.resolve(repo_id).name == str(path.resolve())
        assert models.resolve(path.name) is models.resolve(repo_id)
    with pytest.raises(NotFound, match="'Qwen/Qwen3-4B' is not served here"):
        models.resolve("Qwen/Qwen3-4B")
