"""GeneratorChoice: which generator backend sampling clients, jobs and the server get.

'temper' is Temper's KV-cache engine (temper/sampler/engine.py), set up by its own
`SamplerEngine.Config` (the `sampler` field of job and server configs); 'vllm' is vLLM
(vllm.py, extra `vllm`), set up by `GeneratorChoice.Config.vllm`. Both stand behind the
`Generator` seam (seam.py), and both serve many LoRA adapters on one base
(`adapter_sampler`: multi_lora.py, vllm_lora.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace
from typing import Literal

from torch import nn

from temper.config.checks import check_choice
from temper.config.configurable import Configurable
from temper.generator.multi_lora import AdapterSampler, MultiLoraSampler
from temper.generator.seam import Generator
from temper.generator.vllm import VllmGenerator  # vLLM itself: when built
from temper.generator.vllm_lora import VllmMultiLora
from temper.generator.vllm_process import INSTALL_HINT
from temper.models.common.decoder import DecoderConfig
from temper.sampler.engine import SamplerEngine
from temper.tokenizer import Tokenizer

Backend = Literal["temper", "vllm"]


class GeneratorChoice(Configurable):
    """Which generator backend sampling clients get, and the vLLM backend's settings."""

    @dataclass(kw_only=True)
    class Config(Configurable.Config):
        backend: Backend = "temper"
        """'temper': Temper's KV-cache engine (its settings: the `sampler` config); 'vllm':
        vLLM (install with `make vllm`, README), set up by `vllm` below."""
        vllm: VllmGenerator.Config = field(default_factory=VllmGenerator.Config)
        """The vLLM engine's settings (backend 'vllm' only)."""

        def missing_packages(self) -> dict[str, str]:
            if self.backend == "vllm" and importlib.util.find_spec("vllm") is None:
                return {"backend": f"vLLM: {INSTALL_HINT}"}
            return {}

        def __post_init__(self) -> None:
            check_choice(
                self.backend, field="GeneratorChoice.Config.backend", choices=("temper", "vllm")
            )

        def check_model(self, model_config: DecoderConfig, *, dtype: str) -> None:
            """Refuse, from its config alone, a model the chosen backend cannot run here in
            `dtype` (the trainer's compute dtype, which generators decode in): jobs before
            they write their run directory, the server before it listens."""
            if self.backend == "vllm":
                self.vllm.check_model(model_config, model_dtype=dtype)

    def __init__(self, config: Config) -> None:
        self.config = config

    def generator(
        self, *, engine: SamplerEngine.Config, model: nn.Module, tokenizer: Tokenizer | None
    ) -> Generator:
        """A generator on `model`'s weights: Temper's engine (set up by `engine`) or vLLM, whose
        unset context and batch follow `engine`'s (so its KV reserve is the engine's)."""
        if self.config.backend == "vllm":
            vllm = self.vllm_config(engine=engine, model_max_seq_len=model.config.max_seq_len)
            if engine.record_routes:  # vLLM's routed experts feed Temper's routing replay
                vllm = replace(vllm, record_routes=True)
            return vllm.build(model=model, tokenizer=tokenizer)
        return within_model(engine, model).build(model=model, tokenizer=tokenizer)

    def adapter_sampler(
        self,
        multi_lora: MultiLoraSampler.Config,
        *,
        engine: SamplerEngine.Config,
        model: nn.Module,
        tokenizer: Tokenizer | None,
    ) -> AdapterSampler:
        """The sampler of many LoRA adapters on the base `model`: Temper's engine
        (`MultiLoraSampler`, set up by `engine`) or one vLLM engine (vllm_lora.py)."""
        if self.config.backend == "vllm":
            vllm = self.vllm_config(engine=engine, model_max_seq_len=model.config.max_seq_len)
            return VllmMultiLora(multi_lora, model=model, tokenizer=tokenizer, vllm=vllm)
        return multi_lora.build(
            model=model, tokenizer=tokenizer, engine=within_model(engine, model)
        )

    def vllm_config(
        self, *, engine: SamplerEngine.Config, model_max_seq_len: int
    ) -> VllmGenerator.Config:
        """The vLLM settings with those left unset taken from the sampler's (its context at
        most the model's)."""
        vllm = self.config.vllm
        return replace(
            vllm,
            max_model_len=vllm.max_model_len or min(engine.max_seq_len, model_max_seq_len),
            max_num_seqs=vllm.max_num_seqs or engine.max_batch,
        )


def within_model(engine: SamplerEngine.Config, model: nn.Module) -> SamplerEngine.Config:
    """`engine` with its context cut to `model`'s own: `max_seq_len` bounds every model a
    server or client samples, and one with a shorter context samples up to that (as vLLM's
    `max_model_len` is cut in `vllm_config`), rather than being refused."""
    return replace(engine, max_seq_len=min(engine.max_seq_len, model.config.max_seq_len))
