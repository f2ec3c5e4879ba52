"""Which weights the sampler reads, and how new ones arrive (versioned weight sync).

In one process the sampler can read the trainer's module directly: when the dtype and device
match, `update` just points at it (no copy, no extra memory). A state dict, or a module in
another dtype, is copied into a private model the sampler owns; the trainer's module is never
written to.

Two counters: `version` is the policy version the caller names (a trainer's step; loading a
checkpoint can set it back), and `generation` counts `update` calls. Whatever is derived from
the weights (the CPU wing's fused or packed copies, helper processes) compares `generation`:
it changes on every update, in place or not. The contract is that whoever changes the
weights, even by writing the module's tensors in place, calls `update` before the next
sample.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from temper.distributed.weight_pieces import (
    PlacedStream,
    RowCoverage,
    WeightPiece,
    as_rows,
    rows_of,
)
from temper.models.build import materialize

WeightUpdate = nn.Module | Mapping[str, torch.Tensor] | Iterable[WeightPiece]
"""New weights for a generator's `update_weights`: a module, a state dict, or a stream of
(name, tensor) pairs and `WeightRows` (ranges of a tensor's rows) in Temper's parameter names
(a stream is checked as it passes: every tensor's rows exactly once)."""


class WeightSource:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.version = 0
        """Policy version of the weights (set by `update`)."""
        self.generation = 0
        """Number of `update` calls: changes whenever the weights may have."""
        self._owned = True  # the engine may write into `model` (it was handed over for sampling)
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device

    def update(self, source: WeightUpdate, *, version: int) -> None:
        try:
            self._update(source)
        finally:  # even a failed update may have written some tensors
            self.generation += 1
        self.version = version

    def _update(self, source: WeightUpdate) -> None:
        if isinstance(source, nn.Module):
            self._check_compatible(source)
            parameter = next(source.parameters())
            if (parameter.dtype, parameter.device) == (self.dtype, self.device):
                self.model, self._owned = source, False
            else:
                self._private_model().load_state_dict(source.state_dict())
        elif isinstance(source, Mapping):
            self._load_state_dict(source)
        elif isinstance(source, Iterable) and not isinstance(source, str | bytes):
            self._load_stream(source)
        else:
            raise TypeError(
                "update_weights takes an nn.Module, a state dict or (name, tensor) pairs, got "
                f"{type(source).__name__}"
            )

    def _private_model(self) -> nn.Module:
        if not self._owned:
            config = self.model.config
            self.model = materialize(config, device=self.device, dtype=self.dtype, init="empty")
            self._owned = True
        return self.model

    def _load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        target = self._private_model()
        expected = target.state_dict()
        missing = sorted(expected.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected.keys())
        if missing or unexpected:
            raise ValueError(
                f"update_weights: state dict does not match the model: missing {missing}, "
                f"unexpected {unexpected}"
            )
        for name, value in state_dict.items():
            if tuple(value.shape) != tuple(expected[name].shape):
                raise ValueError(
                    f"update_weights: tensor {name!r} has shape {tuple(value.shape)}, the model "
                    f"expects {tuple(expected[name].shape)}"
                )
        with torch.no_grad():
            for name, value in state_dict.items():
                expected[name].copy_(value)

    @torch.no_grad()
    def _load_stream(self, pieces: Iterable[WeightPiece]) -> None:
        """Copy each piece as it arrives (no whole dict); every parameter's rows must come
        exactly once."""
        state = self._private_model().state_dict()
        if isinstance(pieces, PlacedStream):
            pieces.into = rows_of(state)  # its pieces may arrive straight in the model
        coverage = RowCoverage(state)
        for piece in pieces:
            try:
                rows = as_rows(piece)
            except TypeError as error:
                message = "update_weights takes an nn.Module, a state dict or a stream of pieces"
                raise TypeError(f"{message}: {error}") from None
            target = coverage.check(rows)
            if not _same_memory(target, rows.value):  # (received in place: nothing to copy)
                target.copy_(rows.value)
            del piece, rows  # a streamed tensor may be a whole gathered one: not kept
        missing = coverage.missing()
        if missing:
            raise ValueError(f"update_weights: the stream ended without {missing}")

    def _check_compatible(self, source: nn.Module) -> None:
        ours, theirs = self.model.config, getattr(source, "config", None)
        if type(theirs) is not type(ours) or _shape(theirs) != _shape(ours):
            raise ValueError(
                f"update_weights: module {type(source).__name__} with config {theirs} does not "
                f"match the sampler's model config {ours}"
            )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )


def _shape(config) -> tuple:
    fields = ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    return tuple(getattr(config, name) for name in (*fields, "ffn_dim", "tie_embeddings"))
