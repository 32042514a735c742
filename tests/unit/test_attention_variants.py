"""Sliding windows, softcap and attention sinks on every backend, against the float64 dense reference.

The matrix runs the real ``cp_attention`` on simulated ranks (threads exchanging real tensors,
:mod:`ctx_plugin.bench.simulated`), so each case costs milliseconds: every backend × P ∈ {1, 2, 3, 4} (Ulysses
where the heads allow) × windows (none, smaller than a shard, between one and two shards, larger than the
sequence, left-only, left+right) × causal/non-causal × softcap and sinks (``VARIANTS``), GQA, outputs and
gradients including the sinks' (each rank's sinks.grad is its part; their sum is the reference's). The ring's
communication and kernel calls are counted per rank: a contiguous causal window of w tokens over shards of n
tokens takes ⌈w/n⌉ K/V transfers, not P − 1, and every ring layout (zigzag, striped too) moves K/V only along the
shortest arc of ring offsets the window's global mask needs. tests/distributed/test_attention_variants_ranks.py runs
a few of these cases on spawned gloo ranks.
"""
from __future__ import annotations

import math
import threading

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.bench.simulated import run_threaded, simulated_groups
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.core.layouts import shard_layout
from ctx_plugin.names import Backend

from ..reference import dense_with_grads, rel_err

SEQ, HEADS, KV_HEADS, DIM = 24, 4, 2, 8
# (P, ulysses_size) per backend: Ulysses needs P | heads; the hybrid needs u | P.
SIZES = {Backend.RING: [(1, 1), (2, 1), (3, 1), (4, 1)], Backend.ZIGZAG: [(1, 1), (2, 1), (3, 1), (4, 1)],
         Backend.STRIPED: [(1, 1), (2, 1), (3, 1), (4, 1)], Backend.ALLGATHER: [(1, 1), (2, 1), (3, 1), (4, 1)],
         Backend.ULYSSES: [(1, 1), (2, 1), (4, 1)], Backend.ULYSSES_RING: [(2, 2), (4, 2)]}
assert set(SIZES) == set(Backend)
# shards of SEQ / P ∈ {24, 12, 8, 6} tokens: 2 is smaller than every shard, 9 between one and two shards at P 4,
# 40 larger than the sequence; (5, None) left-only, (4, 3) left and right.
WINDOWS = [None, (2, 0), (9, 0), (40, 40), (5, None), (4, 3)]
# softcap and sinks both off and both on with every window; each one alone with two windows (~2/3 of the full
# product's time: the suite runs on 2 shared cores).
VARIANTS = [(w, c, s) for w in WINDOWS for c, s in ((None, False), (1.5, True))] + \
    [(w, c, s) for w in (None, (4, 3)) for c, s in ((1.5, False), (None, True))]
# a softmax_scale other than head_dim ** -0.5 (0.354 here) in the variants with these windows
SCALE, SCALED = 0.6, ((9, 0), (4, 3))
CASES = [(b, p, u, causal) for b, sizes in SIZES.items() for p, u in sizes for causal in (True, False)]


