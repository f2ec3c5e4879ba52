"""The model a job trains: which base model, full or LoRA, on which device and dtype.

A job's config holds it as `model: ModelChoice.Config` (flags `--model.base_model`,
`--model.lora_rank`, `--model.dtype`: the precision, bf16 compute on fp32 master weights by
default on GPUs, ...), and the job asks it for the in-process `ServiceClient` and the
training client, new or restored from a full-state checkpoint. The engines behind the clients
(`sampler`, `generator`, `trainer`) stay in the job's config: their defaults differ per job,
and the RL job adapts them to the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import get_args

import torch

from temper.client.sampler_weights import resolve_base_model
from temper.client.service_client import ServiceClient, check_device
from temper.client.training_client import TrainingClient
from temper.config.checks import check_choice, check_range
from temper.config.configurable import Configurable
from temper.config.local_paths import LOCAL_PATH
from temper.distributed.ranks import Ranks
from temper.generator.choice import GeneratorChoice
from temper.generator.multi_lora import MultiLoraSampler
from temper.generator.remote import RemoteGenerators
from temper.job.memory_plan import model_config
from temper.models.common.decoder import DecoderConfig
from temper.sampler.engine import SamplerEngine
from temper.trainer.engine import TrainerEngine
from temper.trainer.precision import Precision, PrecisionName


def default_device() -> str:
    """'cuda' where torch sees a GPU, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def with_vllm_sleep(generator: GeneratorChoice.Config) -> GeneratorChoice.Config:
    """A vLLM generator that a job puts to sleep while it trains starts in vLLM's sleep mode
    (without it sleep() frees nothing), keeping its weights in host memory unless the job's
    config chose otherwise."""
    if generator.vllm.sleep != "off":
        return generator
    return replace(generator, vllm=replace(generator.vllm, sleep="keep_weights"))


