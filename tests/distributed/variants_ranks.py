"""Work for tests/distributed/test_attention_variants_ranks.py, run inside spawned gloo ranks: windows, softcap and
sinks through real process groups (outputs, gradients, the sinks' gradient summed over the group, communication
counts), and ranks that disagree about a window."""
from __future__ import annotations

import torch
import torch.distributed as dist

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from tests.distributed.cases import counted_p2p
from tests.reference import dense_with_grads, rel_err

SEQ = 48


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, SEQ, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, SEQ, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(2, SEQ, 4, 8, generator=g, dtype=torch.float64)
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    return q, k, v, dout, sinks


def run_case(backend: str, u: int, causal: bool, window, softcap, with_sinks: bool) -> dict:
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    groups = ctx_plugin.build_cp_groups(cfg)
    q, k, v, dout, sinks = _inputs(3)
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    ql, kl, vl = (shard(t).requires_grad_(True) for t in (q, k, v))
    own_sinks = sinks.clone().requires_grad_(True) if with_sinks else None
    with counted_p2p() as p2p, CommCounter().counting() as counter:
        out = ctx_plugin.cp_attention(ql, kl, vl, config=cfg, groups=groups, causal=causal, window=window,
                                      softcap=softcap, sinks=own_sinks)
        fwd, fwd_p2p = dict(counter.counts), p2p["n"]
        counter.reset()
        out.backward(shard(dout))
        bwd, bwd_p2p = dict(counter.counts), p2p["n"] - fwd_p2p
    got = [ctx_plugin.gather_sequence(t, config=cfg, groups=groups, dim=1) for t in (out.detach(), ql.grad, kl.grad,
                                                                                         vl.grad)]
    want = dense_with_grads(q, k, v, dout, causal=causal, window=window, softcap=softcap,
                            sinks=sinks if with_sinks else None)
    errors = {name: rel_err(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    if with_sinks:                      # each rank holds its part of the replicated parameter's gradient
        total = own_sinks.grad.clone()
        dist.all_reduce(total)
        errors["dsinks"] = rel_err(total, want[4])
    return {"errors": errors, "fwd": fwd, "bwd": bwd, "fwd_p2p": fwd_p2p, "bwd_p2p": bwd_p2p}


def variants(rank: int, world: int, payload: dict) -> dict:
    results = {name: run_case(*case) for name, case in payload["cases"].items()}
    cfg = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    q = torch.randn(1, SEQ // world, 4, 8, dtype=torch.float64)
    errors = {}
    for name, window in (("disagree", (3, 0) if rank == 0 else (4, 0)), ("bad_on_one", (-1, 0) if rank == 1 else None),
                         ("sinks_on_one", None), ("sinks_dtype", None)):
        sinks = torch.zeros(4, dtype=torch.float64) if name == "sinks_on_one" and rank == 0 else None
        if name == "sinks_dtype":                   # float64 on rank 0, float32 elsewhere: different softmaxes
            sinks = torch.zeros(4, dtype=torch.float64 if rank == 0 else torch.float32)
        try:
            ctx_plugin.cp_attention(q, q[:, :, :2], q[:, :, :2], config=cfg, groups=groups, window=window, sinks=sinks)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    return {"cases": results, "errors": errors}
