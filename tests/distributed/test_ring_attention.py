"""Every backend on spawned gloo processes against the single-process float64 reference.

One launch per world size runs all of that size's cases (module-level cache); the parametrized tests assert
on the results. The matrix is written once and parametrized by the backend names of ctx_plugin.names.
Tolerances: float64 1e-10 relative (the algorithms only regroup exact operations, errors are ~1e-15; 1e-10
leaves room for accumulation over longer sequences); float32 1e-5 relative (fp32 rounding of scores and
merges, ~1e-7, amplified by the softmax backward).
"""
from __future__ import annotations

import itertools

import pytest

from ctx_plugin.names import Backend
from tests.distributed.cases import DTYPES, HEADS, KERNELS, RING_BACKENDS, case_id
from tests.distributed.harness import run_spawned

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
SEQ = 48            # a multiple of every layout's unit for P ≤ 4 (zigzag needs 2P, the hybrid P/u·lcm(2, u))
# (world size, ulysses_size) per backend: Ulysses needs P | heads (4), the hybrid runs on 4 ranks.
SIZES = {Backend.RING: [(p, 1) for p in (1, 2, 3, 4)],
         Backend.ZIGZAG: [(p, 1) for p in (1, 2, 3, 4)],
         Backend.STRIPED: [(p, 1) for p in (1, 2, 3, 4)],
         Backend.ULYSSES: [(p, 1) for p in (1, 2, 4)],
         Backend.ULYSSES_RING: [(4, 2), (4, 1), (4, 4)],
         Backend.ALLGATHER: [(p, 1) for p in (1, 2, 3, 4)]}
assert set(SIZES) == set(Backend), "every backend must be in the matrix"

MATRIX = [(p, b, u, c, h, d, k) for b, sizes in SIZES.items() for (p, u) in sizes
          for c, h, d, k in itertools.product((True, False), HEADS, DTYPES, KERNELS)]
_results: dict[int, list[dict]] = {}


def results_for(world: int) -> list[dict]:
    if world not in _results:
        cases = [(b.value, u, c, h, d, k) for p, b, u, c, h, d, k in MATRIX if p == world]
        _results[world] = run_spawned("tests.distributed.cases:attention_matrix", world,
                                      {"seq": SEQ, "seed": 7, "cases": cases})
    return _results[world]


@pytest.mark.parametrize("world,backend,u,causal,heads,dtype,kernel", MATRIX,
                         ids=[f"P{p}-{case_id(b, c, h, d, k, u)}" for p, b, u, c, h, d, k in MATRIX])
def test_output_and_gradients_match_reference(world, backend, u, causal, heads, dtype, kernel):
    for rank, res in enumerate(results_for(world)):
        r = res[case_id(backend, causal, heads, dtype, kernel, u)]
        assert r["dtypes_ok"], "outputs and gradients must come back in the inputs' dtype"
        assert r["shapes_ok"], "outputs and gradients must have the local inputs' shapes"
        for name in ("out", "dq", "dk", "dv"):
            assert r[name] < TOLERANCE[dtype], f"rank {rank}: {name} relative error {r[name]:.2e}"


@pytest.mark.parametrize("backend", [*RING_BACKENDS, Backend.ALLGATHER])
def test_float32_error_does_not_grow_with_group_size(backend):
    """fp32 merging/accumulation keeps the error at P = 4 within twice the error at P = 1 (same inputs)."""
    for causal, heads in itertools.product((True, False), HEADS):
        cid = case_id(backend, causal, heads, "float32")
        one = results_for(1)[0][cid]
        four = max(res[cid]["out"] for res in results_for(4))
        grads_one = max(one[g] for g in ("dq", "dk", "dv"))
        grads_four = max(res[cid][g] for res in results_for(4) for g in ("dq", "dk", "dv"))
        assert four <= 2 * one["out"], f"{cid}: out error {four:.2e} at P=4 vs {one['out']:.2e} at P=1"
        assert grads_four <= 2 * grads_one, f"{cid}: grad error {grads_four:.2e} at P=4 vs {grads_one:.2e} at P=1"