class ModelChoice(Configurable):
    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        base_model: str = field(default="tiny", metadata=LOCAL_PATH)
        """Model directory, or a named size with random weights and a built-in vocabulary:
        a HF repo id ('Qwen/Qwen3-8B', 'meta-llama/Llama-3.1-8B', 'Qwen/Qwen3-30B-A3B'),
        FAMILY/SIZE ('llama/tiny', 'qwen3_moe/tiny') or a Qwen3 size alone ('tiny'), optionally
        with ':' and a vocabulary ('tiny:letters', 'llama/tiny:words'; default digits)."""
        lora_rank: int | None = None
        """LoRA rank; None trains every parameter."""
        lora_seed: int | None = None
        """Seed of the LoRA adapters' initialization (lora_rank set); None: the job's seed."""
        device: str = field(default_factory=lambda: default_device())
        """Device of the trainer and sampler: 'cpu' or 'cuda' (under torchrun, each rank's
        GPU); default 'cuda' where torch sees a GPU, else 'cpu'."""
        dtype: PrecisionName = "auto"
        """Precision (trainer/precision.py). 'bf16-mixed': fp32 trained weights, gradients and
        AdamW moments (a frozen LoRA base stays bf16), bf16 matmuls (autocast; FSDP gathers
        bf16 and reduces in fp32), and a bf16 copy for the generator, cast at each weight
        sync. 'float32': fp32 throughout (TF32 matmuls on CUDA). 'bfloat16': pure bf16 with
        no fp32 master weights: half the memory of weights and optimizer state, but an AdamW
        update below half a bf16 spacing rounds away (lr below ~6e-5 leaves 0.02-scale
        weights unchanged). 'auto': bf16-mixed on CUDA, float32 on CPU."""

        def __post_init__(self) -> None:
            check_range(
                self.lora_rank, field="ModelChoice.Config.lora_rank", at_least=1, also=(None,)
            )
            check_choice(
                self.dtype, field="ModelChoice.Config.dtype", choices=get_args(PrecisionName)
            )

        @property
        def precision(self) -> Precision:
            """`dtype` on this config's device ('auto' resolved)."""
            return Precision.resolve(self.dtype, device=self.device, field="--model.dtype")

    def __init__(self, config: Config) -> None:
        self.config = config

    def service_client(
        self,
        *,
        storage_dir: Path,
        sampler: SamplerEngine.Config,
        trainer: TrainerEngine.Config,
        generator: GeneratorChoice.Config | None = None,
        remote: RemoteGenerators | None = None,
        sleep_generator: bool = False,
    ) -> ServiceClient:
        """The in-process service on this model's device and dtype, storing under
        `storage_dir`, with the job's engine configs (`remote`: the generator ranks of a
        disaggregated placement)."""
        config = self.config
        # Named by its flag: the job's user set it there.
        named = f"--model.device is {config.device!r}"
        check_device(config.device, named=named, instead="pass --model.device cpu")
        if config.device.startswith("cuda"):
            # fp32 matmuls on tensor cores (TF32); bf16 ones are unaffected.
            torch.set_float32_matmul_precision("high")
        if sleep_generator and generator is not None and generator.backend == "vllm":
            generator = with_vllm_sleep(generator)
        return ServiceClient(
            storage_dir=storage_dir,
            device=config.device,
            dtype=config.dtype,
            sampler=sampler,
            trainer=trainer,
            generator=generator,
            # A job trains one policy: with Temper's engine a LoRA one samples merged
            # weights, which decode faster than adapters on the multi-LoRA sampler (CUDA
            # graphs, the CPU twins); an in-process vLLM takes its adapters (only they
            # are synced).
            multi_lora=MultiLoraSampler.Config(
                enabled=remote is None and generator is not None and generator.backend == "vllm"
            ),
            remote=remote,
            sleep_generator=sleep_generator,
        )

    def training_client(
        self, service: ServiceClient, *, train_state: str | None, job_seed: int
    ) -> TrainingClient:
        """A training client on the base model (full or LoRA, its adapters seeded by
        `lora_seed`, else `job_seed`), or, given the `train_state` of a full-state checkpoint,
        one restored from it with its optimizer."""
        if train_state is not None:
            return service.create_training_client_from_state_with_optimizer(train_state)
        config = self.config
        try:
            dtype = config.precision.parameters
            resolve_base_model(config.base_model, device=config.device, dtype=dtype)
        except ValueError as error:  # named by its flag: the job's user set it there
            raise ValueError(f"--model.base_model: {error}") from None
        if config.lora_rank is None:
            return service.create_training_client(config.base_model)
        return service.create_lora_training_client(
            config.base_model,
            rank=config.lora_rank,
            seed=job_seed if config.lora_seed is None else config.lora_seed,
        )


def check_generator_model(model: ModelChoice.Config, generator: GeneratorChoice.Config) -> None:
    """Refuse a model the job's generator backend cannot run on this machine (vLLM's CPU build
    and a hybrid model: generator/vllm_hybrid.py), from the model's config alone (its named
    size, or its directory's config.json): before a job writes its run directory or builds
    anything. The generator decodes in the trainer's compute dtype."""
    if generator.backend == "temper":
        return
    generator.check_model(model_shapes(model), dtype=model.precision.compute)


def model_shapes(model: ModelChoice.Config) -> DecoderConfig:
    """The trained model's config from its name or directory alone (nothing built); an
    error is named by its flag, where the user set it."""
    try:
        return model_config(model.base_model)
    except ValueError as error:
        raise ValueError(f"--model.base_model: {error}") from None


def check_generator_ranks(generator: GeneratorChoice.Config, *, ranks: Ranks, field: str) -> None:
    """The vLLM backend runs in one process: a job on several ranks would start one
    vLLM engine per rank inside an initialized process group, which vLLM does not support."""
    if generator.backend == "vllm" and ranks.world_size > 1:
        raise ValueError(
            f"{field}.backend='vllm' needs a job on one process, but this one runs on "
            f"{ranks.world_size} ranks; use backend 'temper' with --nproc, or drop --nproc"
        )
