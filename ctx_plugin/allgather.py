"""All-gather-KV context parallelism (Llama-3 style).

K/V are all-gathered once (packed ``[2, B, n, Hkv, D]``, one collective) and put back in sequence order. Each
rank holds zigzag chunks r and 2P−1−r of the queries; each chunk attends to exactly the keys it needs (a
prefix ending at the chunk, bottom-right causal) in one kernel call, so there are no partial merges. Backward
re-gathers K/V, accumulates the full dK/dV in fp32 and reduce-scatters them to their owners.
Forward saves only q, k, v, out and lse.
"""
from __future__ import annotations

import torch

from .comm import Observers, all_gather, reduce_scatter
from .groups import RankGroup
from .kernels import AttentionKernel, accum_dtype
from .layouts import Zigzag
from .ring import refuse_double_backward


def _query_chunks(rank: int, size: int, local_len: int, causal: bool) -> list[tuple[slice, int]]:
    """(local query rows, number of keys they need) for each chunk this rank holds."""
    if not causal:
        return [(slice(0, local_len), local_len * size)]
    c = local_len // 2
    return [(slice(0, c), (rank + 1) * c), (slice(c, local_len), (2 * size - rank) * c)]


def _perm(seq_len: int, group: RankGroup, device: torch.device) -> torch.Tensor:
    return Zigzag().permutation(seq_len, group.size).to(device)


def _gather_kv(k: torch.Tensor, v: torch.Tensor, group: RankGroup, counter: Observers) -> torch.Tensor:
    """Every rank's K/V, packed ``[2, B, S, Hkv, D]`` in original sequence order."""
    kv = torch.stack((k, v))
    if group.size == 1:
        return kv
    two, b, n, hkv, d = kv.shape
    parts = all_gather(torch.empty((group.size, *kv.shape), dtype=kv.dtype, device=kv.device), kv, group, counter,
                       "allgather_kv")
    sharded_order = parts.permute(1, 2, 0, 3, 4, 5).reshape(two, b, group.size * n, hkv, d)
    return sharded_order.index_select(2, torch.argsort(_perm(group.size * n, group, kv.device)))


class AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kernel: AttentionKernel, group: RankGroup, counter: Observers, causal: bool,
                scale: float):
        kv = _gather_kv(k, v, group, counter)
        outs, lses = [], []
        for rows, keys in _query_chunks(group.rank, group.size, q.shape[1], causal):
            o, lse = kernel.forward(q[:, rows], kv[0, :, :keys], kv[1, :, :keys], causal=causal, scale=scale)
            outs.append(o)
            lses.append(lse)
        out, lse = torch.cat(outs, 1), torch.cat(lses, 2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, group, counter, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("all-gather attention")
        q, k, v, out, lse = ctx.saved_tensors
        kernel, group, counter, causal, scale = ctx.args
        dout = dout.contiguous()
        kv = _gather_kv(k, v, group, counter)
        acc = accum_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=acc, device=q.device)
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for rows, keys in _query_chunks(group.rank, group.size, q.shape[1], causal):
            dq_c, dk_c, dv_c = kernel.backward(dout[:, rows], q[:, rows], kv[0, :, :keys], kv[1, :, :keys],
                                               out[:, rows], lse[:, :, rows], causal=causal, scale=scale)
            dq[:, rows] = dq_c
            dkv[0, :, :keys] += dk_c
            dkv[1, :, :keys] += dv_c
        if group.size > 1:   # back to sharded order, then each rank receives the sum of its own rows
            two, b, s, hkv, d = dkv.shape
            sharded = dkv.index_select(2, _perm(s, group, dkv.device)).reshape(two, b, group.size, s // group.size,
                                                                                 hkv, d)
            dkv = reduce_scatter(torch.empty((two, b, s // group.size, hkv, d), dtype=acc, device=dkv.device),
                                 sharded.permute(2, 0, 1, 3, 4, 5).contiguous(), group, counter, "reduce_scatter_dkv")
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None
