"""The fused Triton merge on CUDA against the torch merge (fp32) and the float64 reference math.

Skipped without CUDA or triton. ``python -m pytest -q tests/gpu/test_merge_fused.py``; a micro-benchmark
(prints times, asserts nothing): ``python -m tests.gpu.test_merge_fused``.

Tolerances: the kernel computes in fp32 like the torch merge but its exp is ``ex2.approx`` of x·log2(e)
(≤ 2 ulp, plus the rounding of the product), where torch's CUDA exp is correctly rounded to ≤ 1 ulp. The
dominant weight of every row has an argument in [−log 2, 0], so its error stays ~1e-7; with the fp32 lse's
own half-ulp (|lse| ≲ 16: 4.8e-7) a merge is ~1e-6 off float64 and 1e-5 leaves ten times that (the CPU
interpreter test, tests/unit/test_merge_triton.py, holds 1.5e-6 with numpy's exp).
"""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.core import merge
from ctx_plugin.core.merge import merge_into, merge_into_fused, merge_into_torch
from tests.reference import rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OUT_TOL, LSE_TOL = 1e-5, 1e-5
LEAD, TAIL = 5, 11                # accumulator rows outside the merged slice
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _case(b, s, h, d, dtype, seed=0):
    """Strided accumulator slices of bigger buffers, a block in SDPA's transposed layout, and −inf rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *sh: torch.randn(*sh, generator=g, device="cuda")  # noqa: E731
    out_full, lse_full = mk(b, LEAD + s + TAIL, h, d), mk(b, h, LEAD + s + TAIL) * 4
    block_out, block_lse = mk(b, h, s, d).to(dtype).transpose(1, 2), mk(b, h, s) * 4
    rows = slice(LEAD, LEAD + s)
    old_empty = torch.rand(b, h, s, generator=g, device="cuda") < 0.1
    blk_empty = torch.rand(b, h, s, generator=g, device="cuda") < 0.1
    lse_full[:, :, rows].masked_fill_(old_empty, float("-inf"))
    out_full[:, rows].masked_fill_(old_empty.transpose(1, 2).unsqueeze(-1), 0.0)
    block_lse.masked_fill_(blk_empty, float("-inf"))
    return out_full, lse_full, block_out, block_lse, rows, old_empty, blk_empty


def _lse_err(got, want):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    return (got.double() - want.double())[finite].abs().max().item() if finite.any() else 0.0


@pytest.fixture(autouse=True)
def _need_triton():
    pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", DTYPES, ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(2, 37, 3, 80), (2, 1000, 8, 64), (1, 4096, 8, 128), (1, 515, 4, 256)],
                         ids=lambda sh: "x".join(map(str, sh)))
def test_fused_merge_matches_torch_merge(dtype, shape):
    out_full, lse_full, block_out, block_lse, rows, old_empty, blk_empty = _case(*shape, DTYPES[dtype])
    before_out, before_lse = out_full.clone(), lse_full.clone()
    out64, lse64 = out_full[:, rows].double(), lse_full[:, :, rows].double()
    merge_into_torch(out64, lse64, block_out.double(), block_lse.double())
    torch_out, torch_lse = out_full.clone(), lse_full.clone()
    merge_into_torch(torch_out[:, rows], torch_lse[:, :, rows], block_out, block_lse)

    merge_into_fused(out_full[:, rows], lse_full[:, :, rows], block_out, block_lse)
    out, lse = out_full[:, rows], lse_full[:, :, rows]
    assert rel_err(out, out64) < OUT_TOL and rel_err(out, torch_out[:, rows]) < OUT_TOL
    assert _lse_err(lse, lse64) < LSE_TOL and _lse_err(lse, torch_lse[:, :, rows]) < LSE_TOL
    assert not out.isnan().any() and not lse.isnan().any()
    outside = torch.ones(out_full.shape[1], dtype=torch.bool, device="cuda")
    outside[rows] = False
    assert torch.equal(out_full[:, outside], before_out[:, outside])
    assert torch.equal(lse_full[:, :, outside], before_lse[:, :, outside])
    # no keys on both sides: 0 and −inf; on one side: the other passes through bit-exact
    both, only_old, only_blk = old_empty & blk_empty, old_empty & ~blk_empty, blk_empty & ~old_empty
    rows_of = lambda x, m: x.transpose(1, 2)[m]  # noqa: E731  [B, S, H, D] rows selected by a [B, H, S] mask
    assert rows_of(out, both).eq(0).all() and torch.isneginf(lse[both]).all()
    assert torch.equal(rows_of(out, only_old), rows_of(block_out.float(), only_old))
    assert torch.equal(lse[only_old], block_lse[only_old])
    assert torch.equal(rows_of(out, only_blk), rows_of(before_out[:, rows], only_blk))
    assert torch.equal(lse[only_blk], before_lse[:, :, rows][only_blk])


def test_ring_of_merges_equals_attention_over_all_keys():
    """Eight key chunks merged like a ring (fused, through merge_into) equal one call over all keys."""
    from ctx_plugin.core.kernels import select_kernel
    from ctx_plugin.names import Kernel

    g = torch.Generator(device="cuda").manual_seed(1)
    b, s, h, d, chunks = 2, 256, 8, 128, 8
    q, k, v = (torch.randn(b, n, h, d, generator=g, device="cuda").bfloat16() for n in (s, s * chunks, s * chunks))
    kernel = select_kernel(Kernel.AUTO, q.device, q.dtype, d)
    want_out, want_lse = kernel.forward(q, k, v, causal=False, scale=d ** -0.5)
    out = torch.zeros(b, s, h, d, device="cuda")
    lse = torch.full((b, h, s), float("-inf"), device="cuda")
    for c in torch.randperm(chunks, generator=torch.Generator().manual_seed(0)).tolist():
        keys = slice(c * s, (c + 1) * s)
        merge_into(out, lse, *kernel.forward(q, k[:, keys], v[:, keys], causal=False, scale=d ** -0.5))
    assert rel_err(out, want_out.float()) < 2.5e-2           # bf16 block outputs (tests/gpu/test_kernels_gpu.py)
    assert (lse - want_lse).abs().max().item() < 1e-3


def test_merge_into_dispatch_on_cuda(monkeypatch):
    def refuse(*args):
        raise AssertionError("wrong merge path")

    out_full, lse_full, block_out, block_lse, rows, _, _ = _case(2, 37, 3, 64, torch.bfloat16)
    monkeypatch.setattr(merge, "merge_into_torch", refuse)
    merge_into(out_full[:, rows], lse_full[:, :, rows], block_out, block_lse)        # fp32: fused
    monkeypatch.undo()
    monkeypatch.setattr(merge, "merge_into_fused", refuse)
    merge_into(out_full.double()[:, rows], lse_full.double()[:, :, rows], block_out.double(),
               block_lse.double())                                                  # fp64: torch


def _benchmark() -> None:
    """Fused vs torch merge at ring-attention sizes (one zigzag half-block of a 128K-token sequence at P=8)."""
    for b, s, h, d in ((1, 8192, 32, 128), (1, 8192, 8, 128), (2, 4096, 16, 64)):
        out_full, lse_full, block_out, block_lse, rows, _, _ = _case(b, s, h, d, torch.bfloat16)
        out, lse = out_full[:, rows], lse_full[:, :, rows]
        moved = out.numel() * 4 * 2 + block_out.numel() * 2 + lse.numel() * 4 * 3
        for name, fn in (("fused", merge_into_fused), ("torch", merge_into_torch)):
            for _ in range(3):
                fn(out, lse, block_out, block_lse)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fn(out, lse, block_out, block_lse)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 20
            print(f"{name} B={b} S={s} H={h} D={d}: {ms * 1e3:8.1f} us, {moved / ms / 1e6:7.1f} GB/s (min traffic)")


if __name__ == "__main__":
    _benchmark()
