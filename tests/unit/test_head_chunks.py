"""FlashAttention-2's backward split over heads where its int32 dQ offsets would wrap (ctx_plugin.core.kernels.
head_chunks): when it splits, and that the split gives the same gradients (the torch kernel on CPU, float64; the
real FlashAttention-2 in tests/gpu/test_kernels_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.core.kernels.head_chunks import by_head_chunks, fa2_head_chunk
from ctx_plugin.core.kernels.torch_math import TorchKernel


def test_when_the_offsets_wrap():
    # 32 heads of 128: rows rounded to 128, so 524,288 rows reach 2^31 exactly
    assert fa2_head_chunk(524_160, 32, 8, 128) is None
    assert fa2_head_chunk(524_161, 32, 8, 128) == 28            # rounded up to 524,288 rows: 31 heads fit, whole groups of 4
    assert fa2_head_chunk(4_000_000, 4, 1, 128) is None               # Ulysses' 4 heads a rank at 4M tokens: fits
    assert fa2_head_chunk(4_200_000, 4, 1, 128) == 2                  # 3 would fit: the largest divisor of the group
    assert fa2_head_chunk(6_000_000, 6, 1, 128) == 2 and fa2_head_chunk(9_000_000, 6, 1, 128) == 1
    assert fa2_head_chunk(100_000, 8, 8, 80) is None and fa2_head_chunk(2_000_000, 16, 16, 80) == 11  # d 80 → 96
    # varlen: 128 rows per sequence join the offset
    assert fa2_head_chunk(524_160, 32, 8, 128, sequences=1) == 28
    with pytest.raises(ValueError, match="exceed FlashAttention-2's 32-bit indexing even for one head"):
        fa2_head_chunk(17_000_000, 4, 1, 128)


@pytest.mark.parametrize("heads,kv_heads,chunk", [(8, 2, 4), (8, 2, 2), (8, 2, 1), (6, 6, 4), (6, 3, 2)])
def test_chunks_give_the_same_gradients(heads, kv_heads, chunk):
    torch.manual_seed(0)
    q = torch.randn(2, 24, heads, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 40, kv_heads, 8, dtype=torch.float64) for _ in range(2))
    kernel = TorchKernel()
    out, lse = kernel.forward(q, k, v, causal=True, scale=0.3)
    dout = torch.randn_like(out)
    want = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=0.3)
    got = by_head_chunks(lambda *t: kernel.backward(*t, causal=True, scale=0.3), chunk, dout, q, k, v, out, lse,
                         head_dim=2, lse_head_dim=1)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
