"""Where a linear-attention layer's recurrent state comes from and goes to: `RecurrentStates`.

Shapes: B batch rows, C conv channels (in_proj_qkv's output: q, k, v), W = conv kernel - 1,
N value heads, K key head dim, V value head dim.

The model never holds state. A sampler passes one backend object as the `attention=` argument
of `hidden_states(...)`; for a hybrid model that object implements `AttentionBackend.attend`
(full-attention layers, attention.py) and this protocol (linear-attention layers). With no
backend (training, scoring) every linear-attention layer runs its full-sequence (chunked) form
from a zero state.

Layer semantics with a backend: one token (T == 1) and a read state -> the recurrent step;
otherwise the chunked form starting from the read state (zeros when None). Positions past
`lengths_B[b]` (right padding) leave the state unchanged, so the states written are those at
each row's last real token; the conv state is the last W real conv inputs of each row (the
read conv state counts as the inputs before the row's first token).
"""

from __future__ import annotations

from typing import Protocol

import torch


class RecurrentStates(Protocol):
    @property
    def lengths_B(self) -> torch.Tensor | None:
        """Real tokens of each row of this forward (right padding follows them); None: all
        real."""
        ...

    def read_states(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(conv_BCW, state_BNKV) the rows continue from, or None: a fresh start (zeros).

        conv_BCW is in the model's dtype, state_BNKV in float32."""
        ...

    def write_states(
        self, layer_index: int, *, conv_BCW: torch.Tensor, state_BNKV: torch.Tensor
    ) -> None:
        """The states after each row's last real token (conv_BCW in the model's dtype,
        state_BNKV float32)."""
        ...
