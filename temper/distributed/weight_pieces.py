"""Pieces of weights in a stream: a whole tensor, or a range of its rows.

A weight stream (a sampler's `update_weights`, a bucketed transfer) is a sequence of
`(name, tensor)` pairs, each a whole tensor, and `WeightRows`, rows `[start, start + len)`
along dimension 0 of one: a trainer rank's own FSDP shard, or a slice of a tensor larger
than a transfer bucket. Whoever loads a stream checks with `RowCoverage` that every tensor's
rows came exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WeightRows:
    """Rows `[start, start + value.shape[0])` (dimension 0) of the weight `name`."""

    name: str
    start: int
    value: torch.Tensor

    @property
    def stop(self) -> int:
        return self.start + num_rows(self.value)


WeightPiece = tuple[str, torch.Tensor] | WeightRows

Destination = Callable[[str, int, tuple[int, ...], torch.dtype], torch.Tensor | None]
"""Where a receiver may put a piece directly (name, first row, shape, dtype): a contiguous
tensor of that shape and dtype, or None (into the receiver's buffer)."""


class PlacedStream:
    """A weight stream that can put pieces straight where they belong: whoever loads it sets
    `into` (a `Destination` into its model) before drawing, and a piece that arrives there
    comes out as that very tensor (nothing left to copy). Without `into`, a plain stream."""

    def __init__(self, pieces: Callable[[Destination | None], Iterator[WeightPiece]]) -> None:
        self._pieces = pieces
        self.into: Destination | None = None

    def __iter__(self) -> Iterator[WeightPiece]:
        return self._pieces(self.into)


def rows_of(state: Mapping[str, torch.Tensor]) -> Destination:
    """A `Destination` into a model's tensors (its `state_dict()`): a piece whose rows are a
    contiguous part of the tensor it names, in its dtype, is received in place."""

    def destination(
        name: str, start: int, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        target = state.get(name)
        if target is None or target.dtype != dtype or target.dim() == 0 or len(shape) == 0:
            return None
        rows = target[start : start + shape[0]]
        if tuple(rows.shape) != tuple(shape) or not rows.is_contiguous():
            return None
        return rows

    return destination


def as_rows(piece: object) -> WeightRows:
    """A stream's piece as rows (a whole tensor is all of its rows); TypeError otherwise."""
    if isinstance(piece, WeightRows):
        return piece
    if isinstance(piece, tuple) and len(piece) == 2 and isinstance(piece[0], str):
        return WeightRows(name=piece[0], start=0, value=piece[1])
    raise TypeError(
        f"a weight stream holds (name, tensor) pairs or WeightRows, not a {type(piece).__name__}"
    )


def num_rows(tensor: torch.Tensor) -> int:
    """Rows along dimension 0 (a 0-d tensor is one row)."""
    return tensor.shape[0] if tensor.dim() else 1


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as uint8 (the same storage): any backend broadcasts any
    dtype so."""
    return tensor.reshape(-1).view(torch.uint8)


class RowCoverage:
    """Checks that a stream covers each expected tensor's rows exactly once."""

    def __init__(self, expected: Mapping[str, torch.Tensor]) -> None:
        self._expected = expected
        self._covered: dict[str, list[tuple[int, int]]] = {}

    def check(self, rows: WeightRows) -> torch.Tensor:
        """The rows of the expected tensor `rows` fills (a ValueError if they do not fit or
        came before)."""
        target = self._expected.get(rows.name)
        if target is None:
            raise ValueError(f"update_weights: {rows.name!r} is not a parameter of the model")
        value, whole = rows.value, tuple(target.shape)
        if rows.start == 0 and tuple(value.shape) == whole:
            view = target
        elif target.dim() == 0 or tuple(value.shape[1:]) != whole[1:]:
            raise ValueError(
                f"update_weights: tensor {rows.name!r} has shape {tuple(value.shape)}, the model "
                f"expects {whole}" + (" (or rows of it)" if target.dim() else "")
            )
        elif not 0 <= rows.start <= rows.stop <= whole[0]:
            raise ValueError(
                f"update_weights: rows {rows.start}:{rows.stop} of {rows.name!r} are outside "
                f"its {whole[0]} rows"
            )
        else:
            view = target[rows.start : rows.stop]
        if rows.stop == rows.start:
            return view  # no rows (an empty shard)
        spans = self._covered.setdefault(rows.name, [])
        if any(start < rows.stop and rows.start < stop for start, stop in spans):
            raise ValueError(f"update_weights: {rows.name!r} arrived twice in the stream")
        spans.append((rows.start, rows.stop))
        return view

    def missing(self) -> list[str]:
        """Names whose rows did not all come."""
        return sorted(
            name
            for name, target in self._expected.items()
            if sum(stop - start for start, stop in self._covered.get(name, ())) < num_rows(target)
        )
