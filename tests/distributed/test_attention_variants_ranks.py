"""Windows, softcap and sinks on spawned gloo ranks (one launch per world size): against the float64 reference,
the sinks' gradient summed over the group, the ring's transfers as the window requires (batched point-to-point
calls counted too), and one clear error on every rank when ranks disagree about the window or the sinks. The
full matrix runs on simulated ranks: tests/unit/test_attention_variants.py."""
from __future__ import annotations

import math

import pytest

from tests.distributed.harness import run_spawned

SEQ = 48
CASES = {   # name: (backend, ulysses_size, causal, window, softcap, sinks)
    "ring-causal-window": ("ring", 1, True, (5, 0), 1.5, True),
    "ring-left-right": ("ring", 1, False, (4, 7), None, True),
    "zigzag-window": ("zigzag", 1, True, (3, 0), None, True),
    "striped-window": ("striped", 1, False, (2, 2), 2.0, False),
    "allgather-window": ("allgather", 1, True, (9, 0), 1.5, True),
    "ulysses-window": ("ulysses", 1, False, (6, 1), None, True),
}
HYBRID = {"hybrid-window": ("ulysses_ring", 2, False, (4, 3), 1.5, True)}
_results: dict = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        cases = {**CASES, **(HYBRID if world == 4 else {})}
        if world == 3:
            cases.pop("ulysses-window")          # 4 heads over 3 ranks: refused
        _results[world] = run_spawned("tests.distributed.variants_ranks:variants", world, {"cases": cases})
    return _results[world]


@pytest.mark.parametrize("world", [3, 4])
def test_variants_match_reference_on_gloo_ranks(world):
    results = results_for(world)
    for rank, res in enumerate(results):
        for name, case in res["cases"].items():
            for what, err in case["errors"].items():
                assert err < 1e-10, f"rank {rank} {name}: {what} relative error {err:.2e}"
    assert "hybrid-window" in results[0]["cases"] or world == 3


@pytest.mark.parametrize("world", [3, 4])
def test_ring_transfers_follow_the_window(world):
    """Contiguous, causal window of 5 over shards of SEQ/P: ⌈5/n⌉ K/V transfers per pass instead of P − 1, ⌈5/n⌉
    dK/dV hops plus one home; a window with a right side reaching one shard ahead: one direct fetch first."""
    n = SEQ // world
    back = math.ceil(5 / n)
    for res in results_for(world):
        case = res["cases"]["ring-causal-window"]
        assert case["fwd"].get("ring_kv", 0) == back < world - 1
        assert case["bwd"].get("ring_kv", 0) == back and case["bwd"].get("ring_dkv", 0) == back + 1
        assert case["fwd_p2p"] == back and case["bwd_p2p"] == 2 * back + 1
        right = res["cases"]["ring-left-right"]      # left 4 → one shard back, right 7 → one shard ahead
        steps = min(3, world)
        want = world - 1 if steps == world else 1 + steps - 1
        assert right["fwd"]["ring_kv"] == right["bwd"]["ring_kv"] == want


@pytest.mark.parametrize("world", [3, 4])
def test_ranks_that_disagree_raise_the_same_error(world):
    errors = [res["errors"] for res in results_for(world)]
    for name, field in (("disagree", "window"), ("sinks_on_one", "sinks"), ("sinks_dtype", "sinks")):
        assert all(e[name] == errors[0][name] for e in errors), name
        assert "disagree" in errors[0][name] and f"  {field}: " in errors[0][name]
    assert all(e["bad_on_one"] == errors[0]["bad_on_one"] for e in errors)
    assert "window left must be None (unlimited) or an int >= 0" in errors[0]["bad_on_one"]
