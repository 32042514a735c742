"""Running one step's blocks through the local kernel: one call per block, or one varlen call per chain of blocks.

The ring (every step), the all-gather backend (its one pass) and through them Ulysses and the hybrid hand their
blocks here. With packed documents a step holds a block per document, so blocks that can share a call
(:func:`ctx_plugin.kernels.varlen.chains`) run as one varlen call when the kernel has that entry point
(:func:`~ctx_plugin.kernels.varlen.has_varlen`: flash-attn, torch's flash kernel, the torch kernel); the rest, and
every block without documents (at most four a step), run one call each. Either way the pairs computed are the
blocks' and the results the same (the varlen contract keeps rows and keys outside the blocks at 0 / −inf).
"""
from __future__ import annotations

import torch

from .blocks import Block
from .kernels import AttentionKernel
from .kernels.varlen import Varlen, chains, has_varlen, pack
from .mask import Mask
from .merge import merge_into


def plan_calls(kernel: AttentionKernel, blocks, mask: Mask, sq: int, sk: int,
               batch: int) -> tuple[tuple[Block, ...], tuple[Varlen, ...]]:
    """``(blocks run one call each, varlen calls)`` for ``blocks`` of ``sq`` local rows meeting ``sk`` keys."""
    if mask.documents is None or not has_varlen(kernel):
        return tuple(blocks), ()
    singles, groups = chains(blocks)
    return singles, tuple(pack(c, sq, sk, batch) for c in groups)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` as the flattened ``[B·S, H, D]`` rows of a varlen call."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _lse_of(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """A varlen ``[H, B·S]`` LSE as a ``[B, H, S]`` view."""
    h, t = lse.shape
    return lse.view(h, batch, t // batch).transpose(0, 1)


def forward_blocks(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks, *,
                   mask: Mask, scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merges the attention of ``blocks`` into the accumulators ``out`` ``[B, Sq, H, D]`` and ``lse`` ``[B, H, Sq]``."""
    b, sq = q.shape[:2]
    singles, calls = plan_calls(kernel, blocks, mask, sq, k.shape[1], b)
    for blk in singles:
        o_b, lse_b = kernel.forward(q[:, blk.q], k[:, blk.k], v[:, blk.k], causal=blk.causal, scale=scale,
                                    window=blk.window, softcap=mask.softcap)
        merge_into(out[:, blk.q], lse[:, :, blk.q], o_b, lse_b)
    if calls:
        rows_q, rows_k, rows_v = _rows(q), _rows(k), _rows(v)
        for call in calls:
            o_c, lse_c = kernel.forward_varlen(rows_q, rows_k, rows_v, call, scale=scale, softcap=mask.softcap)
            merge_into(out, lse, o_c.view(q.shape), _lse_of(lse_c, b))


def forward_disjoint(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks, *,
                     mask: Mask, scale: float, acc_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of ``blocks`` whose query rows are disjoint (each row's whole attention is one block), in
    ``q``'s dtype and ``acc_dtype``; rows of no block get 0 and −inf."""
    b, sq, h, _ = q.shape
    singles, calls = plan_calls(kernel, blocks, mask, sq, k.shape[1], b)
    out = lse = None
    if calls:
        rows_q, rows_k, rows_v = _rows(q), _rows(k), _rows(v)
        for call in calls:   # rows outside a call's blocks are 0 / −inf, and no row is in two calls' blocks
            o_c, lse_c = kernel.forward_varlen(rows_q, rows_k, rows_v, call, scale=scale, softcap=mask.softcap)
            o_c, lse_c = o_c.view(q.shape), _lse_of(lse_c, b)
            if out is None:
                out, lse = o_c, lse_c.contiguous()
            else:
                out.add_(o_c)
                torch.maximum(lse, lse_c, out=lse)
    if out is None:
        out = torch.zeros_like(q)
        lse = torch.full((b, h, sq), float("-inf"), dtype=acc_dtype, device=q.device)
    for blk in singles:
        out[:, blk.q], lse[:, :, blk.q] = kernel.forward(q[:, blk.q], k[:, blk.k], v[:, blk.k], causal=blk.causal,
                                                         scale=scale, window=blk.window, softcap=mask.softcap)
    return out, lse


def backward_blocks(kernel: AttentionKernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, blocks, *, mask: Mask, scale: float, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Adds the gradients of ``blocks`` (given the final ``out``/``lse`` of their rows) into ``dq``, ``dk``, ``dv``."""
    b, sq = q.shape[:2]
    singles, calls = plan_calls(kernel, blocks, mask, sq, k.shape[1], b)
    for blk in singles:
        dq_b, dk_b, dv_b = kernel.backward(dout[:, blk.q], q[:, blk.q], k[:, blk.k], v[:, blk.k], out[:, blk.q],
                                           lse[:, :, blk.q], causal=blk.causal, scale=scale, window=blk.window,
                                           softcap=mask.softcap)
        dq[:, blk.q] += dq_b
        dk[:, blk.k] += dk_b
        dv[:, blk.k] += dv_b
    if calls:
        rows = [_rows(t) for t in (dout, q, k, v, out)]
        lse_rows = lse.transpose(0, 1).reshape(lse.shape[1], b * sq).contiguous()     # [H, B·Sq]
        for call in calls:
            dq_c, dk_c, dv_c = kernel.backward_varlen(*rows, lse_rows, call, scale=scale, softcap=mask.softcap)
            dq += dq_c.view(dq.shape)
            dk += dk_c.view(dk.shape)
            dv += dv_c.view(dv.shape)
