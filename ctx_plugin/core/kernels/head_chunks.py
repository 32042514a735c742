"""Backward calls split over heads where FlashAttention-2's int32 indexing would overflow.

torch's FlashAttention-2 (``flash_bwd_kernel.h``) computes the dQ accumulator's offsets in 32-bit ``int``:
``seqlen_q_rounded * h * d_rounded`` (a batch's stride) and ``((m_block_max - 1) * kBlockM + 128 * bidb) * h *
d_rounded`` (a row block's), with rows rounded up to 128 and the head size to 32 (64 above 128). From 2^31 on
they wrap and dQ is written to the wrong rows, without an error: at 32 heads of 128 that is 524,288 query rows in
one call. Heads are independent, so such a call runs as several calls over head chunks (with GQA, whole groups of
query heads with their K/V head where they fit), each under the limit; the results are the same.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

INT32_LIMIT = 2 ** 31
"""Where FlashAttention-2's int offsets wrap."""


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def fa2_head_chunk(rows: int, heads: int, kv_heads: int, head_dim: int, sequences: int = 0,
                   limit: int | None = None) -> int | None:
    """Query heads per backward call so that FlashAttention-2's dQ offsets stay under ``limit``; None when one call
    over all ``heads`` does. ``rows``: query rows per sequence (the longest, for varlen calls of ``sequences``
    sequences, which add 128 rows each to the offset); ``limit`` defaults to :data:`INT32_LIMIT`."""
    limit = INT32_LIMIT if limit is None else limit
    d_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)
    per_head = (_round_up(rows, 128) + 128 * sequences) * d_rounded
    if per_head * heads < limit:
        return None
    chunk = (limit - 1) // per_head
    if chunk < 1:
        raise ValueError(f"{rows} query rows of head size {head_dim} in one attention call exceed FlashAttention-2's "
                         f"32-bit indexing even for one head (its backward would write dQ to wrong rows); use more "
                         f"context-parallel ranks, or kernel='cudnn' or 'torch'")
    group = heads // kv_heads
    if chunk >= group:
        return chunk - chunk % group                                  # whole groups
    return max(d for d in range(1, chunk + 1) if group % d == 0)      # parts of one group, never straddling two


def by_head_chunks(backward: Callable, chunk: int, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, head_dim: int,
                   lse_head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``backward(dout, q, k, v, out, lse)`` over chunks of ``chunk`` query heads (heads along ``head_dim`` of
    q/k/v/dout/out, ``lse_head_dim`` of the LSE); dK/dV of a K/V head shared by several chunks are summed."""
    heads, kv_heads = q.shape[head_dim], k.shape[head_dim]
    group = heads // kv_heads
    dqs = []
    dk = torch.zeros_like(k, dtype=torch.promote_types(k.dtype, torch.float32))
    dv = torch.zeros_like(v, dtype=dk.dtype)
    for start in range(0, heads, chunk):
        stop = min(start + chunk, heads)
        kv_start, kv_stop = start // group, (stop - 1) // group + 1
        if kv_stop - kv_start > 1 and (start % group or stop % group):
            raise ValueError(f"a chunk of query heads {start}:{stop} straddles K/V groups of {group}")
        q_part, o_part, do_part = (t.narrow(head_dim, start, stop - start) for t in (q, out, dout))
        k_part, v_part = (t.narrow(head_dim, kv_start, kv_stop - kv_start) for t in (k, v))
        dq_c, dk_c, dv_c = backward(do_part, q_part, k_part, v_part, o_part,
                                    lse.narrow(lse_head_dim, start, stop - start))
        dqs.append(dq_c)
        dk.narrow(head_dim, kv_start, kv_stop - kv_start).add_(dk_c)
        dv.narrow(head_dim, kv_start, kv_stop - kv_start).add_(dv_c)
    return torch.cat(dqs, dim=head_dim), dk.to(k.dtype), dv.to(v.dtype)
