"""WeightSource loading a stream of pieces (whole tensors and row ranges, as generator ranks
receive them from several trainer ranks): any split and order gives bitwise the state dict's
load; rows that overlap, fall outside the tensor or never come are errors naming the tensor."""

from __future__ import annotations

import pytest
import torch

from temper.distributed.weight_pieces import WeightRows
from temper.models import materialize, qwen3_size
from temper.sampler.weight_source import WeightSource


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    return materialize(qwen3_size("tiny", vocab_size=37), seed=3).state_dict()


def _source() -> WeightSource:
    return WeightSource(materialize(qwen3_size("tiny", vocab_size=37), init="empty"))


def _rows(weights, *, split: int) -> list:
    """Every tensor in ranges of `split` rows, the tensors in reverse order, whole 1-D ones."""
    pieces = []
    for name, value in reversed(weights.items()):
        if value.dim() == 1:
            pieces.append((name, value))
            continue
        for first in range(0, value.shape[0], split):
            pieces.append(WeightRows(name=name, start=first, value=value[first : first + split]))
    return pieces


def test_rows_in_any_order_load_bitwise_what_the_state_dict_does(weights):
    source = _source()
    source.update(iter(_rows(weights, split=5)), version=2)
    loaded = source.model.state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in weights.items())
    assert source.version == 2


def test_bad_rows_are_explained(weights):
    pieces = _rows(weights, split=5)
    embed = [p for p in pieces if isinstance(p, WeightRows) and p.name == "embed.weight"]
    twice = [*pieces, embed[0]]
    with pytest.raises(ValueError, match=r"'embed\.weight' arrived twice"):
        _source().update(iter(twice), version=1)
    missing = [p for p in pieces if p is not embed[-1]]
    with pytest.raises(ValueError, match=r"ended without \['embed.weight'\]"):
        _source().update(iter(missing), version=1)
    outside = WeightRows(name="embed.weight", start=35, value=embed[0].value)
    with pytest.raises(ValueError, match=r"rows 35:40 of 'embed\.weight' are outside its 37 rows"):
        _source().update(iter([outside]), version=1)
    narrow = WeightRows(name="embed.weight", start=0, value=embed[0].value[:, :3])
    with pytest.raises(ValueError, match=r"'embed.weight' has shape \(5, 3\).*or rows of it"):
        _source().update(iter([narrow]), version=1)
    with pytest.raises(TypeError, match="pairs or WeightRows, not a list"):
        _source().update(iter([["embed.weight", embed[0].value]]), version=1)
