"""Ring attention for every layout: one forward loop, one backward loop, driven by the layout's plan.

Forward: P−1 rotations of the packed K/V buffer ``[2, B, S, Hkv, D]`` (K/V heads are never expanded). Each
rotation is posted into a second buffer before the current block is computed, and waited after, so the
transfer overlaps the kernel. Partial results merge in fp32 (fp64 for fp64 inputs).

Backward: K/V circulate again (P−1 rotations) while each rank adds its contribution to the dK/dV of the
block it holds; those dK/dV travel one hop behind their K/V (P hops, the last one home to the owner).
Forward saves only q, k, v, out and lse.
"""
from __future__ import annotations

import torch

from .comm import Observers, RingComm
from .groups import RankGroup
from .kernels import AttentionKernel, accum_dtype
from .layouts import RingLayout
from .mask import Mask
from .merge import merge_into

KV = "ring_kv"
DKV = "ring_dkv"


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel: AttentionKernel,
                 layout: RingLayout, group: RankGroup, counter: Observers, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, h, d = q.shape
    size, rank = group.size, group.rank
    acc = accum_dtype(q.dtype)
    out = torch.zeros(b, n, h, d, dtype=acc, device=q.device)
    lse = torch.full((b, h, n), float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack((k, v))
    spare = torch.empty_like(kv) if size > 1 else None
    with RingComm(group, counter) as comm:
        for step in range(size):
            exchange = comm.start(kv, spare, KV) if step < size - 1 else None
            for blk in layout.plan(rank, (rank - step) % size, size, n, Mask(causal)):
                o_b, lse_b = kernel.forward(q[:, blk.q], kv[0, :, blk.k], kv[1, :, blk.k], causal=blk.causal,
                                            scale=scale)
                merge_into(out[:, blk.q], lse[:, :, blk.q], o_b, lse_b)
            if exchange is not None:
                exchange.wait()
                kv, spare = spare, kv
    return out.to(q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, *, kernel: AttentionKernel, layout: RingLayout, group: RankGroup,
                  counter: Observers, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, n, h, d = q.shape
    size, rank = group.size, group.rank
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(b, n, h, d, dtype=acc, device=q.device)
    kv = torch.stack((k, v))
    kv_spare = torch.empty_like(kv) if size > 1 else None
    # dkv[0] collects this step's contributions while dkv[1] may still be in flight to the next rank.
    dkv = [torch.empty((2, *k.shape), dtype=acc, device=k.device) for _ in range(2 if size > 1 else 1)]
    incoming = torch.empty_like(dkv[0]) if size > 1 else None
    arriving = None
    with RingComm(group, counter) as comm:
        for step in range(size):
            kv_exchange = comm.start(kv, kv_spare, KV) if step < size - 1 else None
            contrib = dkv[0].zero_()
            for blk in layout.plan(rank, (rank - step) % size, size, n, Mask(causal)):
                dq_b, dk_b, dv_b = kernel.backward(dout[:, blk.q], q[:, blk.q], kv[0, :, blk.k], kv[1, :, blk.k],
                                                   out[:, blk.q], lse[:, :, blk.q], causal=blk.causal, scale=scale)
                dq[:, blk.q] += dq_b
                contrib[0, :, blk.k] += dk_b
                contrib[1, :, blk.k] += dv_b
            if arriving is not None:          # what earlier ranks added to this K/V block
                arriving.wait()
                contrib += incoming
            if size > 1:                      # pass it on; the last hop takes it home to its owner
                arriving = comm.start(contrib, incoming, DKV, tag=1)
                dkv.reverse()
            if kv_exchange is not None:
                kv_exchange.wait()
                kv, kv_spare = kv_spare, kv
        if arriving is not None:
            arriving.wait()
    dkv_own = incoming if size > 1 else dkv[0]
    return dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype)


def refuse_double_backward(what: str) -> None:
    """Raises in an attention backward that runs with ``create_graph=True``: its communication and fused kernels
    have no derivative of their own, so a second-order gradient through it would be silently wrong."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what} has no second derivative: a backward with create_graph=True (double backward, "
                           f"e.g. gradient penalties or Hessian-vector products) cannot pass through "
                           f"ctx_plugin's context-parallel attention; compute higher-order terms without it")


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: AttentionKernel, layout: RingLayout, group: RankGroup, counter: Observers,
                causal: bool, scale: float):
        out, lse = ring_forward(q, k, v, kernel=kernel, layout=layout, group=group, counter=counter, causal=causal,
                                scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, layout, group, counter, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        refuse_double_backward("ring attention")
        q, k, v, out, lse = ctx.saved_tensors
        kernel, layout, group, counter, causal, scale = ctx.args
        dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, kernel=kernel, layout=layout, group=group,
                                   counter=counter, causal=causal, scale=scale)
        return dq, dk, dv, None, None, None, None, None, None
