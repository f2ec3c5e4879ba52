"""Tinker's `target_prompt_logprobs`: token ids to score at chosen prompt positions, and the
logprobs that answer them.

Shapes: P prompt tokens, R = P - 1 rows, K cells per row, N listed cells.

The request is Tinker's [P - 1, K] int64 layout: cell [i, j] names a token id to score at
prompt position i + 1, log p(id | prompt[:i + 1]) (position 0 has no context), and -1 names
nothing. It is kept as its listed cells in CSR form (row pointers, column of each cell, id of
each cell), the way the wire's sparse form sends it, so a wide sparse request is never
densified; the answer has the same shape and the same cells, 0.0 where the id is -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

PLACEHOLDER = -1
"""A cell naming no token id (Tinker's pad value)."""
_NOT_INT = "target_prompt_logprobs must hold int64 token ids, got {}"


@dataclass(frozen=True, kw_only=True)
class PromptTargets:
    """Token ids to score at prompt positions, as the listed cells of a [P - 1, K] table.

    Build one with `from_ids` (a dense table with -1 in the cells naming nothing, or a tinker
    SDK `TensorData` in sparse CSR form); `check` tests it against a prompt and a vocabulary."""

    shape: tuple[int, int]
    """[len(prompt) - 1, K]."""
    crow_indices: tuple[int, ...]
    """R + 1 row pointers: the cells of row i are crow_indices[i]:crow_indices[i + 1]."""
    col_indices: tuple[int, ...]
    """The column of each listed cell (N)."""
    token_ids: tuple[int, ...]
    """The token id of each listed cell (N); -1 names nothing."""

    def __post_init__(self) -> None:
        shape, crow, cols = self.shape, self.crow_indices, self.col_indices
        if len(shape) != 2 or min(shape) < 0:
            raise ValueError(
                f"target_prompt_logprobs must be 2-D, [len(prompt) - 1, K], got shape {list(shape)}"
            )
        consistent = (
            len(crow) == shape[0] + 1
            and crow[0] == 0
            and crow[-1] == len(cols) == len(self.token_ids)
            and all(a <= b for a, b in pairwise(crow))
            and all(0 <= col < shape[1] for col in cols)
        )
        if not consistent:
            raise ValueError(
                f"target_prompt_logprobs: inconsistent sparse CSR indices for shape {list(shape)}"
            )

    @classmethod
    def from_ids(cls, ids_RK: object) -> PromptTargets:
        """From a [len(prompt) - 1, K] int table (torch tensor, `TensorData`, numpy array or
        nested list; cells holding -1 are left out), or a tinker SDK `TensorData` in sparse
        CSR form (`TensorData.from_torch_sparse(ids, pad_value=-1)`; its cells are kept)."""
        crow = getattr(ids_RK, "sparse_crow_indices", None)
        if crow is not None:
            if str(ids_RK.dtype) != "int64":
                raise TypeError(_NOT_INT.format(ids_RK.dtype))
            return cls(
                shape=tuple(ids_RK.shape),
                crow_indices=tuple(crow),
                col_indices=tuple(ids_RK.sparse_col_indices),
                token_ids=tuple(int(token) for token in ids_RK.data),
            )
        table = _int_table(ids_RK)
        listed_RK = table != PLACEHOLDER
        rows, cols = listed_RK.nonzero(as_tuple=True)
        crow = torch.zeros(table.shape[0] + 1, dtype=torch.int64)
        crow[1:] = listed_RK.sum(dim=1).cumsum(dim=0)
        return cls(
            shape=(table.shape[0], table.shape[1]),
            crow_indices=tuple(crow.tolist()),
            col_indices=tuple(cols.tolist()),
            token_ids=tuple(table[rows, cols].tolist()),
        )

    def check(self, *, prompt_length: int, vocab_size: int) -> None:
        """Raise ValueError unless these targets suit a prompt of `prompt_length` tokens.

        The width K is bounded like a top-k width (topk_prompt_logprobs <= vocab_size), so
        the cost, len(prompt) x distinct ids, and the answer's cells never exceed those of
        the widest top-k request."""
        rows, width = self.shape
        if rows != prompt_length - 1:
            raise ValueError(
                f"target_prompt_logprobs must have len(prompt) - 1 = {prompt_length - 1} rows "
                f"(row i scores prompt position i + 1), got {rows}"
            )
        if width > vocab_size:
            raise ValueError(
                f"target_prompt_logprobs names up to {width} ids per position; at most "
                f"vocab_size = {vocab_size}, the bound on topk_prompt_logprobs (cost "
                f"len(prompt) x ids <= {prompt_length} x {vocab_size})"
            )
        bad = next((t for t in self.token_ids if not PLACEHOLDER <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"target_prompt_logprobs: token id {bad} is outside the vocabulary; valid ids "
                f"are 0..{vocab_size - 1}, or -1 for a cell naming nothing"
            )
        if all(token == PLACEHOLDER for token in self.token_ids):
            raise ValueError("target_prompt_logprobs names no token id; name at least one")

    def rows_N(self) -> torch.Tensor:
        """The row of each listed cell (row i scores prompt position i + 1)."""
        return _rows_N(self.crow_indices)

    def to_torch(self) -> torch.Tensor:
        """The dense [len(prompt) - 1, K] int64 table, -1 in the cells not listed."""
        table_RK = torch.full(self.shape, PLACEHOLDER, dtype=torch.int64)
        table_RK[self.rows_N(), torch.tensor(self.col_indices, dtype=torch.int64)] = torch.tensor(
            self.token_ids, dtype=torch.int64
        )
        return table_RK


@dataclass(frozen=True, kw_only=True)
class PromptTargetLogprobs:
    """The answer to `PromptTargets`: the same shape and cells, each cell's logprob (0.0
    where it named no id)."""

    shape: tuple[int, int]
    crow_indices: tuple[int, ...]
    col_indices: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The logprob of each listed cell (N), in the order of `PromptTargets.token_ids`."""

    def to_torch(self) -> torch.Tensor:
        """The dense [len(prompt) - 1, K] float32 table, 0.0 in the cells not listed."""
        table_RK = torch.zeros(self.shape, dtype=torch.float32)
        cols_N = torch.tensor(self.col_indices, dtype=torch.int64)
        table_RK[_rows_N(self.crow_indices), cols_N] = torch.tensor(self.logprobs)
        return table_RK

    def tolist(self) -> list[list[float]]:
        return self.to_torch().tolist()


def _int_table(ids_RK: object) -> torch.Tensor:
    to_torch = getattr(ids_RK, "to_torch", None)  # temper's or the tinker SDK's TensorData
    if callable(to_torch):
        ids_RK = to_torch()
    elif not isinstance(ids_RK, torch.Tensor):
        if not isinstance(ids_RK, Sequence) and not hasattr(ids_RK, "__array__"):
            raise TypeError(
                "target_prompt_logprobs must be a [len(prompt) - 1, K] int64 table (a tensor, "
                f"TensorData or nested list), got {type(ids_RK).__name__}"
            )
        ids_RK = torch.as_tensor(ids_RK)
    if ids_RK.dtype.is_floating_point or ids_RK.dtype.is_complex or ids_RK.dtype == torch.bool:
        raise TypeError(_NOT_INT.format(str(ids_RK.dtype).removeprefix("torch.")))
    if ids_RK.ndim != 2:
        raise ValueError(
            "target_prompt_logprobs must be 2-D, [len(prompt) - 1, K], got shape "
            f"{list(ids_RK.shape)}"
        )
    return ids_RK.to(torch.int64)


def _rows_N(crow_indices: tuple[int, ...]) -> torch.Tensor:
    """The row of each listed cell, from CSR row pointers."""
    counts_R = torch.tensor(crow_indices, dtype=torch.int64).diff()
    return torch.arange(len(crow_indices) - 1).repeat_interleave(counts_R)
