"""Datums -> validated per-datum tensors -> right-padded micro-batches within a token budget.

Shapes: B datums in a micro-batch, T padded length, N loss positions of a micro-batch, K target
tokens per position (top-K losses; inputs are [T] otherwise). In a datum's routes
(`routes_TLK`), L sparse layers and K experts per token.

Everything a call could reject is checked here, before the model runs, so a bad call changes
nothing: every error names the datum index and the field.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from temper.api.types import Datum, RoutingReplay, TensorData, numbers_to_tensor
from temper.losses.base import InputDefault
from temper.trainer.routing_replay import RouteShape, check_replay, datum_routes
from temper.trainer.shared_prefix import (
    Cluster,
    PackedLayout,
    PackedSize,
    cluster_prefixes,
    pack,
    packed_size,
    worth_packing,
)


def misspelled_input(name: str, *, allowed: Iterable[str]) -> str | None:
    """The input of `allowed` that `name` (not one of them) looks like a misspelling of, or
    None. Inputs the loss does not read are ignored, as Tinker does (the cookbook keeps a
    "mask" on its datums), but a misspelled one would silently train on something else (a
    `weight` ignored trains every token), so that one fails."""
    close = difflib.get_close_matches(name, sorted(allowed), n=1, cutoff=0.8)
    return close[0] if close else None


def _check_not_a_misspelling(name: str, *, allowed: Iterable[str], where: str) -> None:
    close = misspelled_input(name, allowed=allowed)
    if close is not None:
        raise ValueError(
            f"{where}: loss_fn_inputs[{name!r}] is not an input of this loss; did you mean "
            f"{close!r}? (its inputs: {', '.join(sorted(allowed))}; other names are ignored)"
        )


@dataclass(frozen=True)
class PreparedDatum:
    index: int
    tokens: list[int]
    tokens_T: torch.Tensor
    inputs: dict[str, torch.Tensor]
    """Loss inputs, each [T] or [T, K] (int64 target_tokens, float32 otherwise)."""
    routes_TLK: torch.Tensor | None = None
    """MoE models: the sampler's experts for each token (int64 [T, L, K]), if the datum
    carries them (routing_replay.py)."""

    @property
    def targets_per_position(self) -> tuple[int, ...]:
        """() for [T] target tokens, (K,) for [T, K]: datums in a micro-batch agree on it."""
        targets = self.inputs.get("target_tokens")
        return () if targets is None else tuple(targets.shape[1:])


@dataclass(frozen=True)
class MicroBatch:
    datums: list[PreparedDatum]
    tokens_BT: torch.Tensor
    targets_BT: torch.Tensor
    """[B, T], or [B, T, K] when the datums score K targets per position."""
    mask_BT: torch.Tensor
    """True at real (non-padding) positions."""
    layout: PackedLayout | None = None
    """Set when the datums run packed with shared prefixes (shared_prefix.py) instead of as
    the padded rows above; tokens_BT/targets_BT/mask_BT are then empty."""

    def flat_targets(self, device: torch.device) -> torch.Tensor:
        """Every datum's target tokens concatenated in order: [N]."""
        return torch.cat([d.inputs["target_tokens"] for d in self.datums]).to(device)

    def flat_inputs(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each loss input concatenated over datums in order: [N] (or [N, K])."""
        names = self.datums[0].inputs.keys()
        return {name: torch.cat([d.inputs[name] for d in self.datums]).to(device) for name in names}

    def token_rows(self, device: torch.device) -> torch.Tensor:
        """Where every datum token sits in the model's flattened input, datums concatenated in
        order: [N] int64 rows of the [B * T] padded rows, or of the packed sequence (a shared
        prefix's rows once per datum that reads them)."""
        if self.layout is not None:
            return self.layout.gather_N.to(device)
        return self.mask_BT.reshape(-1).nonzero().squeeze(1).to(device)

    @property
    def num_rows(self) -> int:
        """Rows of the model's flattened input: B * T padded, or the packed positions."""
        if self.layout is not None:
            return self.layout.num_positions
        return self.tokens_BT.numel()

    @property
    def routes(self) -> list[torch.Tensor] | None:
        """Every datum's routes, in order, when all carry them."""
        routes = [d.routes_TLK for d in self.datums]
        return None if any(r is None for r in routes) else routes

    def segments(self, device: torch.device) -> torch.Tensor:
        """The datum (0, 1, ... within this batch) of each position: [N] int64."""
        lengths = torch.tensor([len(d.tokens) for d in self.datums])
        return torch.repeat_interleave(torch.arange(len(self.datums)), lengths).to(device)


def _checked_inputs(
    datum: Datum,
    *,
    where: str,
    length: int,
    required: Sequence[str],
    allowed: set[str],
    topk: Sequence[str],
) -> list[tuple[str, TensorData]]:
    """(name, values) of the datum's inputs the loss reads, in name order, each checked
    against the datum's `length` tokens (inputs named in `topk` may be [T, K], all one
    shape); a missing or misspelled input raises ValueError naming it."""
    checked: list[tuple[str, TensorData]] = []
    missing = [name for name in required if name not in datum.loss_fn_inputs]
    if missing:
        unread = set(datum.loss_fn_inputs) - allowed
        hints = [
            f"{close!r} for {name!r}"
            for name in missing
            if (close := misspelled_input(name, allowed=unread)) is not None
        ]
        hint = f" (did you write {', '.join(hints)}?)" if hints else ""
        raise ValueError(f"{where}: loss_fn_inputs is missing {missing}{hint}")
    topk_shape, topk_name = None, ""  # the first input named in `topk`, and its shape
    # In name order, so an error names the same input whatever order the wire gave.
    for name, value in sorted(datum.loss_fn_inputs.items()):
        if name not in allowed:
            _check_not_a_misspelling(name, allowed=allowed, where=where)
            continue  # e.g. a "mask" the cookbook keeps on datums; the loss does not read it
        shape = tuple(value.shape)
        if name in topk and len(shape) == 2 and shape[0] == length and shape[1] >= 1:
            pass
        elif shape != (length,):
            expected = f"[{length}] or [{length}, K]" if name in topk else f"[{length}]"
            raise ValueError(
                f"{where}: loss_fn_inputs[{name!r}] has shape {list(shape)}, but "
                f"model_input has {length} tokens; expected {expected}"
            )
        if name in topk:
            if topk_shape is not None and shape != topk_shape:
                raise ValueError(
                    f"{where}: loss_fn_inputs[{name!r}] has shape {list(shape)} but "
                    f"loss_fn_inputs[{topk_name!r}] has shape {list(topk_shape)}; "
                    f"{' and '.join(repr(n) for n in topk)} must have one shape"
                )
            topk_shape, topk_name = shape, name
        checked.append((name, value))
    if topk_shape is not None and len(topk_shape) == 2 and "support_mask" in topk:
        _check_support_given(datum, where=where, length=length, shape=topk_shape)
    return checked


def _check_support_given(datum: Datum, *, where: str, length: int, shape: tuple[int, ...]) -> None:
    """A policy loss scores one token per position: [T, K] targets are its drawn token and
    the rest of the sampler's support (losses/support.py), so they need the support's mask."""
    if "support_mask" not in datum.loss_fn_inputs:
        raise ValueError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {list(shape)}, but "
            f"model_input has {length} tokens; expected [{length}] (or [{length}, K] with "
            f"'support_mask' [{length}, K], to renormalise over a sampler's support)"
        )


def prepare(
    data: Sequence[Datum],
    *,
    required: Sequence[str],
    optional: Sequence[str] = (),
    defaults: Mapping[str, InputDefault] | None = None,
    topk: Sequence[str] = (),
    vocab_size: int,
    max_seq_len: int,
    route_shape: RouteShape | None = None,
    routing_replay: RoutingReplay = "off",
) -> list[PreparedDatum]:
    """Checked tensors of `data`'s inputs. Inputs named in `topk` may be [T, K] (all of a
    datum's the same shape); `defaults` computes a missing optional input from the rest.
    Datums' `routed_experts` are checked against `route_shape` (the model's MoE layers, None
    for a dense model) and must be on every datum when `routing_replay` is 'sampler'."""
    check_replay(routing_replay, shape=route_shape)
    if len(data) == 0:
        raise ValueError("data is empty; pass at least one Datum")
    allowed = set(required) | set(optional)
    token_lists: list[list[int]] = []
    columns: dict[str, list[tuple[int, TensorData]]] = {}  # name -> (datum index, values)
    for index, datum in enumerate(data):
        if not isinstance(datum, Datum):
            raise TypeError(f"datum {index}: expected a Datum, got {type(datum).__name__}")
        where = f"datum {index}"
        tokens = datum.model_input.to_ints(where=f"{where}: model_input")
        length = len(tokens)
        if length == 0:
            raise ValueError(f"{where}: model_input is empty")
        if length > max_seq_len:
            raise ValueError(
                f"{where}: model_input has {length} tokens, more than the model's max_seq_len "
                f"{max_seq_len}"
            )
        if min(tokens) < 0 or max(tokens) >= vocab_size:
            _check_ids(tokens, where=f"{where}: model_input", vocab_size=vocab_size)
        for name, value in _checked_inputs(
            datum, where=where, length=length, required=required, allowed=allowed, topk=topk
        ):
            columns.setdefault(name, []).append((index, value))
        token_lists.append(tokens)
    # Tensors are built per input name over all datums (one tensor each, split into per-datum
    # views), and values are checked once per name; a bad datum is looked up only when there
    # is one. A call of hundreds of datums costs a few ops, not a few per datum.
    lengths = [len(tokens) for tokens in token_lists]
    tokens_N = numbers_to_tensor(
        [token for tokens in token_lists for token in tokens], dtype="int64"
    )
    inputs: list[dict[str, torch.Tensor]] = [{} for _ in data]
    for name, entries in columns.items():
        for index, tensor_T in _converted_column(name, entries, vocab_size=vocab_size):
            inputs[index][name] = tensor_T
    for name, default in (defaults or {}).items():
        for datum_inputs in inputs:
            if name not in datum_inputs:
                datum_inputs[name] = default(datum_inputs)
    _check_carried_alike(inputs, names=columns)
    routes = datum_routes(data, shape=route_shape, routing_replay=routing_replay)
    return [
        PreparedDatum(
            index=index, tokens=tokens, tokens_T=tokens_T, inputs=inputs[index], routes_TLK=route
        )
        for index, (tokens, tokens_T, route) in enumerate(
            zip(token_lists, tokens_N.split(lengths), routes, strict=True)
        )
    ]


def _check_carried_alike(inputs: list[dict[str, torch.Tensor]], *, names: Iterable[str]) -> None:
    """An optional input without a default goes on every datum of a call or on none: a loss
    reads it for all positions at once, so a datum without it has no value to use."""
    for name in names:
        lacking = [index for index, datum_inputs in enumerate(inputs) if name not in datum_inputs]
        if lacking:
            raise ValueError(
                f"datum {lacking[0]}: loss_fn_inputs lacks {name!r}, which other datums of this "
                "call carry; give it to every datum of the call or to none"
            )


def _converted_column(
    name: str, entries: list[tuple[int, TensorData]], *, vocab_size: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(datum index, checked tensor) for every datum carrying input `name`."""
    if len({value.dtype for _, value in entries}) == 1:
        flat = TensorData.concat_to_torch([value for _, value in entries])
        try:
            converted = _converted_input(flat, name=name, where="")
        except ValueError:
            converted = None  # found and named datum by datum below
        if converted is not None and _valid(converted, name, vocab_size=vocab_size):
            parts = converted.split([len(value.data) for _, value in entries])
            for (index, value), part in zip(entries, parts, strict=True):
                # split gives [T] parts already; only [T, K] inputs need their shape back.
                yield index, part if len(value.shape) == 1 else part.view(value.shape)
            return
    for index, value in entries:
        where = f"datum {index}"
        tensor = _converted_input(value.to_torch(), name=name, where=where)
        _check_one(tensor, name, where=where, vocab_size=vocab_size)
        yield index, tensor


def _converted_input(tensor: torch.Tensor, *, name: str, where: str) -> torch.Tensor:
    if name == "target_tokens":
        if tensor.dtype.is_floating_point and not torch.equal(tensor, tensor.round()):
            raise ValueError(f"{where}: loss_fn_inputs['target_tokens'] must be integers")
        return tensor.long()
    return tensor.float()


def _valid(tensor: torch.Tensor, name: str, *, vocab_size: int) -> bool:
    """Target ids inside the vocabulary; finite values for every other input."""
    return _in_vocab(tensor, vocab_size) if _is_ids(name) else bool(torch.isfinite(tensor).all())


def _is_ids(name: str) -> bool:
    return name == "target_tokens"


def _in_vocab(ids: torch.Tensor, vocab_size: int) -> bool:
    return ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size)


def _check_one(tensor: torch.Tensor, name: str, *, where: str, vocab_size: int) -> None:
    if _is_ids(name):
        _check_ids(tensor, where=f"{where}: loss_fn_inputs['target_tokens']", vocab_size=vocab_size)
    else:
        _check_finite(tensor, name=name, where=where)


def _check_ids(tokens: Sequence[int] | torch.Tensor, *, where: str, vocab_size: int) -> None:
    ids = torch.as_tensor(tokens)
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        position = _first(bad)
        raise ValueError(
            f"{where}: token {int(ids[position])} at position {_named(position)} is outside the "
            f"vocabulary; valid ids are 0..{vocab_size - 1}"
        )


def _check_finite(tensor: torch.Tensor, *, name: str, where: str) -> None:
    bad = ~torch.isfinite(tensor)
    if bool(bad.any()):
        position = _first(bad)
        raise ValueError(
            f"{where}: loss_fn_inputs[{name!r}] has a non-finite value "
            f"({tensor[position].item()}) at position {_named(position)}"
        )


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    """The index of the first True of a [T] or [T, K] mask."""
    return tuple(int(i) for i in bad.nonzero()[0])


def _named(position: tuple[int, ...]) -> str:
    """2 for [T] inputs, [2, 1] for [T, K] ones."""
    return str(position[0]) if len(position) == 1 else str(list(position))


def micro_batches(
    datums: Sequence[PreparedDatum],
    *,
    max_tokens: int,
    pad_token_id: int = 0,
    share_prefixes: bool = False,
    replaying: bool = False,
) -> Iterator[MicroBatch]:
    """Consecutive groups whose padded size (rows x longest) stays within `max_tokens`; a
    datum longer than the budget forms a batch of its own.

    With `share_prefixes`, when consecutive datums share prefixes enough to save positions
    (GRPO groups), batches are packed layouts instead (see shared_prefix.py) and the budget
    counts packed positions; `replaying` (their routes) shares a prefix only as far as the
    datums' routes agree.

    A batch's datums score as many targets per position (K) as each other: a datum whose K
    differs from the one before starts a new batch.
    """
    uniform = len({d.targets_per_position for d in datums}) <= 1
    if share_prefixes and uniform and datums and all("target_tokens" in d.inputs for d in datums):
        token_lists = [d.tokens for d in datums]
        lengths = [len(tokens) for tokens in token_lists]
        routes = [d.routes_TLK for d in datums] if replaying else None
        clusters = cluster_prefixes(token_lists, routes=routes)
        if worth_packing(clusters, lengths):
            yield from _packed_batches(
                datums, clusters, token_lists=token_lists, max_tokens=max_tokens
            )
            return
    group: list[PreparedDatum] = []
    longest = 0
    for datum in datums:
        length = datum.tokens_T.shape[0]
        over_budget = max(longest, length) * (len(group) + 1) > max_tokens
        if group and (over_budget or datum.targets_per_position != group[0].targets_per_position):
            yield _collate(group, pad_token_id=pad_token_id)
            group, longest = [], 0
        group.append(datum)
        longest = max(longest, length)
    if group:
        yield _collate(group, pad_token_id=pad_token_id)


def _collate(group: list[PreparedDatum], *, pad_token_id: int) -> MicroBatch:
    width = max(d.tokens_T.shape[0] for d in group)
    tokens_BT = torch.full((len(group), width), pad_token_id, dtype=torch.long)
    targets_BT = torch.zeros((len(group), width, *group[0].targets_per_position), dtype=torch.long)
    mask_BT = torch.zeros((len(group), width), dtype=torch.bool)
    for row, datum in enumerate(group):
        length = datum.tokens_T.shape[0]
        tokens_BT[row, :length] = datum.tokens_T
        if "target_tokens" in datum.inputs:
            targets_BT[row, :length] = datum.inputs["target_tokens"]
        mask_BT[row, :length] = True
    return MicroBatch(datums=group, tokens_BT=tokens_BT, targets_BT=targets_BT, mask_BT=mask_BT)


def _packed_batches(
    datums: Sequence[PreparedDatum],
    clusters: Sequence[Cluster],
    *,
    token_lists: Sequence[list[int]],
    max_tokens: int,
) -> Iterator[MicroBatch]:
    """Whole clusters per batch while the packed size fits the budget; a cluster too big for
    it alone is split into chunks of members (each runs the prefix again)."""
    lengths = [len(tokens) for tokens in token_lists]
    group: list[Cluster] = []
    size = PackedSize()
    for cluster in _fitting_chunks(clusters, lengths=lengths, max_tokens=max_tokens):
        grown = size.plus(cluster, lengths)
        if group and grown.num_positions > max_tokens:
            yield _collate_packed(datums, group, token_lists=token_lists)
            group, grown = [], PackedSize().plus(cluster, lengths)
        group.append(cluster)
        size = grown
    if group:
        yield _collate_packed(datums, group, token_lists=token_lists)


def _fitting_chunks(
    clusters: Sequence[Cluster], *, lengths: Sequence[int], max_tokens: int
) -> Iterator[Cluster]:
    for cluster in clusters:
        if packed_size([cluster], lengths) <= max_tokens:
            yield cluster  # the common case: the whole cluster fits
            continue
        chunk: list[int] = []
        for member in cluster.members:
            candidate = Cluster(members=[*chunk, member], prefix_len=cluster.prefix_len)
            if chunk and packed_size([candidate], lengths) > max_tokens:
                yield Cluster(members=chunk, prefix_len=cluster.prefix_len)
                chunk = []
            chunk.append(member)
        yield Cluster(members=chunk, prefix_len=cluster.prefix_len)


def _collate_packed(
    datums: Sequence[PreparedDatum], clusters: list[Cluster], *, token_lists: Sequence[list[int]]
) -> MicroBatch:
    members = [m for c in clusters for m in c.members]
    local = {member: row for row, member in enumerate(members)}
    renumbered = [
        Cluster(members=[local[m] for m in c.members], prefix_len=c.prefix_len) for c in clusters
    ]
    group = [datums[m] for m in members]
    empty = torch.empty((0, 0), dtype=torch.long)
    return MicroBatch(
        datums=group,
        tokens_BT=empty,
        targets_BT=empty,
        mask_BT=empty.bool(),
        layout=pack([token_lists[m] for m in members], renumbered),
    )


def split_per_datum(values_N: torch.Tensor, datums: Sequence[PreparedDatum]) -> list[torch.Tensor]:
    lengths = [d.tokens_T.shape[0] for d in datums]
    assert sum(lengths) == values_N.shape[0]
    return list(values_N.split(lengths))
