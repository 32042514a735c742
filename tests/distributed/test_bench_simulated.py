"""The benchmark's simulated ranks run the real cp_attention: with data moving between threads they compute what
the distributed (spawned gloo) run computes, and both match the float64 dense reference; with the packed documents
the benchmark gives them, they compute every document's attention on its own."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.harness import Shape, simulated_outputs
from ctx_plugin.names import Backend

from ..reference import dense_with_grads, documents_with_grads, rel_err
from .cases import _inputs, sharded_run
from .harness import run_spawned

CASES = [(b.value, 2 if b == Backend.ULYSSES_RING else 1, causal) for b in Backend for causal in (True, False)]
SEQ, SEED, WORLD = 24, 5, 4


def distributed_outputs(rank: int, world: int, payload) -> dict:
    out = {}
    for backend, u, causal in payload:
        cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
        q, k, v, dout = _inputs(SEQ, "gqa", SEED)
        full, _ = sharded_run(cfg, ctx_plugin.build_cp_groups(cfg), q, k, v, dout, causal, torch.float64)
        out[f"{backend}-{causal}"] = [t.tolist() for t in full]
    return out


@pytest.fixture(scope="module")
def distributed():
    return run_spawned("tests.distributed.test_bench_simulated:distributed_outputs", WORLD, CASES)[0]


@pytest.mark.parametrize("backend,u,causal", CASES)
def test_simulated_ranks_compute_what_distributed_ranks_compute(distributed, backend, u, causal):
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    q, k, v, dout = _inputs(SEQ, "gqa", SEED)
    got = simulated_outputs(cfg, WORLD, q, k, v, dout, causal=causal)
    want = [torch.tensor(t, dtype=torch.float64) for t in distributed[f"{backend}-{causal}"]]
    # Forward: the same operations in the same order on the same data, so bit for bit. Gradients: equal up to the
    # order in which a collective adds the ranks' parts (gloo may sum a reduce-scatter in another order), float64.
    assert torch.equal(got[0], want[0])
    for g, w in zip(got[1:], want[1:]):
        assert rel_err(g, w) <= 1e-13
    # and both are the attention: float64 dense reference, 1e-12 (float64 with a few thousand reassociations)
    for g, r in zip(got, dense_with_grads(q, k, v, dout, causal=causal)):
        assert rel_err(g, r) <= 1e-12


@pytest.mark.parametrize("backend,u,causal", CASES)
def test_simulated_ranks_compute_the_packed_documents_the_bench_times(backend, u, causal):
    """The documents ``Shape.documents_for`` pads for the layout (zigzag over 4: 5, 2 and 9 tokens in 8, 8 and the
    8 positions left) through the simulated ranks, against plain attention on every document alone (float64)."""
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    docs = Shape(seq_len=SEQ, documents=(5, 2, 9)).documents_for(cfg, WORLD)
    assert docs.count > 1
    q, k, v, dout = _inputs(SEQ, "gqa", SEED)
    got = simulated_outputs(cfg, WORLD, q, k, v, dout, causal=causal, documents=docs)
    for g, r in zip(got, documents_with_grads(q, k, v, dout, docs, causal=causal)):
        assert rel_err(g, r) <= 1e-12
