"""A weight update of a running vLLM model: in place where vLLM keeps a weight as the
checkpoint has it, through vLLM's layerwise reload where it does not.

vLLM's layerwise reload (`initialize_layerwise_reload` / `finalize_layerwise_reload`) puts
every layer back into the checkpoint's layout on the meta device, materializes it once its
weights have all arrived, loads them, runs the layer's post-load processing and copies the
result into the kernel's tensors. That is what a layer whose processing changed its weights
needs (on CPU: a linear layer whose weight lives only in a packed oneDNN copy, a MoE layer
with prepacked experts, an attention layer's deferred step). For a layer whose live tensors
still have the checkpoint's shapes and dtypes and whose processing is re-runnable on them (no
quantization method, or vLLM's unquantized linear and embedding methods), it is a detour: a
fresh tensor, a copy into it, its processing, and a copy back. `InPlaceReload` loads such a
layer's weights with vLLM's own weight loaders straight into its live tensors, and at the end
runs the post-load processing of those that have one, except a plain input embedding's: on
CPU that step packs the weight for a matmul only the output layer runs (a tied output layer,
which shares the weight, is processed on its own). What that saves on the 0.6B shape on CPU is
the embedding's fresh copy and its unused packing (docs/benchmarks.md).

Also here: the experts' kernel step that vLLM's reload of a MoE layer skips
(`refresh_moe_experts`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def _in_place_methods() -> tuple[type, ...]:
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)


class InPlaceReload:
    """One weight update of `model` (a vLLM model in its worker): `start`, then `load` per
    bucket of (checkpoint name, tensor) pairs, then `finish`."""

    def __init__(self, model: torch.nn.Module, *, model_config: Any) -> None:
        self._model, self._model_config = model, model_config
        self._in_place: list[torch.nn.Module] = []

    def start(self) -> None:
        """Sort the layers; the others go into vLLM's layerwise reload."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._in_place = []
        layered = []
        for module in self._model.modules():
            (self._in_place if _loads_in_place(module) else layered).append(module)
        for module in layered:
            initialize_layerwise_reload(module)

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._model.load_weights(named)

    def finish(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self._model, self._model_config)
        for module in self._in_place:
            process_in_place(module)
        refresh_moe_experts(self._model)


def _loads_in_place(module: torch.nn.Module) -> bool:
    """Whether `module`'s live tensors are the checkpoint's (by the shapes and dtypes vLLM
    recorded before its first load) and its processing re-runs on them."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    method = getattr(module, "quant_method", None)
    if method is not None and type(method) not in _in_place_methods():
        return False
    if is_deferred_attention_layer(module):
        return False
    recorded_params, recorded_buffers = get_layerwise_info(module).restore_metadata
    for name, recorded in (recorded_params | recorded_buffers).items():
        live = getattr(module, name, None)
        if not isinstance(live, torch.Tensor):
            return False
        if live.shape != recorded.shape or live.dtype != recorded.dtype:
            return False
    return True


def process_in_place(module: torch.nn.Module) -> None:
    """Re-run the post-load processing of a layer loaded in place (on CPU: pack an output
    layer's weight again), skipping a plain input embedding's (see the module docstring)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    method = getattr(module, "quant_method", None)
    if method is None:
        return
    if isinstance(module, VocabParallelEmbedding) and not isinstance(module, ParallelLMHead):
        return
    method.process_weights_after_loading(module)


def refresh_moe_experts(model: torch.nn.Module) -> None:
    """Finish a reload of every MoE layer with its expert kernel's own post-processing.

    vLLM's reload runs a MoE layer's `process_weights_after_loading` again, which on a weight
    update copies the new weights in but skips the experts kernel's step that the first load
    ran: on CPU that step prepacks them into the grouped-GEMM layout, so without this the
    kernel reads unpacked weights. On backends whose step is empty this does nothing."""
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
