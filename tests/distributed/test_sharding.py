"""Sharding helpers on real groups: positions, shard/gather round trips, and gather_sequence's gradient."""
from __future__ import annotations

import pytest

from tests.distributed.cases import RING_BACKENDS
from tests.distributed.harness import run_spawned


@pytest.mark.parametrize("world", [2, 3])
def test_sharding_helpers(world):
    for rank, res in enumerate(run_spawned("tests.distributed.cases:sharding_helpers", world)):
        for backend in RING_BACKENDS:
            assert res[backend] == {"positions_roundtrip": True, "positions_are_layout": True,
                                    "gather_roundtrip": True, "gather_grad": True}, (rank, backend)
