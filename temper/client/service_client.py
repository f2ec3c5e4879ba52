"""ServiceClient: makes training clients and sampling clients in this process.

`base_model` is a HF model directory, or a named size with random weights and a built-in
vocabulary. Training clients get their run id, their run.json under the checkpoint storage and
a trainer built from `trainer`; their sampling clients use a generator of the backend
`generator` chooses (Temper's engine, set up by `sampler`, or vLLM; see training_client.py).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from temper.api.futures import Worker
from temper.checkpoint.storage import CheckpointStorage, check_name
from temper.client.sampler_weights import (
    SamplerWeights,
    load_sampler_weights,
    recorded_base_model,
    resolve_base_model,
    sampler_vocab_size,
)
from temper.client.sampling_client import SamplingClient
from temper.client.shared_base import SharedBase, SharedBases
from temper.client.training_client import TrainingClient, training_kind
from temper.client.weight_sync import Snapshot
from temper.distributed.ranks import Ranks
from temper.generator.choice import GeneratorChoice
from temper.generator.multi_lora import AdapterSampler, MultiLoraSampler
from temper.generator.remote import RemoteGenerators
from temper.generator.seam import Generator
from temper.models.build import parse_dtype
from temper.models.lora import LoraConfig
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import Tokenizer, load_tokenizer
from temper.trainer.engine import TrainerEngine
from temper.trainer.precision import Precision, PrecisionName

DEFAULT_STORAGE = Path("~/.cache/temper/checkpoints")
JOINING_SAMPLER_THREADS = 8
"""Worker threads of a sampling client on an engine that lets calls join its running batch
(more batches in flight at once than this wait for a thread)."""


def check_device(device: str, *, named: str, instead: str) -> None:
    """Fail on a CUDA device this machine lacks; the error starts with `named` (how the caller
    set it) and ends with `instead` (what to pass)."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{named}, but this machine has no CUDA device (or torch was built without CUDA); "
            f"{instead}"
        )


