"""FlashAttention-2's backward split over heads where its int32 dQ offsets would wrap (ctx_plugin.core.kernels.
head_chunks): when it splits, that every chunk's offsets fit (the kernel's offset arithmetic emulated in Python at
the sizes where it wraps), and that the split gives the same gradients (the torch kernel on CPU, float64; the
real FlashAttention-2 in tests/gpu/test_kernels_gpu.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ctx_plugin.core.kernels.head_chunks import by_head_chunks, fa2_head_chunk
from ctx_plugin.core.kernels.torch_math import TorchKernel


def test_when_the_offsets_wrap():
    # 32 heads of 128: rows rounded to 128, so 524,288 rows reach 2^31 exactly
    assert fa2_head_chunk(524_160, 32, 8, 128) is None
    assert fa2_head_chunk(524_161, 32, 8, 128) == 28      # rounded up to 524,288 rows: 31 heads fit, whole groups of 4
    assert fa2_head_chunk(4_000_000, 4, 1, 128) is None               # Ulysses' 4 heads a rank at 4M tokens: fits
    assert fa2_head_chunk(4_200_000, 4, 1, 128) == 2                  # 3 would fit: the largest divisor of the group
    assert fa2_head_chunk(6_000_000, 6, 1, 128) == 2 and fa2_head_chunk(9_000_000, 6, 1, 128) == 1
    assert fa2_head_chunk(100_000, 8, 8, 80) is None and fa2_head_chunk(2_000_000, 16, 16, 80) == 11  # d 80 → 96
    # varlen: all rows of the call, and 128 rows per sequence, join the offset
    assert fa2_head_chunk(524_160, 32, 8, 128, sequences=1) == 28
    assert fa2_head_chunk(524_160 - 128, 32, 8, 128, sequences=2) == 28 and fa2_head_chunk(500, 32, 8, 128, 4) is None
    # dense: every sequence of the batch, each rounded up to 128 rows
    assert fa2_head_chunk(131_072, 64, 8, 128, batch=4) == 24 and fa2_head_chunk(131_072, 64, 8, 128) is None
    assert fa2_head_chunk(1, 16, 16, 128, batch=8300) == 15 and fa2_head_chunk(1, 16, 16, 128, batch=8000) is None
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


# ---------------------------------------------------------------- the dQ accumulator's offsets as the GPU computes them
def _i32(x: int) -> int:
    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


# Per release line: head_size_rounded in flash_api.cpp's mha_bwd / mha_varlen_bwd (head sizes a multiple of 8 here),
# and whether flash_bwd_kernel.h adds the row part of the offset in 64 bits (2.8.0's 128ll, PR #1500).
RELEASES = {"2.3-2.5": (lambda d: _round_up(d, 32), False),
            "2.6-2.7": (lambda d: _round_up(d, 32) if d <= 192 else 256, False),
            "2.8": (lambda d: _round_up(d, 32 if d <= 128 else 64), True)}


def dq_offsets_wrap(seq_rows: list[int], heads: int, head_dim: int, varlen: bool) -> list[str]:
    """The FlashAttention-2 releases whose backward computes a wrong dQ-accumulator offset for one call over these
    query sequences (``seq_rows``: each sequence's rows; a dense call's are all equal) and ``heads`` query heads.
    The largest offset of each sequence, ``flash_bwd_kernel.h``'s ``binfo.q_offset(seqlen_q_rounded * h *
    d_rounded, h * d_rounded, bidb) + ((m_block_max - 1) * kBlockM + (varlen ? 128 * bidb : 0)) * h * d_rounded +
    bidh * d_rounded``, is evaluated in the kernel's integer types (``block_info.h``: ``bidb * batch_stride`` in
    int, or ``uint32_t(sum_s_q) * row_stride`` returned as int; the rest in int before 2.8.0 and in torch's copy,
    in 64 bits from 2.8.0) and compared with its true value, for kBlockM 64 and 128."""
    wrong = set()
    sequences = range(len(seq_rows)) if varlen else [len(seq_rows) - 1]   # dense: the last sequence's are largest
    for release, (rounding, wide) in RELEASES.items():
        d_r = rounding(head_dim)
        row_stride = heads * d_r
        for k_block_m, bidb in ((m, b) for m in (64, 128) for b in sequences):
            if varlen:
                prefix = sum(seq_rows[:bidb]) * row_stride
                q_offset = _i32(prefix % 2 ** 32)                                     # a uint32 product, as int
            else:
                prefix = bidb * _round_up(seq_rows[0], 128) * row_stride
                q_offset = _i32(bidb * _i32(_round_up(seq_rows[0], 128) * row_stride))
            rows = (-(-seq_rows[bidb] // k_block_m) - 1) * k_block_m + (128 * bidb if varlen else 0)
            true = prefix + rows * row_stride + (heads - 1) * d_r
            rest = rows * row_stride if wide else _i32(_i32(rows * heads) * d_r)
            got = q_offset + rest + (heads - 1) * d_r if wide else _i32(_i32(q_offset + rest) + (heads - 1) * d_r)
            if got != true:
                wrong.add(release)
    return sorted(wrong)


def chunk_sizes(heads: int, chunk: int | None) -> list[int]:
    """The query heads of each backward call :func:`~ctx_plugin.core.kernels.head_chunks.by_head_chunks` makes."""
    return [heads] if chunk is None else [min(chunk, heads - s) for s in range(0, heads, chunk)]


# (label, query rows of each sequence, heads, kv heads, head size, varlen): the audit's cases and one past 192
AT_SCALE = [("dense-8300x1", [1] * 8300, 16, 16, 128, False),
            ("dense-4x131072-gqa", [131_072] * 4, 64, 8, 128, False),
            ("dense-2x393216-gqa", [393_216] * 2, 32, 8, 128, False),
            ("varlen-528384-rows", [8192] * 62 + [16_384, 4096], 32, 8, 128, True),
            ("dense-1x700000-d200", [700_000], 16, 16, 200, False)]


@pytest.mark.parametrize("label,seq_rows,heads,kv_heads,head_dim,varlen", AT_SCALE, ids=[c[0] for c in AT_SCALE])
def test_every_chunk_keeps_the_dq_offsets_in_int32(label, seq_rows, heads, kv_heads, head_dim, varlen):
    """Each case wraps in one call over all heads; every call over the chunks fa2_head_chunk picks computes every
    offset right, on every FlashAttention-2 release (the rows of the whole call count: a dense call's batch, all of
    a varlen call's sequences)."""
    assert dq_offsets_wrap(seq_rows, heads, head_dim, varlen), "the case must wrap unchunked"
    if varlen:
        chunk = fa2_head_chunk(sum(seq_rows), heads, kv_heads, head_dim, sequences=len(seq_rows))
    else:
        chunk = fa2_head_chunk(seq_rows[0], heads, kv_heads, head_dim, batch=len(seq_rows))
    assert chunk is not None and chunk % (heads // kv_heads) == 0      # whole GQA groups here
    for size in set(chunk_sizes(heads, chunk)):
        assert not dq_offsets_wrap(seq_rows, size, head_dim, varlen), size


def _varlen_call(seq_rows: list[int]):
    """A varlen call of these query sequences, each with as many keys, not causal, no window."""
    from ctx_plugin.core.kernels.varlen import Varlen

    ends = np.cumsum([0, *seq_rows])
    return Varlen(np.stack([ends[:-1], ends[1:], ends[:-1], ends[1:]], axis=1), False, (None, None), len(seq_rows))


def meta_tensors(seq_rows: list[int], heads: int, kv_heads: int, head_dim: int, varlen: bool):
    """dout, q, k, v, out, lse of that size on the meta device (shapes only, no memory); dense ``[B, S, H, D]``."""
    meta = dict(device="meta", dtype=torch.bfloat16)
    lead = (sum(seq_rows),) if varlen else (len(seq_rows), seq_rows[0])
    q, out, dout = (torch.empty(*lead, heads, head_dim, **meta) for _ in range(3))
    k, v = (torch.empty(*lead, kv_heads, head_dim, **meta) for _ in range(2))
    lse_shape = (heads, lead[0]) if varlen else (lead[0], heads, lead[1])
    return dout, q, k, v, out, torch.empty(lse_shape, device="meta", dtype=torch.float32)


@pytest.mark.parametrize("label,seq_rows,heads,kv_heads,head_dim,varlen", AT_SCALE[:4],
                         ids=[c[0] for c in AT_SCALE[:4]])
def test_torch_flash_kernel_calls_keep_the_dq_offsets_in_int32(label, seq_rows, heads, kv_heads, head_dim, varlen):
    """torch's copy of FlashAttention-2 (``aten/src/ATen/native/transformers/cuda/flash_attn/flash_bwd_kernel.h``)
    computes the dQ offsets like flash-attn before 2.8, all in int: sdpa.FlashKernel's backward (dense and varlen),
    run on meta tensors at the sizes where one call wraps, calls the op on head chunks that all fit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ctx_plugin.core.kernels.sdpa import FlashKernel

    ops = (torch.ops.aten._scaled_dot_product_flash_attention_backward.default,
           torch.ops.aten._flash_attention_backward.default)
    heads_per_call = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in ops:                 # q: [B, H, S, D] (dense op) or [T, H, D] (varlen)
                heads_per_call.append(args[1].shape[1])
            return func(*args, **(kwargs or {}))

    tensors = meta_tensors(seq_rows, heads, kv_heads, head_dim, varlen)
    kernel = FlashKernel()
    with Record():
        if varlen:
            grads = kernel.backward_varlen(*tensors, _varlen_call(seq_rows), scale=0.1)
        else:
            grads = kernel.backward(*tensors, causal=False, scale=0.1)
    assert [g.shape for g in grads] == [t.shape for t in tensors[1:4]]
    assert sum(heads_per_call) == heads and len(heads_per_call) > 1
    for size in set(heads_per_call):
        assert not dq_offsets_wrap(seq_rows, size, head_dim, varlen), size
