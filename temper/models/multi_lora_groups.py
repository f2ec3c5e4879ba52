"""The rows of a mixed-adapter batch grouped by adapter slot, for batched low-rank matmuls.

Shapes: B rows, M positions per row, I/O a linear's in/out features, K slots in the slot
tables, R their rank, U slots used by the batch, N rows per group.

`RowGroups.of(slots_B)` works out once per forward (on the host, from the rows' slots as
ints: no device op, no host sync) where each row goes in a [U, N] layout: group u holds the
rows of the u-th used slot (ascending), padded to the most rows any used slot has. Every
adapted linear of that forward then runs its low-rank term as two batched matmuls over the
groups (`low_rank`), each group with its own slot's factors: the cost grows with the rows and
the used slots' ranks, not with the slots loaded, and it is a fixed handful of ops per linear
whatever the number of adapters (a gather of the rows into the groups, two `bmm`s, a gather
back; the gathers are skipped when the rows already lie in that layout, and the factors are
read in place when every slot is used).

A padding place of a group holds a copy of some row: its results are computed and never
read. Each output row of a matmul depends only on its own input row, so what fills the
padding does not change any row's result.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowGroups:
    """Where each row of a mixed-adapter batch goes in the grouped [U, N] layout."""

    slots: tuple[int, ...]
    """The used slots, ascending (group u holds slot slots[u]'s rows)."""
    slots_U: torch.Tensor
    """`slots` on the device (to gather the factors when not every slot is used)."""
    width: int
    """N: rows per group (the most rows of one used slot)."""
    rank: int
    """The largest rank of the used slots (the factors are cut to it)."""
    gather_X: torch.Tensor | None
    """[U * N]: the row each place of the layout takes (padding: row 0); None when the rows
    already lie in the layout (sorted by slot, as many rows of each)."""
    scatter_B: torch.Tensor | None
    """[B]: each row's place in the layout (None with `gather_X`)."""

    @staticmethod
    def of(slots_B: Sequence[int], *, ranks: dict[int, int], device: torch.device) -> RowGroups:
        """The groups of rows whose slots are `slots_B`; `ranks`: each loaded slot's rank."""
        counts = Counter(slots_B)
        slots = tuple(sorted(counts))
        width = max(counts.values())
        group = {slot: place for place, slot in enumerate(slots)}
        taken = dict.fromkeys(slots, 0)
        places_B = []
        for slot in slots_B:
            places_B.append(group[slot] * width + taken[slot])
            taken[slot] += 1
        gather_X = scatter_B = None
        if places_B != list(range(len(slots) * width)):
            rows_X = [0] * (len(slots) * width)
            for row, place in enumerate(places_B):
                rows_X[place] = row
            gather_X = torch.tensor(rows_X, device=device)
            scatter_B = torch.tensor(places_B, device=device)
        return RowGroups(
            slots=slots,
            slots_U=torch.tensor(slots, device=device),
            width=width,
            rank=max(ranks.get(slot, 0) for slot in slots),
            gather_X=gather_X,
            scatter_B=scatter_B,
        )

    def low_rank(
        self, x_BMI: torch.Tensor, lora_A_KIR: torch.Tensor, lora_B_KRO: torch.Tensor
    ) -> torch.Tensor:
        """Row b's (x_b @ A_k.T) @ B'_k.T for its slot k: [B, M, O] (the factors stored
        transposed, as `_Slots` keeps them: A.T [K, I, R], B'.T [K, R, O])."""
        num_rows, positions, in_features = x_BMI.shape
        num_used, width, rank = len(self.slots), self.width, self.rank
        x_BF = x_BMI.reshape(num_rows, positions * in_features)
        grouped_XF = x_BF if self.gather_X is None else x_BF.index_select(0, self.gather_X)
        grouped_UYI = grouped_XF.view(num_used, width * positions, in_features)
        if num_used == lora_A_KIR.shape[0]:  # every slot used (ascending): read in place
            lora_A_UIR, lora_B_URO = lora_A_KIR[..., :rank], lora_B_KRO[:, :rank]
        else:
            lora_A_UIR = lora_A_KIR[..., :rank].index_select(0, self.slots_U)
            lora_B_URO = lora_B_KRO[:, :rank].index_select(0, self.slots_U)
        low_UYR = torch.bmm(grouped_UYI, lora_A_UIR)
        out_UYO = torch.bmm(low_UYR, lora_B_URO)
        out_XF = out_UYO.view(num_used * width, -1)
        if self.scatter_B is not None:
            out_XF = out_XF.index_select(0, self.scatter_B)
        return out_XF.view(num_rows, positions, -1)
