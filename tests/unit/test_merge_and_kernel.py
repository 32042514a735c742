"""Merging partial attention results, and the pure-torch kernel against autograd of dense attention."""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.core.kernels.sdpa import CpuFlashKernel
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.core.merge import merge_into
from tests.reference import dense_with_grads, rel_err

HEADS = [(4, 4), (4, 2), (4, 1)]


def _qkv(b=2, s=10, h=4, hkv=2, d=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(b, s, h, d), mk(b, s, hkv, d), mk(b, s, hkv, d), mk(b, s, h, d)


CPU_KERNELS = [TorchKernel(), CpuFlashKernel()]


def _prefix_reference(q, k, v, dout, scale):
    """Bottom-right causal reference: the queries are the last Sq positions of a length-Sk causal sequence."""
    sq, sk = q.shape[1], k.shape[1]
    pad = torch.zeros(q.shape[0], sk - sq, *q.shape[2:], dtype=q.dtype)
    out, dq, dk, dv = dense_with_grads(torch.cat((pad, q), 1), k, v, torch.cat((pad, dout), 1), causal=True,
                                       scale=scale)
    return out[:, sk - sq:], dq[:, sk - sq:], dk, dv


@pytest.mark.parametrize("kernel", CPU_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("h,hkv", HEADS)
@pytest.mark.parametrize("causal", [True, False])
def test_cpu_kernels_match_autograd(kernel, h, hkv, causal):
    q, k, v, dout = _qkv(h=h, hkv=hkv)
    out, lse = kernel.forward(q, k, v, causal=causal, scale=0.3)
    ref = dense_with_grads(q, k, v, dout, causal=causal, scale=0.3)
    assert rel_err(out, ref[0]) < 1e-12
    assert lse.shape == (2, h, 10) and lse.dtype == torch.float64
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=0.3)
    for got, want in zip(grads, ref[1:]):
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize("kernel", CPU_KERNELS, ids=lambda k: k.name)
def test_causal_with_more_keys_is_bottom_right_aligned(kernel):
    """A query chunk attending to the prefix that ends with it: one call, exact (the all-gather backend)."""
    q, _, _, dout = _qkv(s=6, h=4, hkv=2)
    _, k, v, _ = _qkv(s=15, h=4, hkv=2, seed=1)
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    want = _prefix_reference(q, k, v, dout, 0.3)
    assert rel_err(out, want[0]) < 1e-12
    for got, exp in zip(kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3), want[1:]):
        assert rel_err(got, exp) < 1e-12


def test_torch_kernel_lse_is_logsumexp_of_scores():
    q, k, v, _ = _qkv(h=2, hkv=2)
    _, lse = TorchKernel().forward(q, k, v, causal=False, scale=0.5)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)


def test_torch_kernel_half_precision_returns_fp32_lse():
    q, k, v, _ = _qkv(dtype=torch.bfloat16)
    out, lse = TorchKernel().forward(q, k, v, causal=True, scale=0.35)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


@pytest.mark.parametrize("kernel", CPU_KERNELS, ids=lambda k: k.name)
def test_causal_block_needs_as_many_keys_as_queries(kernel):
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        kernel.forward(q, k[:, :5], v[:, :5], causal=True, scale=1.0)


@pytest.mark.parametrize("splits", [[10], [3, 7], [1, 4, 5], [2, 2, 2, 2, 2]])
def test_merging_random_splits_equals_dense(splits):
    """Attention over key chunks merged in random order equals attention over all keys (out and lse)."""
    q, k, v, _ = _qkv(s=10, h=4, hkv=4)
    kernel = TorchKernel()
    want_out, want_lse = kernel.forward(q, k, v, causal=False, scale=0.4)
    bounds = torch.tensor([0, *splits]).cumsum(0).tolist()
    chunks = [slice(a, b) for a, b in zip(bounds, bounds[1:])]
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(len(splits))).tolist()
    out = torch.zeros_like(q)
    lse = torch.full(want_lse.shape, float("-inf"), dtype=torch.float64)
    for i in order:
        o_b, l_b = kernel.forward(q, k[:, chunks[i]], v[:, chunks[i]], causal=False, scale=0.4)
        merge_into(out, lse, o_b, l_b)
    assert rel_err(out, want_out) < 1e-13
    assert rel_err(lse, want_lse) < 1e-13


def test_merge_keeps_empty_rows_finite():
    out = torch.zeros(1, 3, 1, 2, dtype=torch.float64)
    lse = torch.full((1, 1, 3), float("-inf"), dtype=torch.float64)
    block_out = torch.ones(1, 3, 1, 2, dtype=torch.float64)
    block_lse = torch.tensor([[[0.0, float("-inf"), 1.0]]], dtype=torch.float64)
    merge_into(out, lse, block_out, block_lse)
    assert torch.isfinite(out).all()
    assert out[0, 1].abs().sum() == 0 and out[0, 0].eq(1).all()
    assert torch.isneginf(lse[0, 0, 1]) and lse[0, 0, 2] == 1.0
