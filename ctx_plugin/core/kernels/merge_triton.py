"""Fused single-pass merge of a partial attention result into fp32 accumulators (Triton).

The same math as :func:`ctx_plugin.core.merge.merge_into_torch` in one kernel: each program reads ``BLOCK_S``
rows of one (batch, head) of the old ``lse`` and the block's ``lse``, computes the new ``lse`` and both
weights in registers, then reads those rows of ``out`` and ``block_out`` over the whole head dim, and
writes ``out`` and ``lse`` back in place. Every tensor is addressed through its strides, so the slices
``out[:, a:b]`` / ``lse[:, :, a:b]`` the ring passes are updated without copies. Grid:
``(cdiv(S, BLOCK_S), H, B)`` (the sequence on axis 0, which has no 65535 limit)::

    out  [B, S, H, D]   tile = rows s0..s0+BLOCK_S of head h   (each row: D contiguous values)
    lse  [B, H, S]      tile = lse[b, h, s0:s0+BLOCK_S]         (contiguous)

Importing this module imports triton; :mod:`ctx_plugin.core.merge` imports it only when a merge can use it.
Under ``TRITON_INTERPRET=1`` (set before this import) the kernel also runs on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 4096
"""Elements of one ``[BLOCK_S, BLOCK_D]`` tile: 16 KiB of fp32 ``out`` per program."""
NUM_WARPS = 4
"""Warps per program (32 tile elements per thread); a bandwidth-bound kernel needs no more."""


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small x without libdevice (Goldberg's trick): with u = fl(1 + x),
    # log(u) · x / (u − 1) cancels the rounding of 1 + x. u == 1 means x is below half an ulp of 1.
    u = 1.0 + x
    den = tl.where(u == 1.0, 1.0, u - 1.0)
    return tl.where(u == 1.0, x, tl.log(u) * (x / den))


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, blk_ptr, blk_lse_ptr, S,
                  so_b, so_s, so_h, so_d,
                  sl_b, sl_h, sl_s,
                  sb_b, sb_s, sb_h, sb_d,
                  sbl_b, sbl_h, sbl_s,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # D is a compile-time constant so the column mask never blocks vectorised (16-byte) row accesses.
    # int64 indices: B·S·H·D of a long-context accumulator can pass 2**31 elements.
    s0 = tl.program_id(0).to(tl.int64) * BLOCK_S
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    rows = s0 + tl.arange(0, BLOCK_S)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < S

    lse_at = lse_ptr + b * sl_b + h * sl_h + rows * sl_s
    old = tl.load(lse_at, mask=row_ok, other=0.0).to(tl.float32)
    new_blk = tl.load(blk_lse_ptr + b * sbl_b + h * sbl_h + rows * sbl_s, mask=row_ok, other=0.0).to(tl.float32)

    # logaddexp as torch computes it: max + log1p(exp(min − max)); a −inf side adds exactly 0, so one −inf
    # side passes the other through unchanged and two −inf sides give −inf (never −inf − (−inf) = NaN).
    hi = tl.maximum(old, new_blk)
    lo = tl.minimum(old, new_blk)
    lse_new = hi + _log1p(tl.exp(lo - tl.where(hi == float("-inf"), 0.0, hi)))
    ref = tl.where(lse_new == float("-inf"), 0.0, lse_new)      # rows with no keys yet: weights exp(−inf) = 0
    w_old = tl.exp(old - ref)
    w_blk = tl.exp(new_blk - ref)

    tile_ok = row_ok[:, None] & (cols[None, :] < D)
    out_at = out_ptr + b * so_b + h * so_h + rows[:, None] * so_s + cols[None, :] * so_d
    blk_at = blk_ptr + b * sb_b + h * sb_h + rows[:, None] * sb_s + cols[None, :] * sb_d
    acc = tl.load(out_at, mask=tile_ok, other=0.0)
    part = tl.load(blk_at, mask=tile_ok, other=0.0).to(tl.float32)
    tl.store(out_at, acc * w_old[:, None] + part * w_blk[:, None], mask=tile_ok)
    tl.store(lse_at, lse_new, mask=row_ok)


def block_sizes(head_dim: int) -> tuple[int, int]:
    """``(BLOCK_S, BLOCK_D)`` for a head dim: the whole (power-of-two padded) head dim per row, and as many
    rows as fit :data:`TILE_ELEMENTS`. Depends on the head dim only, so one compilation (per head dim, block dtype
    and stride alignment) serves every sequence length."""
    block_d = triton.next_power_of_2(head_dim)
    return max(1, TILE_ELEMENTS // block_d), block_d


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Launches the fused merge; arguments as :func:`ctx_plugin.core.merge.merge_into_fused` (checked there)."""
    b, s, h, d = out.shape
    if out.numel() == 0:
        return
    block_s, block_d = block_sizes(d)
    grid = (triton.cdiv(s, block_s), h, b)
    _merge_kernel[grid](out, lse, block_out, block_lse, s,
                        *out.stride(), *lse.stride(), *block_out.stride(), *block_lse.stride(),
                        D=d, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=NUM_WARPS)
