"""Ring backends on spawned gloo processes against the single-process float64 reference.

Each world size is launched once (a module-scoped fixture) and runs the whole matrix; the parametrized tests
then assert on its results. Tolerances: float64 1e-10 relative (the ring only reorders exact operations, so
errors are ~1e-15; 1e-10 leaves room for accumulation over larger sequences), float32 1e-5 relative (fp32
rounding of scores and merges, ~1e-7, amplified by the softmax backward).
"""
from __future__ import annotations

import itertools

import pytest

from ctx_plugin.names import Backend
from tests.distributed.cases import DTYPES, HEADS, RING_BACKENDS, case_id
from tests.distributed.harness import run_spawned

WORLD_SIZES = (1, 2, 3, 4)
TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
SEQ = 48            # divisible by 2·P for P = 1..4, so every layout splits it
_results: dict[int, list[dict]] = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        _results[world] = run_spawned("tests.distributed.cases:attention_matrix", world, {"seq": SEQ, "seed": 7})
    return _results[world]


MATRIX = list(itertools.product(WORLD_SIZES, RING_BACKENDS, (True, False), HEADS, DTYPES))


@pytest.mark.parametrize("world,backend,causal,heads,dtype", MATRIX,
                         ids=[f"P{w}-{case_id(b, c, h, d)}" for w, b, c, h, d in MATRIX])
def test_output_and_gradients_match_reference(world, backend, causal, heads, dtype):
    for rank, res in enumerate(results_for(world)):
        r = res[case_id(backend, causal, heads, dtype)]
        assert r["dtypes_ok"], "outputs and gradients must come back in the inputs' dtype"
        for name in ("out", "dq", "dk", "dv"):
            assert r[name] < TOLERANCE[dtype], f"rank {rank}: {name} relative error {r[name]:.2e}"


@pytest.mark.parametrize("backend", RING_BACKENDS)
def test_float32_error_does_not_grow_with_ring_size(backend):
    """Merging in fp32 keeps the error at P = 4 within twice the error at P = 1 (same inputs)."""
    for causal, heads in itertools.product((True, False), HEADS):
        cid = case_id(backend, causal, heads, "float32")
        one = results_for(1)[0][cid]
        four = max(res[cid]["out"] for res in results_for(4))
        grads_one = max(one[g] for g in ("dq", "dk", "dv"))
        grads_four = max(res[cid][g] for res in results_for(4) for g in ("dq", "dk", "dv"))
        assert four <= 2 * one["out"], f"{cid}: out error {four:.2e} at P=4 vs {one['out']:.2e} at P=1"
        assert grads_four <= 2 * grads_one, f"{cid}: grad error {grads_four:.2e} at P=4 vs {grads_one:.2e} at P=1"


def test_exchange_counts():
    """Forward: exactly P−1 K/V rotations (one batched send/recv each). Backward: P−1 K/V + P dK/dV hops."""
    world = 4
    for rank, res in enumerate(run_spawned("tests.distributed.cases:count_exchanges", world)):
        for backend in Backend:
            r = res[backend]
            assert r["fwd_calls"] == world - 1, f"rank {rank} {backend}: {r['fwd_calls']} batched exchanges"
            assert r["fwd_counts"] == {"ring_kv": world - 1}
            assert r["bwd_calls"] == 2 * world - 1
            assert r["bwd_counts"] == {"ring_kv": world - 1, "ring_dkv": world}
