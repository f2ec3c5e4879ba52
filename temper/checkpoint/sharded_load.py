"""Sharded loading: fill a model that was built and sharded (FSDP2/TP) on the meta device, so
that no rank ever holds the whole model.

Shapes: R LoRA rank, I a linear's input features, E experts.

`DeferredWeights.materialize` gives the parallelized model storage for this rank's shards only
(`to_empty`) and fills them in place:
- From a HF model directory: each parameter's local box (temper/distributed/local_shard.py) is
  read straight from its safetensors file with `get_slice`, after the same name mapping and
  checks as `load_pretrained` (`locate_weights`). The adapters map tensors one to one (or,
  for stacked experts, one expert's row to one HF tensor), with no value transformation, so
  every box can be sliced from the file; a family whose adapter transformed values (fused or
  permuted tensors) would have to read such a tensor whole and slice it here, one tensor at a
  time.
- A random init (a named size): every module's own parameters are drawn whole, one module at a
  time, on an unsharded meta-device twin of the model, in `modules()` order from one generator
  seeded as `materialize` seeds it, and only this rank's box is kept. The values are bitwise
  those of `materialize(..., init="random")`; the price is one module's whole parameters in
  flight (the largest is the embedding), never the whole model.
- LoRA adapters: each A is drawn whole as `apply_lora` draws it (`initial_lora_A`) and sliced;
  B is zero.

It does not care how the mesh was made: it reads the placements of the parameters it is given.
It does not read on one rank and broadcast: every rank reads its own slices, so every rank
must see the model directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from temper.checkpoint.hf import locate_weights
from temper.distributed.local_shard import copy_local_part, local_box, local_part
from temper.models.build import materialize
from temper.models.lora import LORA_SUFFIXES, LoraConfig, initial_lora_A


@dataclass(frozen=True, kw_only=True)
class DeferredWeights:
    """Where the weights of a meta-device model come from, to be filled in after sharding."""

    device: torch.device
    """Where the model's shards live."""
    model_dir: Path | None = None
    """HF model directory to read; None: the random init of `seed`."""
    seed: int = 0
    """Seed of the random init (as `materialize` takes it)."""

    def materialize(self, model: nn.Module, *, lora: LoraConfig | None) -> None:
        """Give the (parallelized) meta-device `model` storage for this rank's shards on
        `device` and fill them: base weights, then the adapters of `lora` (applied already)."""
        assert not list(model.buffers()), "sharded loading fills parameters only"
        assert all(local_part(p).is_meta for p in model.parameters()), "a meta-device model"
        model.to_empty(device=self.device)
        if self.model_dir is None:
            init_local_shards(model, seed=self.seed, device=self.device)
        else:
            load_local_shards(model, model_dir=self.model_dir)
        if lora is not None:
            init_lora_shards(model, lora=lora)


def _base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {
        name: parameter
        for name, parameter in model.named_parameters()
        if not name.endswith(LORA_SUFFIXES)
    }


@torch.no_grad()
def load_local_shards(model: nn.Module, *, model_dir: Path) -> None:
    """Read each base parameter's local box from the HF checkpoint into its local shard."""
    parameters = _base_parameters(model)
    shapes = {name: tuple(parameter.shape) for name, parameter in parameters.items()}
    for path, slots in locate_weights(model_dir, model=model, shapes=shapes).items():
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for hf_key, slot in slots.items():
                local = local_part(parameters[slot.key])
                box = local_box(parameters[slot.key])
                if slot.expert is not None:
                    # One expert's row of a stacked tensor: this rank holds it if its box's
                    # first (expert) range covers it.
                    rows = box[0]
                    if not rows.start <= slot.expert < rows.stop:
                        continue
                    local, box = local[slot.expert - rows.start], box[1:]
                if local.numel() > 0:  # an uneven split can leave a rank an empty shard
                    local.copy_(handle.get_slice(hf_key)[box])


@torch.no_grad()
def init_local_shards(model: nn.Module, *, seed: int, device: torch.device) -> None:
    """The random init of `materialize(model.config, seed=seed)`, kept shard by shard."""
    parameters = _base_parameters(model)
    dtype = next(iter(parameters.values())).dtype
    # The unsharded layout that `materialize` initializes, without storage.
    twin = materialize(model.config, device="meta", dtype=dtype, init="empty")
    generator = torch.Generator(device=device).manual_seed(seed)
    for module_name, module in twin.named_modules():
        module.to_empty(device=device, recurse=False)
        twin.init_module(module, generator=generator)
        for name, whole in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}" if module_name else name
            copy_local_part(parameters[key], whole)
        module.to_empty(device="meta", recurse=False)  # frees the whole tensors


@torch.no_grad()
def init_lora_shards(model: nn.Module, *, lora: LoraConfig) -> None:
    """The initial adapters of `apply_lora(model, lora)`, kept shard by shard."""
    parameters = dict(model.named_parameters())
    for name, whole in initial_lora_A(model, lora):  # [R, I], or [E, R, I] for experts
        lora_A = parameters[f"{name}.lora_A"]
        copy_local_part(lora_A, whole.to(lora_A.dtype))
        local_part(parameters[f"{name}.lora_B"]).zero_()
