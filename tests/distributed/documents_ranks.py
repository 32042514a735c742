"""Work for tests/distributed/test_documents_ranks.py, run inside spawned gloo ranks: packed documents through real
process groups (outputs and gradients against the per-document float64 reference, per-document positions), and ranks
that disagree about the documents or pass documents one layout cannot split."""
from __future__ import annotations

import torch

import ctx_plugin
from ctx_plugin.core.rules import padding_units
from tests.reference import documents_with_grads, rel_err

LENGTHS = [3, 29, 1, 11, 2]


def _inputs(seq: int):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, seq, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64)


def run_case(backend: str, u: int, causal: bool, world: int) -> dict:
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    groups = ctx_plugin.build_cp_groups(cfg)
    unit, total = padding_units(cfg, world)
    docs, _ = ctx_plugin.pad_documents(LENGTHS, unit, total_unit=total)
    q, k, v, dout = _inputs(docs.seq_len)
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1, documents=docs)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_(True) for t in (q, k, v))
    out = ctx_plugin.cp_attention(ql, kl, vl, config=cfg, groups=groups, causal=causal, documents=docs)
    out.backward(shard(dout))
    got = [ctx_plugin.gather_sequence(t, config=cfg, groups=groups, dim=1, documents=docs)
           for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    want = documents_with_grads(q, k, v, dout, docs, causal=causal)
    positions = ctx_plugin.sequence_positions(docs.seq_len, config=cfg, groups=groups, documents=docs)
    return {"errors": {name: rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)},
            "positions": torch.equal(positions, shard(docs.positions().view(1, -1))[0])}


def documents(rank: int, world: int, payload: dict) -> dict:
    results = {name: run_case(*case, world) for name, case in payload["cases"].items()}
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    n = 4 * world
    q = torch.randn(1, n // world, 4, 8, dtype=torch.float64)
    errors = {}
    for name, docs in (("disagree", [0, 2 * world, n] if rank == 0 else [0, n]),
                       ("bad_on_one", [0, 2 * world + 1, n] if rank == 1 else [0, n])):
        try:
            ctx_plugin.cp_attention(q, q[:, :, :2], q[:, :, :2], config=cfg, groups=groups, documents=docs)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return {"cases": results, "errors": errors}
