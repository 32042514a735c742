"""Rank-agreement work inside spawned ranks (see test_rank_agreement.py): ranks that disagree, ranks that agree."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

import ctx_plugin
import ctx_plugin.core.groups
from ctx_plugin.bench.counting import CommCounter
from tests.recompute_cases import train_step
from tests.reference import dense_with_grads, rel_err


def odd_rank(world: int) -> int:
    """The rank that differs: the last one at world 2, a middle one (2) at world 4."""
    return 1 if world == 2 else 2


def _cfg(backend: str = "zigzag", kernel: str = "torch", **kw) -> ctx_plugin.CPConfig:
    return ctx_plugin.CPConfig(backend=backend, kernel=kernel, **kw)


def _qkv(seq: int = 8, heads: int = 4, kv_heads: int = 2, dtype=torch.float64, grad: bool = True, dk: int = 8,
         dv: int = 8):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, seq, h, d, generator=g, dtype=dtype).requires_grad_(grad)
               for h, d in ((heads, dk), (kv_heads, dk), (kv_heads, dv)))
    return q, k, v


def _disagreeing_calls(rank: int, world: int) -> dict:
    """Per case, this rank's call: every rank but ``odd_rank`` makes the same call, that one differs."""
    odd = rank == odd_rank(world)
    # build_cp_groups is a collective (the ranks compare their configs first): every rank builds the groups of
    # every config any rank's call uses, in one order; the calls then differ
    groups_for = {cfg: ctx_plugin.build_cp_groups(cfg) for cfg in (
        _cfg(), _cfg("ring"), _cfg("ulysses"), _cfg(kernel="sdpa_cpu"))}

    def groups(cfg):
        return groups_for[cfg]

    def attention(cfg=None, *, causal=True, scale=None, sinks=None, softcap=None, **shape):
        cfg = cfg or _cfg()
        return lambda: ctx_plugin.cp_attention(*_qkv(**shape), config=cfg, groups=groups(cfg), causal=causal,
                                               softmax_scale=scale, sinks=sinks, softcap=softcap)

    def gather(seq):
        return lambda: ctx_plugin.gather_sequence(torch.randn(2, seq, 3), config=_cfg(), groups=groups(_cfg()))

    def either(same, other):
        return other if odd else same

    calls = {
        "short_local_seq": attention(seq=either(8, 4)),
        "invalid_local_seq": attention(seq=either(8, 3)),      # not a multiple of zigzag's 2 tokens per chunk pair
        "zigzag_vs_ring": attention(_cfg(either("zigzag", "ring"))),
        "ring_vs_ulysses": attention(_cfg(either("ring", "ulysses"))),
        "dtype": attention(dtype=either(torch.float32, torch.float64)),
        "causal": attention(causal=either(True, False)),
        "scale": attention(scale=either(None, 0.25)),
        "heads": attention(heads=either(4, 2)),
        "kv_heads": attention(kv_heads=either(2, 1)),
        # widths that differ between q/k and v are padded to one before the kernels: compared as given
        "head_dim": attention(dk=either(8, 4), scale=0.25),
        "v_head_dim": attention(dv=either(8, 4)),
        # an int past float's range: this rank's own check fails (not an OverflowError of its own)
        "huge_scale": attention(scale=either(0.25, 10 ** 400)),
        "huge_softcap": attention(softcap=either(5.0, 10 ** 400)),
        "double_backward": _backward(groups(_cfg()), create_graph=odd),
        "kernel": attention(_cfg(kernel=either("torch", "sdpa_cpu"))),
        "requires_grad": attention(grad=either(True, False)),
        # q, k, v need no gradient anywhere; the sinks on one rank only (its backward alone would communicate)
        "sinks_requires_grad": attention(grad=False, sinks=torch.zeros(4, dtype=torch.float64).requires_grad_(
            either(False, True))),
        "gather_local_len": gather(either(8, 4)),
        # configs building different subgroups: caught in build_cp_groups before any subgroup is created
        "groups_ulysses_size": lambda: ctx_plugin.build_cp_groups(_cfg("ulysses_ring", ulysses_size=either(
            world // 2, world))),
        "groups_check_ranks": lambda: ctx_plugin.build_cp_groups(_cfg(check_ranks=either(True, False))),
        "attention_vs_gather": either(attention(), gather(8)),
    }
    if world == 4:      # two ranks differ, in different fields: rank 1 in dtype, rank 3 in length
        calls["two_ranks_two_fields"] = attention(dtype=torch.float32 if rank == 1 else torch.float64,
                                                  seq=4 if rank == 3 else 8)
    return calls


def _backward(groups, *, create_graph: bool):
    """A forward every rank agrees on, then a backward with create_graph on some ranks only."""
    def call():
        q, k, v = _qkv()
        out = ctx_plugin.cp_attention(q, k, v, config=groups.config, groups=groups)
        out.sum().backward(create_graph=create_graph)
    return call


def outcome(call) -> dict:
    """``call()``'s error (type and message, None if it passed) and how long it took; then an all-reduce that would
    fail or hang if the call had left communication behind (``probe``: the world size)."""
    start = time.perf_counter()
    try:
        call()
        error = None
    except Exception as e:  # noqa: BLE001 - the parent asserts on the type and the text
        error = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - start
    probe = torch.ones(1)
    dist.all_reduce(probe)
    return {"error": error, "seconds": seconds, "probe": probe.item()}


def disagreements(rank: int, world: int, payload) -> dict:
    """Each case's error on this rank (type and message, None if it passed) and how long the call took; after
    each, an all-reduce that would fail or hang if the call had left communication behind."""
    out = {name: outcome(call) for name, call in _disagreeing_calls(rank, world).items()}
    out["nccl_like"] = _nccl_like(rank, world)
    return out


def _nccl_like(rank: int, world: int) -> dict:
    """A group whose backend cannot send CPU tensors (as NCCL): build_cp_groups makes a gloo group over the same
    ranks for the check (and none with check_ranks=False); the check then catches a disagreement on it."""
    original = ctx_plugin.core.groups._device_types
    ctx_plugin.core.groups._device_types = lambda group: frozenset({"cuda"})
    try:
        on = ctx_plugin.build_cp_groups(_cfg())
        off = ctx_plugin.build_cp_groups(_cfg(check_ranks=False))
    finally:
        ctx_plugin.core.groups._device_types = original
    object.__setattr__(on, "device_types", frozenset({"cpu"}))   # let this CPU test run the attention itself
    members = dist.get_process_group_ranks(on.check_group)
    try:
        ctx_plugin.cp_attention(*_qkv(seq=4 if rank == odd_rank(world) else 8), config=_cfg(), groups=on)
        error = None
    except ValueError as e:
        error = str(e)
    return {"own_group": on.check_group is not None and on.check_group is not on.group,
            "backend": dist.get_backend(on.check_group), "members": members, "off": off.check_group is None,
            "error": error}


def _counting(fn_name: str, calls: dict):
    original = getattr(dist, fn_name)

    def counted(*args, **kwargs):
        calls[fn_name] += 1
        return original(*args, **kwargs)

    return original, counted


def agreeing(rank: int, world: int, payload: dict) -> dict:
    """Ranks that agree: outputs and gradients equal (bitwise) with the check on and off and right against the
    float64 reference; per call, the check's collectives (real all-reduce / all-gather calls and the groups'
    counter) in forward and in backward; gather_sequence checked once per call."""
    seq = 8 * world
    full = _qkv(seq=seq, grad=False)
    dout = torch.randn(2, seq, 4, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref = dense_with_grads(*full, dout, causal=True)
    calls = {"all_reduce": 0, "all_gather": 0}
    wrapped = {name: _counting(name, calls) for name in calls}
    out = {}
    for backend, u in payload["configs"]:
        runs = {}
        for check in (True, False):
            cfg = _cfg(backend, ulysses_size=u, check_ranks=check)
            groups = ctx_plugin.build_cp_groups(cfg)
            shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups)  # noqa: E731
            q, k, v = (shard(t).requires_grad_(True) for t in full)
            for name, (_, counted) in wrapped.items():
                setattr(dist, name, counted)
            counter = CommCounter()
            try:
                calls.update(all_reduce=0, all_gather=0)
                with counter.counting():
                    o = ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups)
                fwd = {**calls, "counter": counter.counts.get("agree", 0)}
                calls.update(all_reduce=0, all_gather=0)
                o.backward(shard(dout))
                bwd = {**calls, "counter": counter.counts.get("agree", 0) - fwd["counter"]}
            finally:
                for name, (original, _) in wrapped.items():
                    setattr(dist, name, original)
            before = counter.counts.get("agree", 0)
            with counter.counting():
                got = [ctx_plugin.gather_sequence(t, config=cfg, groups=groups) for t in (o.detach(), q.grad, k.grad,
                                                                                           v.grad)]
            runs[check] = {"fwd": fwd, "bwd": bwd, "gather_checks": counter.counts.get("agree", 0) - before,
                           "got": got}
        on, off = runs[True], runs[False]
        out[f"{backend}-u{u}"] = {
            "same": all(torch.equal(a, b) for a, b in zip(on["got"], off["got"])),
            "err": max(rel_err(a, b) for a, b in zip(on["got"], ref)),
            **{f"{k}_{when}": runs[check][when] for k, check in (("on", True), ("off", False))
               for when in ("fwd", "bwd")},
            "gather_checks_on": on["gather_checks"], "gather_checks_off": off["gather_checks"]}
    return out


def replay(rank: int, world: int, payload: dict) -> dict:
    """Checks per training step of a 3-layer stack under recompute presets: once per attention call, none during
    a pinned replay, and again in backward under core_attn (which re-runs the attention on every rank)."""
    cfg = _cfg()
    groups = ctx_plugin.build_cp_groups(cfg)
    return {preset: {"agree": step["comm"].get("agree", 0), "runs": step["attention_runs"]}
            for preset in payload["presets"]
            for step in [train_step("gqa-gated", preset, cfg, groups, payload["seq"])]}


def everything(rank: int, world: int, payload: dict) -> dict:
    """One launch per world size: the disagreement cases, agreeing ranks, and (if asked) recompute replay."""
    out = {"disagree": disagreements(rank, world, None), "agree": agreeing(rank, world, payload)}
    if payload.get("presets"):
        out["replay"] = replay(rank, world, payload)
    return out
