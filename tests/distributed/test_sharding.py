"""Sharding helpers on real groups: positions, shard/gather round trips, and gather_sequence's gradient."""
from __future__ import annotations

import pytest

from ctx_plugin.names import Backend
from tests.distributed.harness import run_spawned

CONFIGS = {2: [(b.value, 1) for b in Backend if b != Backend.ULYSSES_RING] + [("ulysses_ring", 2)],
           3: [(b.value, 1) for b in Backend if b != Backend.ULYSSES_RING] + [("ulysses_ring", 3)],
           4: [("ulysses_ring", 2)]}


@pytest.mark.parametrize("world", sorted(CONFIGS))
def test_sharding_helpers(world):
    configs = CONFIGS[world]
    for rank, res in enumerate(run_spawned("tests.distributed.cases:sharding_helpers", world, {"configs": configs})):
        for backend, u in configs:
            assert res[f"{backend}-u{u}"] == {"positions_roundtrip": True, "positions_are_layout": True,
                                              "gather_roundtrip": True, "gather_grad": True}, (rank, backend, u)