def test_hybrid_reduces_to_ring_and_ulysses():
    """ulysses_ring with u = 1 is the zigzag ring and with u = P is Ulysses: bit-identical outputs and grads."""
    for res in run_spawned("tests.distributed.cases:hybrid_reduces", 4, {"seq": SEQ}):
        assert res == {"u1_is_zigzag": True, "uP_is_ulysses": True}


def test_communication_counts():
    """Forward: P−1 K/V rotations for the ring family, 4 all-to-alls (q, k, v, out) for Ulysses, 4
    all-to-alls and P/u−1 rotations for the hybrid, one K/V all-gather for allgather, each after one rank-agreement
    check (agreement.py). Backward mirrors it, after one agreement on whether any rank runs it with create_graph."""
    p = 4
    configs = [(b.value, 1) for b in (*RING_BACKENDS, Backend.ULYSSES, Backend.ALLGATHER)] + [("ulysses_ring", 2)]
    ring = {"fwd_p2p": p - 1, "fwd": {"agree": 1, "ring_kv": p - 1}, "bwd_p2p": 2 * p - 1,
            "bwd": {"agree": 1, "ring_kv": p - 1, "ring_dkv": p}}
    r = p // 2
    want = {**{f"{b}-u1": ring for b in RING_BACKENDS},
            "ulysses-u1": {"fwd_p2p": 0, "fwd": {"agree": 1, "a2a": 4}, "bwd_p2p": 0, "bwd": {"agree": 1, "a2a": 4}},
            "allgather-u1": {"fwd_p2p": 0, "fwd": {"agree": 1, "allgather_kv": 1}, "bwd_p2p": 0,
                             "bwd": {"agree": 1, "allgather_kv": 1, "reduce_scatter_dkv": 1}},
            "ulysses_ring-u2": {"fwd_p2p": r - 1, "fwd": {"agree": 1, "a2a": 4, "ring_kv": r - 1}, "bwd_p2p": 2 * r - 1,
                                "bwd": {"agree": 1, "a2a": 4, "ring_kv": r - 1, "ring_dkv": r}}}
    for rank, res in enumerate(run_spawned("tests.distributed.cases:count_exchanges", p, {"configs": configs})):
        assert res == want, f"rank {rank}"


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["gqa", "mqa-replicated"])
def test_forward_saves_only_q_k_v_out_lse(kv_heads):
    """Per call, autograd keeps exactly q, k, v, out and lse: no per-step copies, no gathered K/V. Under Ulysses
    they are the head-sharded tensors (same size as the inputs: full sequence × heads/u); the Ulysses K/V of
    the MQA case are replicated to one head per rank."""
    p, b, n, h, d = 4, 2, 8, 8, 16
    configs = [(bk.value, 1) for bk in Backend if bk != Backend.ULYSSES_RING] + [("ulysses_ring", 2)]
    local = lambda heads: [b, n, heads, d]  # noqa: E731
    want = {f"{bk}-u1": [local(h), local(kv_heads), local(kv_heads), local(h), [b, h, n]]
            for bk in (*RING_BACKENDS, Backend.ALLGATHER)}
    uly_kv = max(kv_heads // p, 1)
    want["ulysses-u1"] = [[b, p * n, h // p, d], [b, p * n, uly_kv, d], [b, p * n, uly_kv, d], [b, p * n, h // p, d],
                          [b, h // p, p * n]]
    hyb_kv = max(kv_heads // 2, 1)
    want["ulysses_ring-u2"] = [[b, 2 * n, h // 2, d], [b, 2 * n, hyb_kv, d], [b, 2 * n, hyb_kv, d],
                               [b, 2 * n, h // 2, d], [b, h // 2, 2 * n]]
    for res in run_spawned("tests.distributed.cases:saved_tensors", p, {"configs": configs, "kv_heads": kv_heads}):
        assert res == want