class ServiceClient:
    """Creates training and sampling clients on this machine.

    `base_model` is a HF model directory, or a named size with random weights and a built-in
    vocabulary (named_models.py): "tiny" (digits), "tiny:letters", "0.6B:words",
    "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-8B", "llama/tiny:letters", ...
    """

    def __init__(
        self,
        *,
        storage_dir: str | Path = DEFAULT_STORAGE,
        device: str = "cpu",
        dtype: PrecisionName = "float32",
        trainer: TrainerEngine.Config | None = None,
        sampler: SamplerEngine.Config | None = None,
        generator: GeneratorChoice.Config | None = None,
        multi_lora: MultiLoraSampler.Config | None = None,
        remote: RemoteGenerators | None = None,
        sleep_generator: bool = False,
    ) -> None:
        """`multi_lora`: the shared sampler of LoRA clients on one base (Temper's engine or
        vLLM, as `generator` chooses); None: its defaults. `remote`: the generator ranks of a
        disaggregated placement (generator/remote.py), where the training client's snapshots
        sample; None: generators in this process. `sleep_generator`: each training client's
        generator releases its KV cache while the trainer runs forward_backward. `dtype`: the
        precision (trainer/precision.py): 'float32', 'bfloat16' (pure), 'bf16-mixed' (fp32
        weights, bf16 matmuls, a bf16 generator) or 'auto' (bf16-mixed on CUDA, else
        float32)."""
        check_device(device, named=f"device={device!r}", instead="use device='cpu'")
        self.storage = CheckpointStorage(storage_dir)
        self.device = device
        self.precision = Precision.resolve(dtype, device=device)
        self.dtype = self.precision.parameters
        """The dtype training clients keep their trained weights in (a LoRA base: in
        `generator_dtype`)."""
        self.generator_dtype = self.precision.compute
        """The dtype sampling clients decode in (the trainer's compute dtype)."""
        self.trainer_config = trainer or TrainerEngine.Config()
        self.sampler_config = sampler or SamplerEngine.Config()
        self.generator_choice = GeneratorChoice(generator or GeneratorChoice.Config())
        self.multi_lora_config = multi_lora or MultiLoraSampler.Config()
        self.remote = remote
        self.sleep_generator = sleep_generator
        # LoRA training clients on one base model share its frozen weights (shared_base.py).
        self.shared_bases = SharedBases()

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
    ) -> TrainingClient:
        """`run_id` names the run (and its `tinker://<run_id>/...` paths); default: random.
        With a sharded trainer every rank gets rank 0's id."""
        lora = lora_config(
            rank=rank,
            seed=seed,
            train_mlp=train_mlp,
            train_attn=train_attn,
            train_unembed=train_unembed,
        )
        return self._new_training_client(
            base_model, lora=lora, user_metadata=user_metadata, run_id=run_id
        )

    def create_training_client(
        self,
        base_model: str,
        user_metadata: Mapping[str, str] | None = None,
        *,
        run_id: str | None = None,
    ) -> TrainingClient:
        """Full fine-tuning (every parameter trains); an addition to Tinker's API."""
        return self._new_training_client(
            base_model, lora=None, user_metadata=user_metadata, run_id=run_id
        )

    def create_training_client_from_state(
        self, path: str, *, run_id: str | None = None
    ) -> TrainingClient:
        """A new training client with the weights of a `save_state` checkpoint (fresh optimizer)."""
        return self._from_state(path, with_optimizer=False, run_id=run_id)

    def create_training_client_from_state_with_optimizer(
        self, path: str, *, run_id: str | None = None
    ) -> TrainingClient:
        return self._from_state(path, with_optimizer=True, run_id=run_id)

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> SamplingClient:
        """Sample from sampler weights (`tinker://.../sampler_weights/...`) or a base model."""
        if (model_path is None) == (base_model is None):
            raise ValueError("create_sampling_client takes exactly one of model_path, base_model")
        if model_path is not None:
            weights = load_sampler_weights(
                self.storage, model_path, device=self.device, dtype=self.generator_dtype
            )
        else:
            source = resolve_base_model(base_model, device=self.device, dtype=self.generator_dtype)
            base = source.build()
            weights = SamplerWeights(model=base.model, tokenizer=base.tokenizer, name=base_model)
        generator = self.new_generator(model=weights.model, tokenizer=weights.tokenizer)
        return SamplingClient(
            snapshot=Snapshot(generator=generator, version=generator.version),
            # Several threads: a batch sent while another decodes joins it in Temper's
            # engine (sampler/decode_loop.py) instead of waiting for it (a server's shared
            # sampler serves many users through this one client).
            worker=Worker("temper-sampler", max_workers=_sampler_threads(generator)),
            tokenizer=weights.tokenizer,
        )

    def create_scoring_client(self, model_path: str) -> SamplingClient:
        """A client on sampler weights for `compute_logprobs` (a KL reference). With generator
        ranks (`remote`) the weights load there, as a model that only scores, and this rank
        holds none of them (collective over the trainer ranks); else as
        `create_sampling_client`."""
        if self.remote is None:
            return self.create_sampling_client(model_path=model_path)
        parsed, directory = self.storage.existing(model_path)
        if parsed.kind != "sampler_weights":
            raise ValueError(
                f"{model_path} is a training-state checkpoint; a scoring client loads "
                f"tinker://{parsed.run_id}/sampler_weights/<name> (from save_weights_for_sampler)"
            )
        reference = self.remote.load_reference(
            str(directory.resolve()),
            dtype=parse_dtype(self.generator_dtype),
            vocab_size=sampler_vocab_size(directory),
        )
        return SamplingClient(
            snapshot=Snapshot(generator=reference, version=reference.version),
            worker=Worker("temper-reference"),
            tokenizer=load_tokenizer(directory),
        )

    def new_generator(self, *, model: torch.nn.Module, tokenizer: Tokenizer) -> Generator:
        """A generator of the chosen backend (`generator`) on `model`'s weights; Temper's
        engine is set up by `sampler`."""
        return self.generator_choice.generator(
            engine=self.sampler_config, model=model, tokenizer=tokenizer
        )

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> TrainingClient:
        return self.create_lora_training_client(*args, **kwargs)

    async def create_sampling_client_async(self, *args: Any, **kwargs: Any) -> SamplingClient:
        return self.create_sampling_client(*args, **kwargs)

    def _new_training_client(
        self,
        base_model: str,
        *,
        lora: LoraConfig | None,
        user_metadata: Mapping[str, str] | None,
        run_id: str | None = None,
    ) -> TrainingClient:
        dtype = self.precision.base(lora=lora is not None)
        source = resolve_base_model(base_model, device=self.device, dtype=dtype)
        base_model = recorded_base_model(base_model)
        shared, weights = None, None
        if self.trainer_config.sharding is not None:
            # Sharded loading: the model is built on the meta device, sharded, and each rank
            # then reads (or draws) only its own shards; no rank holds the whole model.
            base = dataclasses.replace(source, weights="deferred").build()
            model, tokenizer, weights = base.model, base.tokenizer, base.deferred_weights
        elif lora is not None:
            # Adapters only train: the base weights are read, never written, so one copy
            # serves every LoRA client.
            shared = self.shared_bases.get(source)
            model, tokenizer = shared.model(), shared.tokenizer
        else:
            base = source.build()
            model, tokenizer = base.model, base.tokenizer
        engine = self.trainer_config.build(
            model=model,
            lora=lora,
            weights=weights,
            compute_dtype=parse_dtype(self.precision.compute) if self.precision.mixed else None,
        )
        run_id = check_name(run_id or f"run-{uuid.uuid4().hex[:12]}", field="run id")
        info = {
            "base_model": base_model,
            "lora": None if lora is None else dataclasses.asdict(lora),
            "user_metadata": dict(user_metadata or {}),
        }
        if engine.sharding is None:
            self._claim_run(run_id, info)
        else:
            # The ranks write one run's checkpoints together, so they need one run id: rank 0's
            # (it writes run.json; the others wait until it is there).
            def write_run() -> str:
                self._claim_run(run_id, info)
                return run_id

            run_id = Ranks.of_trainer().on_writer(write_run)
        return TrainingClient(
            service=self,
            run_id=run_id,
            base_model=base_model,
            engine=engine,
            tokenizer=tokenizer,
            shared_base=shared,
            adapter_sampler=None if shared is None else self._adapter_sampler(shared),
            remote=self.remote,
            sleep_generator=self.sleep_generator,
        )

    def _adapter_sampler(self, shared: SharedBase) -> AdapterSampler | None:
        """The multi-LoRA sampler of `shared` (of the chosen backend), or None where LoRA
        snapshots sample merged weights (`multi_lora.enabled` off)."""
        if not self.multi_lora_config.enabled:
            return None
        return shared.sampler(
            lambda model: self.generator_choice.adapter_sampler(
                self.multi_lora_config,
                engine=self.sampler_config,
                model=model,
                tokenizer=shared.tokenizer,
            )
        )

    def _claim_run(self, run_id: str, info: dict[str, Any]) -> None:
        """Write the run's run.json; an existing run of another base model or LoRA config is
        refused, since its checkpoints would then be read as this client's."""
        try:
            existing = self.storage.read_run(run_id)
        except FileNotFoundError:
            existing = None
        if existing is not None and (
            recorded_base_model(existing["base_model"]) != info["base_model"]
            or existing["lora"] != info["lora"]
        ):
            raise ValueError(
                f"run_id {run_id!r} exists already with base model {existing['base_model']!r} "
                f"and {training_kind(existing['lora'])}, but this client trains "
                f"{info['base_model']!r} with {training_kind(info['lora'])}; choose another run_id"
            )
        self.storage.write_run(run_id, info)

    def _from_state(
        self, path: str, *, with_optimizer: bool, run_id: str | None = None
    ) -> TrainingClient:
        parsed, _ = self.storage.existing(path)
        if parsed.kind != "weights":
            raise ValueError(
                f"{path} is a {parsed.kind} checkpoint; training state is under weights/"
            )
        run = self.storage.read_run(parsed.run_id)
        lora = None if run["lora"] is None else LoraConfig(**run["lora"])
        client = self._new_training_client(
            run["base_model"], lora=lora, user_metadata=run.get("user_metadata"), run_id=run_id
        )
        load = client.load_state_with_optimizer if with_optimizer else client.load_state
        load(path).result()
        return client


def lora_config(
    *, rank: int, seed: int | None, train_mlp: bool, train_attn: bool, train_unembed: bool
) -> LoraConfig:
    """The LoRA config of Tinker's create_lora_training_client arguments (seed None: 0)."""
    return LoraConfig(
        rank=rank,
        seed=0 if seed is None else seed,
        train_mlp=train_mlp,
        train_attn=train_attn,
        train_unembed=train_unembed,
    )


def _sampler_threads(generator: Generator) -> int:
    """Threads for a sampling client that owns `generator`: several where calls join the
    engine's running batch (Temper's engine), one elsewhere (vLLM takes one call at a time)."""
    return JOINING_SAMPLER_THREADS if getattr(generator, "joins_running_batch", False) else 1
