"""Backward calls split over heads where FlashAttention-2's int32 indexing would overflow.

FlashAttention-2's backward (``csrc/flash_attn/src/flash_bwd_kernel.h``, torch's copy alike) finds a thread block's
place in the fp32 dQ accumulator as ``binfo.q_offset(seqlen_q_rounded * h * d_rounded, h * d_rounded, bidb) + (row
block + 128 * bidb if varlen) * h * d_rounded + bidh * d_rounded``, where ``q_offset`` (``block_info.h``) is
``bidb * batch_stride`` (dense) or ``uint32_t(sum_s_q) * row_stride`` (varlen: the rows of the sequences before),
in the ``int`` of its arguments. So the accumulator's row of a dense call is ``bidb * round_up(Sq, 128) + row`` and
that of a varlen call ``rows before + row + 128 * bidb`` (``mha_varlen_bwd`` allocates ``total_q + 128 * b`` rows),
each times ``h * d_rounded``. Up to 2.7.x (and in torch's copy: ``aten/src/ATen/native/transformers/cuda/
flash_attn``) the whole offset is 32-bit; from 2.8.0 (PR #1500) the part after ``q_offset`` is 64-bit, the
batch/sequence part still is not (64-bit only from b62d93f3, 2026-02-15, in no 2.x release). From 2^31 on the offset
wraps and dQ is written to the wrong rows, without an error: at 32 heads of 128 that is 524,288 accumulator rows in
one call, e.g. 4 sequences of 131,072 rows. Heads are independent, so such a call runs as several calls over head
chunks (with GQA, whole groups of query heads with their K/V head where they fit), each under the limit; the
results are the same. One rule for all versions, the strictest: every accumulator row of the call,
``batch * round_up(Sq, 128)`` (dense) or ``total_q + 128 * sequences`` (varlen), times ``h * d_rounded``, stays
under 2^31.

``d_rounded``: the head size (a multiple of 8) rounded up to 32 (``flash_api.cpp`` 2.1–2.5), to 32 up to 192 and
256 above (2.6–2.7), to 32 up to 128 and 64 above (2.8); :func:`fa2_head_chunk` takes the largest of these.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

INT32_LIMIT = 2 ** 31
"""Where FlashAttention-2's int offsets wrap."""


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def fa2_dq_accum_rows(rows: int, batch: int = 1, sequences: int = 0) -> int:
    """The rows of FlashAttention-2's dQ accumulator for a call: ``batch`` sequences of ``rows`` query rows each, each
    rounded up to 128 (dense; ``sequences`` 0), or a varlen call of ``sequences`` sequences holding ``rows`` query rows
    in all, plus 128 rows per sequence."""
    return rows + 128 * sequences if sequences else batch * _round_up(rows, 128)


def fa2_head_chunk(rows: int, heads: int, kv_heads: int, head_dim: int, sequences: int = 0,
                   limit: int | None = None, *, batch: int = 1) -> int | None:
    """Query heads per backward call so that FlashAttention-2's dQ offsets stay under ``limit``; None when one call
    over all ``heads`` does. ``rows``, ``batch``, ``sequences``: as for :func:`fa2_dq_accum_rows` (a dense call's rows
    per sequence and its batch size, or a varlen call's total rows and its number of sequences); ``limit`` defaults
    to :data:`INT32_LIMIT`."""
    limit = INT32_LIMIT if limit is None else limit
    d_rounded = _round_up(head_dim, 32 if head_dim <= 128 else 64)     # the largest of every version's rounding
    per_head = fa2_dq_accum_rows(rows, batch, sequences) * d_rounded
    if per_head * heads < limit:
        return None
    chunk = (limit - 1) // per_head
    if chunk < 1:
        what = f"{rows} query rows in {sequences} sequences" if sequences else f"{batch} × {rows} query rows"
        raise ValueError(f"{what} of head size {head_dim} in one attention call exceed FlashAttention-2's 32-bit "
                         f"indexing even for one head (its backward would write dQ to wrong rows); use more "
                         f"context-parallel ranks or a smaller batch, or kernel='cudnn' or 'torch'")
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
