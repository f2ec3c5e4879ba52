"""RoutedExperts: a compact [T, L, K] array of expert ids (uint8 up to 256 experts, int16
past), round-tripped through torch and pickle; a malformed one fails when made."""

from __future__ import annotations

import pickle

import pytest
import torch

from temper.api import Datum, ModelInput, RoutedExperts


@pytest.mark.parametrize(("num_experts", "dtype"), [(8, "uint8"), (256, "uint8"), (300, "int16")])
def test_round_trip_in_the_smallest_dtype(num_experts, dtype):
    experts_TLK = torch.randint(0, num_experts, (5, 3, 2))
    routes = RoutedExperts.from_torch(experts_TLK, num_experts=num_experts)
    assert routes.dtype == dtype and routes.shape == (5, 3, 2) and routes.num_tokens == 5
    assert len(routes.data) == experts_TLK.numel() * (1 if dtype == "uint8" else 2)
    assert torch.equal(routes.to_torch(), experts_TLK)
    assert pickle.loads(pickle.dumps(routes)) == routes
    empty = RoutedExperts.from_torch(torch.zeros(0, 3, 2, dtype=torch.long), num_experts=8)
    assert empty.to_torch().shape == (0, 3, 2)


def test_malformed_routes_fail_when_made():
    with pytest.raises(ValueError, match=r"holds 5 bytes but shape \[2, 2, 2\]"):
        RoutedExperts(data=bytes(5), shape=(2, 2, 2))
    with pytest.raises(ValueError, match=r"RoutedExperts\.shape must be"):
        RoutedExperts(data=bytes(4), shape=(2, 2))
    with pytest.raises(ValueError, match=r"RoutedExperts\.dtype"):
        RoutedExperts(data=bytes(8), shape=(2, 2, 2), dtype="int64")
    with pytest.raises(TypeError, match=r"Datum\.routed_experts must be RoutedExperts"):
        Datum(model_input=ModelInput.from_ints([1, 2]), routed_experts=torch.zeros(2, 1, 1))
