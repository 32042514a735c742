"""Bad input on a real multi-rank group: the same clear error on every rank, before any data moves (the ranks
first agree that they all make the same call, agreement.py, then raise their own identical error)."""
from __future__ import annotations

from tests.distributed.harness import run_spawned

WORLD = 3
EXPECTED = {
    "odd_zigzag_shard": "positive multiple of 6",
    "global_len_not_divisible": "positive multiple of 6",
    "heads": "must be a multiple of kv_heads",
    "other_config": "groups were built for",
    "device_not_served": "cannot send meta tensors",
    "gather_device_not_served": "cannot send meta tensors",
    "meta_documents_on_one_rank": "documents is a meta tensor, which holds no values",
    "ulysses_heads": "Ulysses splits heads over 3 ranks, but there are 2 query heads; use a context-parallel size "
                     "that divides 2: [1, 2]",
    "ulysses_kv_heads": "needs kv_heads (2) to divide 3 or be divisible by it",
    "ulysses_size_not_dividing": "ulysses_size 2 must divide context-parallel size 3; valid ulysses_size values: "
                                 "[1, 3]",
}


def test_bad_input_raises_identically_on_every_rank_before_communicating():
    results = run_spawned("tests.distributed.cases:bad_inputs", WORLD)
    for name, fragment in EXPECTED.items():
        messages = {res["errors"][name] for res in results}
        assert len(messages) == 1, f"{name}: ranks disagree: {messages}"
        (message,) = messages
        assert message is not None, f"{name} did not raise"
        assert fragment in message, f"{name}: {message}"
    for res in results:
        assert res["started"] == {}, "no communication may start for bad input"
        assert res["agreed"] == 8, "each bad cp_attention/gather_sequence call is agreed on first (one check each)"
        assert res["probe"] == WORLD, "the group must still work after the errors"
