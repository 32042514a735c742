"""Merging partial attention results (out, lse) computed over disjoint key sets, in place, in fp32/fp64.

For two partial results over key sets A and B of the same query rows::

    lse = logaddexp(lse_A, lse_B)
    out = out_A · exp(lse_A − lse) + out_B · exp(lse_B − lse)

Rows where both are −inf (no keys yet) stay zero with lse −inf instead of becoming NaN.
"""
from __future__ import annotations

import torch


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds ``(block_out, block_lse)`` into the accumulators ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]``.

    ``out``/``lse`` may be views (slices of the full accumulators); they are updated in place.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    ref = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)          # [B, S, H, 1]
    w_new = torch.exp(block_lse.to(lse.dtype) - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(block_out.to(out.dtype) * w_new)
    lse.copy_(new_lse)
