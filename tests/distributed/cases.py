"""Work run inside spawned ranks (see harness.py). Each function returns JSON-able results for the parent."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.names import Backend
from tests.reference import dense_with_grads, rel_err

RING_BACKENDS = (Backend.RING, Backend.ZIGZAG, Backend.STRIPED)
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
KERNELS = ("torch", "sdpa_cpu")


def case_id(backend: str, causal: bool, heads: str, dtype: str, kernel: str = "torch", ulysses_size: int = 1) -> str:
    hybrid = f"u{ulysses_size}-" if backend == Backend.ULYSSES_RING else ""
    return f"{backend}-{hybrid}{'causal' if causal else 'full'}-{heads}-{dtype}-{kernel}"


def _inputs(seq: int, heads: str, seed: int, batch: int = 2, dim: int = 16):
    h, hkv = HEADS[heads]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, h, dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, hkv, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, hkv, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, h, dim, generator=g, dtype=torch.float64)
    return q, k, v, dout


def sharded_run(cfg, groups, q, k, v, dout, causal: bool, dtype: torch.dtype):
    """cp_attention on this rank's shards; returns the gathered (out, dq, dk, dv) in original order."""
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    ql, kl, vl = (shard(t).to(dtype).requires_grad_(True) for t in (q, k, v))
    out = ctx_plugin.cp_attention(ql, kl, vl, config=cfg, groups=groups, causal=causal)
    out.backward(shard(dout).to(dtype))
    local = (out.detach(), ql.grad, kl.grad, vl.grad)
    return [ctx_plugin.gather_sequence(t, config=cfg, groups=groups, dim=1) for t in local], local


def run_case(cfg, groups, causal: bool, heads: str, dtype_name: str, seq: int, seed: int) -> dict:
    """Sharded forward+backward vs. the float64 dense reference; relative errors of out, dq, dk, dv."""
    q, k, v, dout = _inputs(seq, heads, seed)
    dtype = DTYPES[dtype_name]
    got, local = sharded_run(cfg, groups, q, k, v, dout, causal, dtype)
    ref = dense_with_grads(q, k, v, dout, causal=causal)
    errors = {name: rel_err(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)}
    return {**errors, "dtypes_ok": all(t.dtype == dtype for t in local),
            "shapes_ok": [tuple(t.shape) for t in local] == [(t.shape[0], seq // groups.size, *t.shape[2:])
                                                             for t in (q, q, k, k)]}


def attention_matrix(rank: int, world: int, payload: dict) -> dict:
    """Runs every case of ``payload["cases"]`` (backend, ulysses_size, causal, heads, dtype, kernel)."""
    results, groups_for = {}, {}
    for backend, u, causal, heads, dtype, kernel in payload["cases"]:
        cfg = ctx_plugin.CPConfig(backend=backend, kernel=kernel, ulysses_size=u)
        if cfg not in groups_for:      # build each config's groups once (the hybrid creates subgroups)
            groups_for[cfg] = ctx_plugin.build_cp_groups(cfg)
        results[case_id(backend, causal, heads, dtype, kernel, u)] = run_case(
            cfg, groups_for[cfg], causal, heads, dtype, payload["seq"], payload["seed"])
    return results


def hybrid_reduces(rank: int, world: int, payload) -> dict:
    """ulysses_ring with u = 1 and u = P against plain zigzag and plain ulysses: identical numbers."""
    q, k, v, dout = _inputs(payload["seq"], "gqa", 3)
    runs = {}
    for name, cfg in {"u1": ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=1, kernel="torch"),
                      "zigzag": ctx_plugin.CPConfig(backend="zigzag", kernel="torch"),
                      "uP": ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=world, kernel="torch"),
                      "ulysses": ctx_plugin.CPConfig(backend="ulysses", kernel="torch")}.items():
        runs[name] = sharded_run(cfg, ctx_plugin.build_cp_groups(cfg), q, k, v, dout, True, torch.float64)[0]
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(runs[a], runs[b]))  # noqa: E731
    return {"u1_is_zigzag": same("u1", "zigzag"), "uP_is_ulysses": same("uP", "ulysses")}


