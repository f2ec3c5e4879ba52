"""Which adapter slot each row of a forward uses, on a model with multi-LoRA slots.

A multi-LoRA model (models/multi_lora.py) reads the adapter slot of each row from its
`AdapterRows`, which the engine sets before every forward (prefill and decode): per row, or
one slot for all rows when the forward's rows share one adapter (plain matmuls, no
grouping). The engine, its admission and its chunked prefill share one `RowAdapters`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from temper.models.multi_lora import AdapterRows


class RowAdapters:
    def __init__(self, model: nn.Module) -> None:
        self.rows: AdapterRows | None = getattr(model, "multi_lora_rows", None)
        """The model's adapter row slots; None for a model without multi-LoRA slots."""
        self._device = next(model.parameters()).device

    def use(self, adapters: Sequence[int]) -> None:
        """The next forwards' rows use these adapter slots, one per row (nothing on a model
        without slots)."""
        if self.rows is None:
            return
        first = adapters[0]
        if all(adapter == first for adapter in adapters):
            self.rows.set(first)
        else:
            self.rows.set(adapters, device=self._device)
