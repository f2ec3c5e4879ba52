"""A plain in-test backend for hybrid models: recurrent states in a dict, keys and values in
per-row lists. It is the smallest object that implements both `AttentionBackend.attend` and
`RecurrentStates` (temper/models/common/recurrent.py), to check a model's prefill and
step-by-step decode against its full forward without the sampler."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DictStates:
    def __init__(self) -> None:
        self.lengths_B: torch.Tensor | None = None
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.keys_values: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def read_states(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.states.get(layer_index)

    def write_states(
        self, layer_index: int, *, conv_BCW: torch.Tensor, state_BNKV: torch.Tensor
    ) -> None:
        assert state_BNKV.dtype == torch.float32
        self.states[layer_index] = (conv_BCW, state_BNKV)

    def attend(
        self, layer_index: int, q_BNTH: torch.Tensor, k_BKTH: torch.Tensor, v_BKTH: torch.Tensor
    ) -> torch.Tensor:
        """Each row's queries over its cached keys and this forward's real ones (causal)."""
        B, _, T, H = q_BNTH.shape
        outs = []
        for b in range(B):
            real = T if self.lengths_B is None else int(self.lengths_B[b])
            empty = k_BKTH[b : b + 1, :, :0]
            k_prev, v_prev = self.keys_values.get((layer_index, b), (empty, empty))
            k_all = torch.cat((k_prev, k_BKTH[b : b + 1, :, :real]), dim=2)
            v_all = torch.cat((v_prev, v_BKTH[b : b + 1, :, :real]), dim=2)
            self.keys_values[(layer_index, b)] = (k_all, v_all)
            cached = k_prev.shape[2]
            # Query t sees the cache and this forward's keys 0..t (padding queries see them all).
            visible_TC = torch.arange(k_all.shape[2]) <= cached + torch.arange(T)[:, None]
            outs.append(
                F.scaled_dot_product_attention(
                    q_BNTH[b : b + 1],
                    k_all,
                    v_all,
                    attn_mask=visible_TC,
                    scale=H**-0.5,
                    enable_gqa=q_BNTH.shape[1] != k_all.shape[1],
                )
            )
        return torch.cat(outs)


def right_padded(rows: list[list[int]], *, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens_BT right-padded with `pad`, lengths_B)."""
    width = max(len(row) for row in rows)
    tokens_BT = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    return tokens_BT, torch.tensor([len(row) for row in rows])
