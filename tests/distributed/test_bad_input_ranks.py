"""Bad input on a real multi-rank group: the same clear error on every rank, before any communication."""
from __future__ import annotations

from tests.distributed.harness import run_spawned

EXPECTED = {
    "odd_zigzag_shard": "positive multiple of 6",
    "global_len_not_divisible": "positive multiple of 6",
    "heads": "must be a multiple of kv_heads",
    "other_config": "groups were built for",
    "device_not_served": "cannot send meta tensors",
    "gather_device_not_served": "cannot send meta tensors",
}


def test_bad_input_raises_identically_on_every_rank_before_communicating():
    world = 3
    results = run_spawned("tests.distributed.cases:bad_inputs", world)
    for name, fragment in EXPECTED.items():
        messages = {res["errors"][name] for res in results}
        assert len(messages) == 1, f"{name}: ranks disagree: {messages}"
        (message,) = messages
        assert message is not None, f"{name} did not raise"
        assert fragment in message, f"{name}: {message}"
    for res in results:
        assert res["started"] == {}, "no exchange may start for bad input"
        assert res["probe"] == world, "the group must still work after the errors"
