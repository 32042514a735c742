"""All-gather-KV context parallelism (Llama-3 style).

K/V are all-gathered once (packed ``[2, B, n, Hkv, D]``, one collective) and put back in sequence order by one
gather (no intermediate reorder). The collective's input is one ``torch.stack((k, v))`` of the rank's own K/V, on
purpose: ``all_gather_into_tensor`` takes one contiguous input, K/V that are views (Megatron's V is a split of
its fused QKV projection; ``[s, b]``-major tensors transposed to batch-major) would need that copy anyway, and
otherwise it is 1/P of the gathered buffer, against a second collective per gather. Each
rank holds zigzag chunks r and 2P−1−r of the queries; each chunk attends to exactly the keys it needs (under a
causal mask a prefix ending at the chunk; with a sliding window the window's range, the kernel window in the
block's bottom-right convention: :func:`ctx_plugin.core.blocks.band_block`) in one kernel call, so there are no
partial merges. With packed documents every document is split zigzag-wise (chunks r and 2P−1−r of each one) and
each chunk meets only its own document's keys (:func:`ctx_plugin.core.blocks.document_blocks`); padding rows stay 0. Attention sinks are applied once to the concatenated result (:mod:`ctx_plugin.core.sinks`). Backward
re-gathers K/V, accumulates the full dK/dV in fp32 (each chunk's kernel gradients freed before the next chunk's
call), frees the gathered K/V, reorders dK/dV to sharded order in one copy (sequence-major, so the reduce-scatter's
input is that copy itself; the sum in sequence order is freed before the reduce-scatter) and reduce-scatters them to
their owners.
Forward saves only q, k, v, out and lse.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..names import Part
from .block_calls import Accumulator, backward_blocks, forward_blocks
from .blocks import Block, band_block, document_blocks, gc_paused
from .comm import Observers, all_gather, reduce_scatter
from .documents import Documents
from .groups import RankGroup
from .kernels import AttentionKernel, accum_dtype
from .layouts import Contiguous, Zigzag
from .mask import Mask
from .profiling import span
from .ring import autocast_off, refuse_double_backward
from .sinks import apply_sinks, sink_grad


@functools.lru_cache(maxsize=64)
@gc_paused()
def _query_chunks(rank: int, size: int, local_len: int, mask: Mask) -> tuple[Block, ...]:
    """Per query chunk this rank holds: its local rows, the global key range it needs and its kernel mask (rows
    of no chunk, padding, see no key). Chunks never share rows. Cached: every layer asks again, forward and
    backward (with packed documents, a chunk per document)."""
    if mask.documents is not None:
        docs, seq_len = mask.documents, local_len * size
        return document_blocks(Zigzag().segment_table(rank, size, local_len, docs),
                               Contiguous().segment_table(0, 1, seq_len, docs), mask)
    if not mask.causal and not mask.windowed:
        return (Block(slice(0, local_len), slice(0, local_len * size), False),)
    c = local_len // 2
    chunks = ((slice(0, c), rank * c), (slice(c, local_len), (2 * size - 1 - rank) * c))
    return tuple(band_block(mask, start, 0, 1, rows, slice(0, local_len * size)) for rows, start in chunks)


def _perm(seq_len: int, group: RankGroup, device: torch.device, documents: Documents | None) -> torch.Tensor:
    return Zigzag().permutation(seq_len, group.size, documents).to(device)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: RankGroup, counter: Observers,
               documents: Documents | None) -> torch.Tensor:
    """Every rank's K/V, packed ``[2, B, S, Hkv, D]`` in original sequence order."""
    kv = torch.stack((k, v))
    if group.size == 1:
        return kv
    n = kv.shape[2]
    parts = all_gather(torch.empty((group.size, *kv.shape), dtype=kv.dtype, device=kv.device), kv, group, counter,
                       "allgather_kv")                                  # [P, 2, B, n, Hkv, D]: rank p's shard
    where = torch.argsort(_perm(group.size * n, group, kv.device, documents))   # sequence position → sharded index
    return parts.permute(1, 2, 0, 3, 4, 5)[:, :, where // n, where % n]    # one gather, straight into sequence order


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel: AttentionKernel, group: RankGroup, counter: Observers, mask: Mask,
                scale: float, check_group: dist.ProcessGroup | None):
        kv = _gather_kv(k, v, group, counter, mask.documents)
        chunks = _query_chunks(group.rank, group.size, q.shape[1], mask)
        if mask.documents is None:      # the chunks cover every row, in order
            with span(Part.KERNEL):
                outs, lses = zip(*(kernel.forward(q[:, blk.q], kv[0, :, blk.k], kv[1, :, blk.k], causal=blk.causal,
                                                  scale=scale, window=blk.window, softcap=mask.softcap)
                                   for blk in chunks))
            out, lse = torch.cat(outs, 1), torch.cat(lses, 2)
        else:                           # padding rows belong to no chunk: output 0, lse −inf
            b, n, h, d = q.shape
            rows = Accumulator(b, n, h, d, accum_dtype(q.dtype), q.device, out_dtype=q.dtype)
            forward_blocks(kernel, q, kv[0], kv[1], chunks, mask=mask, scale=scale, acc=rows)
            out, lse = rows.result()
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks)
            out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (kernel, group, counter, mask, scale, check_group)
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, group, counter, mask, scale, check_group = ctx.args
        refuse_double_backward("all-gather attention", check_group, counter)
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        with autocast_off(dout.device):                            # as in the forward (cp_attention)
            dq, dkv = _local_backward(kernel, dout, q, _gather_kv(k, v, group, counter, mask.documents), out, lse,
                                      _query_chunks(group.rank, group.size, q.shape[1], mask), mask, scale)
        acc = dkv.dtype
        if group.size > 1:   # back to sharded order (one copy), then each rank receives the sum of its own rows
            two, b, s, hkv, d = dkv.shape
            n = s // group.size
            sharded = dkv.permute(2, 0, 1, 3, 4).index_select(0, _perm(s, group, dkv.device, mask.documents))
            del dkv          # the sum in sequence order: the reduce-scatter reads its sharded copy
            mine = reduce_scatter(torch.empty((n, two, b, hkv, d), dtype=acc, device=sharded.device),
                                  sharded.view(group.size, n, two, b, hkv, d), group, counter, "reduce_scatter_dkv")
            dkv = mine.permute(1, 2, 0, 3, 4)                            # [2, B, n, Hkv, D] (a view)
        with autocast_off(dout.device):
            dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks, None, None, None, None, None, None


