"""The checks of `RLJob.Config` that span its parts (placement, generator, mode, sampler),
run when the config is made (job.py)."""

from __future__ import annotations

import warnings
from typing import Any

from temper.config.checks import check_choice, check_range
from temper.generator import vllm_fields
from temper.rl.steps import check_support_backend


def check_job_config(config: Any) -> None:
    """`config` (an `RLJob.Config`): bad settings fail when the config is made, before any
    model is built (the steps' own are checked by `RLSteps.Config`)."""
    name = "RLJob.Config"
    for field_name, least in (("eval_problems", 1), ("max_staleness", 0), ("checkpoint_every", 0)):
        check_range(getattr(config, field_name), field=f"{name}.{field_name}", at_least=least)
    check_choice(config.mode, field=f"{name}.mode", choices=("sync", "async", "inflight"))
    if config.mode == "inflight" and config.placement.mode == "disaggregated":
        raise ValueError(
            f"{name}.mode='inflight' is not served on the generator ranks of "
            f"{name}.placement.mode='disaggregated'; use mode='async'"
        )
    if config.trainer.sharding is not None:
        raise ValueError(
            f"{name}.trainer.sharding is set by the loop on several ranks; configure it "
            f"through {name}.sharding (--sharding.* flags) and leave trainer.sharding:none"
        )
    max_context = config.episodes.max_context
    if max_context is not None and max_context > config.sampler.max_seq_len:
        raise ValueError(
            f"{name}.episodes.max_context ({max_context}) exceeds "
            f"{name}.sampler.max_seq_len ({config.sampler.max_seq_len}); an episode's context "
            "must fit the sampler's cache"
        )
    placement, generator = config.placement, config.generator
    check_support_backend(config.rl, backend=generator.backend, name=f"{name}.rl")
    if (
        config.rl.routing_replay != "off"
        and generator.backend != "temper"
        and not vllm_fields.can_return_routes()
    ):
        raise ValueError(
            f"{name}.rl.routing_replay={config.rl.routing_replay!r} needs the sampler's routes, "
            f"which this vLLM build cannot return ({vllm_fields.NO_MODEL_RUNNER_V2}); use "
            f"{name}.generator.backend='temper', whose engine records them"
        )
    if placement.generator_tp > 1 and generator.backend != "vllm":
        raise ValueError(
            f"{name}.placement.generator_tp={placement.generator_tp} needs "
            f"{name}.generator.backend='vllm' (Temper's engine has no tensor parallelism)"
        )
    if placement.mode == "disaggregated" and generator.vllm.tensor_parallel_size != 1:
        raise ValueError(
            f"{name}.generator.vllm.tensor_parallel_size is set by the placement on generator "
            f"ranks: use {name}.placement.generator_tp (--placement.generator_tp) instead"
        )
    if config.sleep_generator and config.mode != "sync":
        raise ValueError(
            f"{name}.sleep_generator needs mode='sync': in mode='async' sampling runs while "
            "the trainer steps"
        )
    if config.mode == "sync" and config.max_staleness != 1:
        warnings.warn(
            f"{name}.max_staleness={config.max_staleness} is ignored in mode='sync' "
            "(set mode='async')",
            stacklevel=3,
        )