def count_exchanges(rank: int, world: int, payload: dict) -> dict:
    """Communication per backend in forward and in backward: the groups' counter, and the real batched
    point-to-point calls (counted by wrapping torch.distributed.batch_isend_irecv)."""
    with counted_p2p() as calls:
        result = {}
        for backend, u in payload["configs"]:
            cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
            groups = ctx_plugin.build_cp_groups(cfg)
            q = torch.randn(1, 4, 4, 8, requires_grad=True)
            kv = torch.randn(1, 4, 2, 8, requires_grad=True)
            calls["n"] = 0
            with CommCounter().counting() as counter:
                out = ctx_plugin.cp_attention(q, kv, kv, config=cfg, groups=groups)
            fwd_calls, fwd_counts = calls["n"], dict(counter.counts)
            counter.reset()
            out.sum().backward()        # outside the context: counted by the counter active at the forward
            result[f"{backend}-u{u}"] = {"fwd_p2p": fwd_calls, "fwd": fwd_counts, "bwd_p2p": calls["n"] - fwd_calls,
                                         "bwd": dict(counter.counts)}
    return result


def bad_inputs(rank: int, world: int, payload) -> dict:
    """Each bad call's error (type and message) on this rank; communication must not have started."""
    zig = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    zig_groups = ctx_plugin.build_cp_groups(zig)
    ring_groups = ctx_plugin.build_cp_groups(ctx_plugin.CPConfig(backend="ring", kernel="torch"))
    uly = ctx_plugin.CPConfig(backend="ulysses", kernel="torch")
    uly_groups = ctx_plugin.build_cp_groups(uly)
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
        "meta_documents_on_one_rank": lambda: ctx_plugin.cp_attention(
            q, kv, kv, config=zig, groups=zig_groups,
            documents=torch.tensor([0, 6, 4 * world], device="meta" if rank == 1 else "cpu")),
        "ulysses_heads": lambda: ctx_plugin.cp_attention(q[:, :, :2], kv[:, :, :2], kv[:, :, :2], config=uly,
                                                         groups=uly_groups),
        "ulysses_kv_heads": lambda: ctx_plugin.cp_attention(torch.randn(1, 4, 6, 8), torch.randn(1, 4, 2, 8),
                                                            torch.randn(1, 4, 2, 8), config=uly, groups=uly_groups),
        "ulysses_size_not_dividing": lambda: ctx_plugin.build_cp_groups(
            ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=2)),
    }
    errors = {}
    with CommCounter().counting() as counter:
        for name, call in calls.items():
            try:
                call()
                errors[name] = None
            except (ValueError, TypeError) as e:
                errors[name] = f"{type(e).__name__}: {e}"
    # Only the ranks' agreement on each call (agreement.py: metadata, no data) may have communicated.
    counts = list(counter.counts.items())
    started = {k: v for k, v in counts if k != "agree"}
    probe = torch.ones(1)
    dist.all_reduce(probe)   # would hang or fail if a bad call had left a request behind
    return {"errors": errors, "started": started, "agreed": sum(v for k, v in counts if k == "agree"),
            "probe": probe.item()}


def sharding_helpers(rank: int, world: int, payload) -> dict:
    """Positions, shard→gather round trips and gather_sequence's gradient, for every ring backend."""
    out = {}
    for backend, u in payload["configs"]:
        cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u)
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
        out[f"{backend}-u{u}"] = {"positions_roundtrip": gathered_pos.flatten().tolist() == list(range(seq)),
                        "positions_are_layout": pos.tolist() == x_local.new_tensor(
                            ctx_plugin.core.layouts.shard_layout(cfg).local_indices(seq, rank, world)).long().tolist(),
                        "gather_roundtrip": torch.equal(full.detach(), x),
                        "gather_grad": torch.equal(x_local.grad, want_grad)}
    return out


def saved_tensors(rank: int, world: int, payload) -> dict:
    """Shapes of what autograd keeps from one cp_attention forward (GQA inputs)."""
    out = {}
    for backend, u in payload["configs"]:
        cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
        groups = ctx_plugin.build_cp_groups(cfg)
        q = torch.randn(2, 8, 8, 16, requires_grad=True)
        k = torch.randn(2, 8, payload["kv_heads"], 16, requires_grad=True)
        v = torch.randn(2, 8, payload["kv_heads"], 16, requires_grad=True)
        saved = []

        def pack(t):
            saved.append(list(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups)
        out[f"{backend}-u{u}"] = saved
    return out


@contextmanager
def counted_p2p():
    """Counts the real batched point-to-point calls (wraps torch.distributed.batch_isend_irecv); yields {"n": count}."""
    calls = {"n": 0}
    original = dist.batch_isend_irecv

    def counting(ops):
        calls["n"] += 1
        return original(ops)

    dist.batch_isend_irecv = counting
    try:
        yield calls
    finally:
        dist.batch_isend_irecv = original
