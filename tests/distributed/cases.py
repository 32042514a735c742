"""Work run inside spawned ranks (see harness.py). Each function returns JSON-able results for the parent."""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import ctx_plugin
from ctx_plugin.names import Backend
from tests.reference import dense_with_grads, rel_err

RING_BACKENDS = (Backend.RING, Backend.ZIGZAG, Backend.STRIPED)
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
DTYPES = {"float64": torch.float64, "float32": torch.float32}


def case_id(backend: str, causal: bool, heads: str, dtype: str) -> str:
    return f"{backend}-{'causal' if causal else 'full'}-{heads}-{dtype}"


def _inputs(seq: int, heads: str, dtype: torch.dtype, seed: int, batch: int = 2, dim: int = 16):
    h, hkv = HEADS[heads]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, h, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, hkv, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, hkv, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, h, dim, generator=g, dtype=torch.float64)
    return q, k, v, dout, dtype


def run_case(backend: str, causal: bool, heads: str, dtype_name: str, seq: int, seed: int) -> dict:
    """Sharded forward+backward vs. the float64 dense reference; relative errors of out, dq, dk, dv."""
    q, k, v, dout, dtype = _inputs(seq, heads, DTYPES[dtype_name], seed)
    cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    gather = lambda t: ctx_plugin.gather_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    ql, kl, vl = (shard(t).to(dtype).requires_grad_(True) for t in (q, k, v))
    out = ctx_plugin.cp_attention(ql, kl, vl, config=cfg, groups=groups, causal=causal)
    out.backward(shard(dout).to(dtype))
    ref = dense_with_grads(q, k, v, dout, causal=causal)
    got = [gather(t.detach()) for t in (out, ql.grad, kl.grad, vl.grad)]
    dtypes_ok = all(t.dtype == dtype for t in (out, ql.grad, kl.grad, vl.grad))
    return {"out": rel_err(got[0], ref[0]), "dq": rel_err(got[1], ref[1]), "dk": rel_err(got[2], ref[2]),
            "dv": rel_err(got[3], ref[3]), "dtypes_ok": dtypes_ok}


def attention_matrix(rank: int, world: int, payload: dict) -> dict:
    """Every ring backend × causal × head layout × dtype, at this world size."""
    results = {}
    for backend, causal, heads, dtype in itertools.product(RING_BACKENDS, (True, False), HEADS, DTYPES):
        results[case_id(backend, causal, heads, dtype)] = run_case(backend, causal, heads, dtype,
                                                                   payload["seq"], payload["seed"])
    return results


def count_exchanges(rank: int, world: int, payload: dict) -> dict:
    """Counts real batch_isend_irecv calls and the groups' counter in forward and in backward."""
    calls = {"n": 0}
    original = dist.batch_isend_irecv

    def counting(ops):
        calls["n"] += 1
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        result = {}
        for backend in RING_BACKENDS:
            cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
            groups = ctx_plugin.build_cp_groups(cfg)
            q = torch.randn(1, 4, 2, 8, requires_grad=True)
            calls["n"] = 0
            out = ctx_plugin.cp_attention(q, q, q, config=cfg, groups=groups)
            fwd_calls, fwd_counts = calls["n"], dict(groups.counter.counts)
            groups.counter.reset()
            out.sum().backward()
            result[backend] = {"fwd_calls": fwd_calls, "fwd_counts": fwd_counts, "bwd_calls": calls["n"] - fwd_calls,
                               "bwd_counts": dict(groups.counter.counts)}
        return result
    finally:
        dist.batch_isend_irecv = original


def bad_inputs(rank: int, world: int, payload) -> dict:
    """Each bad call's error (type and message) on this rank; communication must not have started."""
    zig = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    zig_groups = ctx_plugin.build_cp_groups(zig)
    ring_groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(backend="ring", kernel="torch"))
    q = torch.randn(1, 4, 4, 8)
    kv = torch.randn(1, 4, 2, 8)
    calls = {
        "odd_zigzag_shard": lambda: ctx_plugin.cp_attention(q[:, :3], kv[:, :3], kv[:, :3], config=zig,
                                                            groups=zig_groups),
        "global_len_not_divisible": lambda: ctx_plugin.shard_sequence(torch.randn(1, 2 * world + 2), config=zig,
                                                                      groups=zig_groups),
        "heads": lambda: ctx_plugin.cp_attention(q[:, :, :3], kv, kv, config=zig, groups=zig_groups),
        "other_config": lambda: ctx_plugin.cp_attention(q, kv, kv, config=zig, groups=ring_groups),
        "device_not_served": lambda: ctx_plugin.cp_attention(q.to("meta"), kv.to("meta"), kv.to("meta"),
                                                             config=zig, groups=zig_groups),
        "gather_device_not_served": lambda: ctx_plugin.gather_sequence(q.to("meta"), config=zig,
                                                                       groups=zig_groups),
    }
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except (ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"
    started = dict(zig_groups.counter.counts) or dict(ring_groups.counter.counts)
    probe = torch.ones(1)
    dist.all_reduce(probe)   # would hang or fail if a bad call had left a request behind
    return {"errors": errors, "started": started, "probe": probe.item()}


def sharding_helpers(rank: int, world: int, payload) -> dict:
    """Positions, shard→gather round trips and gather_sequence's gradient, for every ring backend."""
    out = {}
    for backend in RING_BACKENDS:
        cfg = ctx_plugin.CPConfig(backend=backend)
        groups = ctx_plugin.build_cp_groups(cfg)
        seq = 12 * world
        pos = ctx_plugin.sequence_positions(seq, config=cfg, groups=groups)
        gathered_pos = ctx_plugin.gather_sequence(pos.view(1, -1), config=cfg, groups=groups)
        x = torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(5))
        x_local = ctx_plugin.shard_sequence(x, config=cfg, groups=groups).requires_grad_(True)
        full = ctx_plugin.gather_sequence(x_local, config=cfg, groups=groups)
        weight = torch.arange(full.numel(), dtype=full.dtype).view_as(full)
        (full * weight).sum().backward()
        # every rank computed the same objective on the gathered tensor: the gradient of the sum over ranks
        want_grad = world * ctx_plugin.shard_sequence(weight, config=cfg, groups=groups)
        out[backend] = {"positions_roundtrip": gathered_pos.flatten().tolist() == list(range(seq)),
                        "positions_are_layout": pos.tolist() == x_local.new_tensor(
                            ctx_plugin.layouts.layout_for(backend).local_indices(seq, rank, world)).long().tolist(),
                        "gather_roundtrip": torch.equal(full.detach(), x),
                        "gather_grad": torch.equal(x_local.grad, want_grad)}
    return out
