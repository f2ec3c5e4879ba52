"""The process around vLLM engines: importing vLLM (its expected warnings dropped), the
engines running in this process, and CPU core binding for its tensor-parallel workers."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any

INSTALL_HINT = "install it with `make vllm` (or pip install -e '.[vllm]'; see README.md)"


class InlineEngines:
    """The vLLM engines running in this process. vLLM keeps one process-wide distributed
    state for all of them, and shutting one down (also when it is garbage collected) tears
    that state down under the others. So an engine closed while others run stays held here,
    and the last one to close shuts them all down."""

    def __init__(self) -> None:
        self.running: list[Any] = []
        self.closed: list[Any] = []
        self.moe: set[int] = set()  # ids of the running engines that serve a MoE model

    def check_can_start(self, *, moe: bool) -> None:
        """vLLM sets its process-wide state up for the first engine; for a dense model it has
        no expert-parallel group, which a MoE model's engine needs. Engines that were dropped
        but not yet collected are collected first."""
        if not moe or not self.running or self.moe:
            return
        gc.collect()  # finalizes dropped generators (weakref.finalize closes their engines)
        if self.running and not self.moe:
            raise ValueError(
                "VllmGenerator: a MoE model's vLLM engine cannot start in this process while "
                f"{len(self.running)} dense model engine(s) run here (vLLM keeps one "
                "distributed state per process, and a dense model's has no expert-parallel "
                "group); close them first, or set VllmGenerator.Config.engine_process="
                "'separate'"
            )

    def add(self, llm: Any, *, moe: bool) -> None:
        self.running.append(llm)
        if moe:
            self.moe.add(id(llm))

    def close(self, llm: Any) -> None:
        self.running = [other for other in self.running if other is not llm]
        self.moe.discard(id(llm))
        self.closed.append(llm)
        if not self.running:
            for engine in self.closed:
                engine.llm_engine.engine_core.shutdown()
            self.closed.clear()


def shut_down(llm: Any, *, inline_engines: InlineEngines | None) -> None:
    if inline_engines is not None:
        inline_engines.close(llm)
    else:
        llm.llm_engine.engine_core.shutdown()


def import_vllm() -> Any:
    # vLLM logs every weight reload at INFO; VLLM_LOGGING_LEVEL=INFO brings that back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        import vllm.inputs
    except ImportError as error:
        raise ImportError(f"generator backend 'vllm' needs vLLM: {INSTALL_HINT}") from error
    for name, expected in _EXPECTED_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(expected))
    return vllm


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is its CPU build."""
    import_vllm()
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


# Warnings vLLM gives for what Temper does on purpose: a built-in vocabulary has no chat
# template to warm up, and a tied output layer has no weight of its own to reload (it is
# rebuilt by the transfer engine: vllm_transfer.py).
_EXPECTED_WARNINGS = {
    "vllm.renderers.base": "Chat template warmup failed",
    "vllm.model_executor.model_loader.reload.layerwise": "ParallelLMHead: Failed to load",
}


class _DropMessage(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


def bind_cpu_workers(num_workers: int) -> None:
    """Give each of vLLM's CPU workers its own block of this process's cores (see
    generator/vllm.py's docstring), unless the user bound them."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    if len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) >= num_workers:
        return  # vLLM binds a worker per NUMA node
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_workers:
        raise ValueError(
            f"VllmGenerator.Config.tensor_parallel_size={num_workers} needs a CPU core per "
            f"worker; this process may use {len(cores)}"
        )
    size = len(cores) // num_workers
    blocks = [cores[index * size : (index + 1) * size] for index in range(num_workers)]
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
        ",".join(str(core) for core in block) for block in blocks
    )