def _local_backward(kernel: AttentionKernel, dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, chunks: tuple[Block, ...], mask: Mask,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dq and the full dK/dV (``[2, B, S, Hkv, D]``, sequence order), in fp32 (fp64 for fp64 inputs). The gathered
    K/V and the last chunk's kernel gradients are freed on return, before the reorder and reduce-scatter."""
    acc = accum_dtype(q.dtype)
    dq = (torch.empty if mask.documents is None else torch.zeros)(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
    if mask.documents is not None:
        backward_blocks(kernel, dout, q, kv[0], kv[1], out, lse, chunks, mask=mask, scale=scale, dq=dq, dk=dkv[0],
                        dv=dkv[1])
        return dq, dkv
    for blk in chunks:      # the chunks cover every row once: their dq is written, not added
        with span(Part.KERNEL):
            dq_c, dk_c, dv_c = kernel.backward(
                dout[:, blk.q], q[:, blk.q], kv[0, :, blk.k], kv[1, :, blk.k], out[:, blk.q], lse[:, :, blk.q],
                causal=blk.causal, scale=scale, window=blk.window, softcap=mask.softcap)
        dq[:, blk.q] = dq_c
        with span(Part.MERGE):
            dkv[0, :, blk.k] += dk_c
            dkv[1, :, blk.k] += dv_c
        del dq_c, dk_c, dv_c        # freed before the next chunk's kernel allocates its own
    return dq, dkv