def _inputs(seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, SEQ, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(2, SEQ, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(2, SEQ, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    dout = torch.randn(2, SEQ, HEADS, DIM, generator=g, dtype=torch.float64)
    sinks = torch.randn(HEADS, generator=g, dtype=torch.float64) * 2
    return q, k, v, dout, sinks


def simulated_run(config, size: int, q, k, v, dout, *, causal: bool, sinks=None, **variants):
    """out, dq, dk, dv (whole sequence, original order), the sum of the ranks' sinks.grad, and per rank the
    communication counts and the number of kernel forward/backward calls."""
    layout = shard_layout(config)
    index = [layout.local_indices(SEQ, r, size) for r in range(size)]

    def rank_work(rank: int, world):
        groups = simulated_groups(config, rank, size, world, "cpu")
        local = [t.index_select(1, index[rank]).detach().requires_grad_(True) for t in (q, k, v)]
        own_sinks = None if sinks is None else sinks.detach().clone().requires_grad_(True)
        counter = CommCounter()
        with counter.counting():
            out = ctx_plugin.cp_attention(*local, config=config, groups=groups, causal=causal, sinks=own_sinks,
                                          **variants)
            out.backward(dout.index_select(1, index[rank]))
        grads = [t.grad for t in local]
        return out.detach(), grads, None if sinks is None else own_sinks.grad, dict(counter.counts)

    results = run_threaded(size, rank_work)
    full = [torch.empty_like(t) for t in (dout, q, k, v)]         # the output has dout's (v's) head_dim
    for rank, (out, grads, _, _) in enumerate(results):
        for whole, part in zip(full, (out, *grads)):
            whole[:, index[rank]] = part
    dsinks = None if sinks is None else sum(r[2] for r in results)
    return full, dsinks, [r[3] for r in results]


@pytest.mark.parametrize("backend,size,u,causal", CASES,
                         ids=[f"{b.value}-P{p}-u{u}-{'causal' if c else 'full'}" for b, p, u, c in CASES])
def test_variants_match_the_float64_reference(backend, size, u, causal):
    config = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    q, k, v, dout, sinks = _inputs()
    for window, softcap, with_sinks in VARIANTS:
        s = sinks if with_sinks else None
        scale = SCALE if window in SCALED else None          # None: head_dim ** -0.5
        got, dsinks, _ = simulated_run(config, size, q, k, v, dout, causal=causal, window=window, softcap=softcap,
                                       sinks=s, softmax_scale=scale)
        want = dense_with_grads(q, k, v, dout, causal=causal, scale=scale, window=window, softcap=softcap, sinks=s)
        what = f"window={window} softcap={softcap} sinks={with_sinks} softmax_scale={scale}"
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert rel_err(g, w) < 1e-10, f"{what}: {name} relative error {rel_err(g, w):.2e}"
        if with_sinks:
            assert rel_err(dsinks, want[4]) < 1e-10, f"{what}: dsinks relative error {rel_err(dsinks, want[4]):.2e}"


@pytest.mark.parametrize("backend,size,u", [(b, p, u) for b, sizes in SIZES.items() for p, u in sizes if p > 1],
                         ids=[f"{b.value}-P{p}-u{u}" for b, sizes in SIZES.items() for p, u in sizes if p > 1])
def test_values_of_another_width_match_the_float64_reference(backend, size, u):
    """Values narrower (multi-latent attention) and wider than queries and keys, with a window and sinks: the output
    has v's head_dim, the default scale is q's."""
    config = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    q, k, _, _, sinks = _inputs()
    g = torch.Generator().manual_seed(3)
    for width in (DIM - 3, DIM + 4):
        v = torch.randn(2, SEQ, KV_HEADS, width, generator=g, dtype=torch.float64)
        dout = torch.randn(2, SEQ, HEADS, width, generator=g, dtype=torch.float64)
        got, dsinks, _ = simulated_run(config, size, q, k, v, dout, causal=True, window=(9, 0), sinks=sinks)
        want = dense_with_grads(q, k, v, dout, causal=True, window=(9, 0), sinks=sinks)
        for name, have, w in zip(("out", "dq", "dk", "dv", "dsinks"), (*got, dsinks), want):
            assert have.shape == w.shape and rel_err(have, w) < 1e-10, f"v width {width}: {name}"


@pytest.fixture
def kernel_calls(monkeypatch):
    """Kernel forward/backward calls per simulated rank (thread)."""
    calls: dict = {}
    fwd, bwd = TorchKernel.forward, TorchKernel.backward

    def count(kind, fn):
        def wrapper(self, *args, **kwargs):
            key = (threading.current_thread().name, kind)
            calls[key] = calls.get(key, 0) + 1
            return fn(self, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(TorchKernel, "forward", count("forward", fwd))
    monkeypatch.setattr(TorchKernel, "backward", count("backward", bwd))
    return calls


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("w", [1, 6, 7, 13, 30])
def test_contiguous_causal_window_counts(kernel_calls, size, w):
    """Per rank: ⌈w/n⌉ K/V transfers in forward and in backward (instead of P − 1), ⌈w/n⌉ dK/dV hops plus the
    one home (P over the full ring); one kernel call per shard the rank's window reaches (from the global mask)."""
    config = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    q, k, v, dout, _ = _inputs()
    n = SEQ // size
    _, _, counts = simulated_run(config, size, q, k, v, dout, causal=True, window=(w, 0))
    back = min(math.ceil(w / n), size - 1)
    pos = torch.arange(SEQ)
    allowed = (pos[None, :] <= pos[:, None]) & (pos[None, :] >= pos[:, None] - w)
    for rank, c in enumerate(counts):
        assert c.get("ring_kv", 0) == 2 * back, (rank, c)
        assert c.get("ring_dkv", 0) == (back + 1 if back else 0), (rank, c)
    shards = [sum(bool(allowed[r * n:(r + 1) * n, s * n:(s + 1) * n].any()) for s in range(size))
              for r in range(size)]
    by_thread = sorted({name for name, _ in kernel_calls})
    assert len(by_thread) == size
    got = sorted(kernel_calls[(name, "forward")] for name in by_thread)
    assert got == sorted(shards)
    assert sorted(kernel_calls[(name, "backward")] for name in by_thread) == sorted(shards)


def _shortest_arc(config, size: int, causal: bool, window) -> int:
    """K/V transfers per pass the global mask requires: the offsets d (rank r computes on the K/V of rank
    (r - d) mod P) at which some rank has a query that sees a key of that shard, covered by the cheapest arc
    [lo, hi] ∋ 0 of ring steps (a start ahead, lo < 0, is one direct fetch first), at most the full ring's P − 1."""
    index = [shard_layout(config).local_indices(SEQ, r, size) for r in range(size)]
    pos = torch.arange(SEQ)
    left, right = window
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool)
    if causal:
        allowed &= pos[None, :] <= pos[:, None]
    if left is not None:
        allowed &= pos[None, :] >= pos[:, None] - left
    if right is not None:
        allowed &= pos[None, :] <= pos[:, None] + right
    needed = {(r - s) % size for r in range(size) for s in range(size) if allowed[index[r]][:, index[s]].any()}
    arcs = [(hi - lo) + (lo != 0) for lo in range(1 - size, 1) for hi in range(size) if hi - lo < size
            and needed <= {d % size for d in range(lo, hi + 1)}]
    return min([size - 1, *arcs])


LAYOUT_WINDOWS = [(b, p, c, w) for b in (Backend.RING, Backend.ZIGZAG, Backend.STRIPED) for p in (3, 4)
                  for c in (True, False) for w in ((2, 0), (7, 0), (3, 3), (2, 5))]


@pytest.mark.parametrize("backend,size,causal,window", LAYOUT_WINDOWS,
                         ids=[f"{b.value}-P{p}-{'causal' if c else 'full'}-{w}" for b, p, c, w in LAYOUT_WINDOWS])
def test_ring_layouts_transfer_only_what_the_window_needs(backend, size, causal, window):
    """Every ring layout (contiguous, zigzag, striped) moves K/V only along the shortest arc of ring offsets the
    window's global mask needs, worked out here from the layout's own token indices: zigzag's late chunk needs the
    next rank, so even a small window costs it transfers both ways; striped needs every shard once the window
    reaches P − 1 tokens back (the README's advice: ring for windowed models)."""
    config = ctx_plugin.CPConfig(backend=backend, kernel="torch")
    q, k, v, dout, _ = _inputs()
    _, _, counts = simulated_run(config, size, q, k, v, dout, causal=causal, window=window)
    want = _shortest_arc(config, size, causal, window)
    for rank, c in enumerate(counts):
        assert c.get("ring_kv", 0) == 2 * want, (rank, c, want)     # forward and backward each
    if backend == Backend.RING and window == (2, 0):
        assert want == 1 < size - 1                                    # the window saves transfers


def test_bad_variant_arguments_are_refused_before_anything_runs():
    config = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    groups = ctx_plugin.build_cp_groups(config)
    q, k, v, _, sinks = _inputs()
    call = lambda **kw: ctx_plugin.cp_attention(q, k, v, config=config, groups=groups, **kw)  # noqa: E731
    for kwargs, error, text in (
            ({"window": (-1, 0)}, ValueError, "window left must be None"),
            ({"window": (2, 1.5)}, TypeError, "window right must be None"),
            ({"window": 3}, TypeError, "window must be None or a"),
            ({"softcap": 0.0}, ValueError, "softcap must be"),
            ({"sinks": sinks[:3]}, ValueError, r"sinks must have shape \[heads\] = \(4,\)"),
            ({"sinks": sinks.long()}, TypeError, "floating-point"),
            ({"sinks": [0.0] * 4}, TypeError, "sinks must be None or a floating-point tensor"),
            ({"sinks": sinks.to("meta")}, ValueError, "q's device")):
        with pytest.raises(error, match=text):
            call(**kwargs)
    sdpa = ctx_plugin.CPConfig(backend="ring", kernel="sdpa_cpu")
    sdpa_groups = ctx_plugin.build_cp_groups(sdpa)
    with pytest.raises(ValueError, match="window"):
        ctx_plugin.cp_attention(q, k, v, config=sdpa, groups=sdpa_groups, window=(3, 0))
    # a window longer than the sequence is no window: the sdpa kernel runs it (same as without one)
    want = ctx_plugin.cp_attention(q, k, v, config=sdpa, groups=sdpa_groups)
    assert torch.equal(ctx_plugin.cp_attention(q, k, v, config=sdpa, groups=sdpa_groups, window=(SEQ, 0)), want)
