"""Which adapter slot each row of a forward uses, on a model with multi-LoRA slots.

A multi-LoRA model (models/multi_lora.py) reads the adapter slot of each row from its
`AdapterRows`, which the engine sets before every forward (prefill and decode): per row, or
one slot for all rows when every request of a generate call has the same adapter (plain
matmuls, no grouping). The engine and its admission share one `RowAdapters`.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from temper.models.multi_lora import AdapterRows
from temper.sampler.requests import SampleRequest


class RowAdapters:
    def __init__(self, model: nn.Module) -> None:
        self.rows: AdapterRows | None = getattr(model, "multi_lora_rows", None)
        """The model's adapter row slots; None for a model without multi-LoRA slots."""
        self.one: int | None = None
        """The adapter slot of every request of the current generate call, if they share one."""

    def start_call(self, requests: Sequence[SampleRequest]) -> None:
        """A generate call of `requests` begins."""
        adapters = {request.adapter for request in requests}
        self.one = adapters.pop() if len(adapters) == 1 else None
