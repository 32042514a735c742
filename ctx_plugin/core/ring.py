"""Ring attention for every layout: one forward loop, one backward loop, driven by the layout's plan.

Forward: rotations of the packed K/V buffer ``[2, B, S, Hkv, D]`` (K/V heads are never expanded); the rank's own
K and V are sent as they are (two messages of one batch), so nothing is packed before the first step. Each
rotation is posted into a second buffer before the current block is computed, and waited after, so the
transfer overlaps the kernel. Partial results merge in fp32 (fp64 for fp64 inputs); a row's first one is written, not merged into zeros
(:class:`~ctx_plugin.core.block_calls.Accumulator`).

Only the ring steps the mask needs run (:func:`~ctx_plugin.core.layouts.ring_schedule`: the shortest arc of offsets
covering every rank's blocks; all P without a window). An arc that starts ahead of a rank (a window with a
right side) begins with one direct exchange; a rank with no block at a step just passes the K/V on.

Backward: K/V circulate again over the same steps while each rank adds its contribution to the dK/dV of the
block it holds; those dK/dV travel one hop behind their K/V, and after the last step go home to their owner
in one direct exchange (over the full ring that is the P-th hop). Attention sinks are applied once, after the
merge (:mod:`ctx_plugin.core.sinks`). Forward saves only q, k, v, out and lse (and the sinks).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..names import Part
from .block_calls import Accumulator, backward_blocks, forward_blocks, plan_calls
from .comm import Observers, RingComm
from .groups import RankGroup
from .kernels import AttentionKernel, accum_dtype
from .layouts import RingLayout, ring_schedule
from .mask import Mask
from .profiling import span
from .sinks import apply_sinks, sink_grad

KV = "ring_kv"
DKV = "ring_dkv"


def own_kv(k: torch.Tensor, v: torch.Tensor, transfers: int) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                                        torch.Tensor | None]:
    """``(this rank's (k, v), the receive buffer)``: the own K/V are computed on and sent as they are (two messages
    of one batch, no packed copy); what arrives lands in packed ``[2, B, n, Hkv, D]`` buffers."""
    own = (k.contiguous(), v.contiguous())
    return own, torch.empty((2, *k.shape), dtype=k.dtype, device=k.device) if transfers else None


def _buffer(done) -> torch.Tensor | None:
    """The buffer the next K/V can arrive in once ``done`` (the K/V just used) is free: ``done`` itself when it is a
    packed buffer; None when it was the rank's own (k, v) (:func:`_ready` allocates one if another transfer comes)."""
    return None if isinstance(done, tuple) else done


def _ready(spare: torch.Tensor | None, kv) -> torch.Tensor:
    return spare if spare is not None else torch.empty((2, *kv[0].shape), dtype=kv[0].dtype, device=kv[0].device)


def ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, kernel: AttentionKernel,
                 layout: RingLayout, group: RankGroup, counter: Observers, mask: Mask, scale: float,
                 sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    b, n, h, d = q.shape
    size, rank = group.size, group.rank
    schedule = ring_schedule(layout, size, n, mask, rank)
    acc = accum_dtype(q.dtype)
    merged = Accumulator(b, n, h, d, acc, q.device)
    kv, spare = own_kv(k, v, schedule.kv_transfers)
    with RingComm(group, counter) as comm:
        if schedule.start:                    # the arc starts ahead: fetch its first shard directly
            comm.start(kv, spare := _ready(spare, kv), KV, shift=schedule.start).wait()
            kv, spare = spare, _buffer(kv)
        for step, offset in enumerate(schedule.offsets):
            exchange = comm.start(kv, spare := _ready(spare, kv), KV) if step < schedule.steps - 1 else None
            forward_blocks(kernel, q, kv[0], kv[1], layout.plan(rank, (rank - offset) % size, size, n, mask),
                           mask=mask, scale=scale, acc=merged)
            if exchange is not None:
                exchange.wait()
                kv, spare = spare, _buffer(kv)
    out, lse = merged.result()
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.to(q.dtype), lse


def ring_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, *, kernel: AttentionKernel, layout: RingLayout, group: RankGroup,
                  counter: Observers, mask: Mask, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv given the final (sink-adjusted) ``out`` and ``lse``."""
    b, n, h, d = q.shape
    size, rank = group.size, group.rank
    if size == 1:                # a ring of one rank (Ulysses' attention): one kernel call over everything is the
        whole = _whole_block(kernel, layout, n, k.shape[1], b, mask)    # gradient; no fp32 accumulators needed
        if whole is not None:
            with span(Part.KERNEL):
                dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=whole.causal, scale=scale,
                                             window=whole.window, softcap=mask.softcap)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    schedule = ring_schedule(layout, size, n, mask, rank)
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(b, n, h, d, dtype=acc, device=q.device)
    kv, kv_spare = own_kv(k, v, schedule.kv_transfers)
    hops = schedule.steps > 1
    # dkv[0] collects this step's contributions while dkv[1] may still be in flight to the next rank.
    dkv = [torch.empty((2, *k.shape), dtype=acc, device=k.device) for _ in range(2 if hops else 1)]
    incoming = torch.empty_like(dkv[0]) if hops else None
    arriving = None
    with RingComm(group, counter) as comm:
        if schedule.start:
            comm.start(kv, kv_spare := _ready(kv_spare, kv), KV, shift=schedule.start).wait()
            kv, kv_spare = kv_spare, _buffer(kv)
        for step, offset in enumerate(schedule.offsets):
            last = step == schedule.steps - 1
            kv_exchange = None if last else comm.start(kv, kv_spare := _ready(kv_spare, kv), KV)
            contrib = dkv[0].zero_()
            backward_blocks(kernel, dout, q, kv[0], kv[1], out, lse,
                            layout.plan(rank, (rank - offset) % size, size, n, mask), mask=mask, scale=scale, dq=dq,
                            dk=contrib[0], dv=contrib[1])
            if arriving is not None:          # what earlier ranks added to this K/V block
                arriving.wait()
                with span(Part.MERGE):
                    contrib += incoming
            if not last:                      # pass it on with its K/V
                arriving = comm.start(contrib, incoming, DKV, tag=1)
                dkv.reverse()
            if kv_exchange is not None:
                kv_exchange.wait()
                kv, kv_spare = kv_spare, _buffer(kv)
        if schedule.last:                     # home to the owner of the shard held at the last step, received
            own = torch.empty_like(contrib) if incoming is None else incoming      # into the spent incoming buffer
            comm.start(contrib, own, DKV, tag=2, shift=-schedule.last).wait()
            contrib = own
    return dq.to(q.dtype), contrib[0].to(k.dtype), contrib[1].to(v.dtype)


def _whole_block(kernel: AttentionKernel, layout: RingLayout, n: int, sk: int, batch: int, mask: Mask):
    """The one block of a one-rank ring when its plan is a single kernel call over all rows and keys, else None."""
    singles, calls = plan_calls(kernel, layout.plan(0, 0, 1, n, mask), mask, n, sk, batch)
    if calls or len(singles) != 1:
        return None
    (blk,) = singles
    whole = slice(0, n, None)
    return blk if blk.q == whole and blk.k == slice(0, sk, None) else None


def autocast_off(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device``'s type, where the attention runs its kernels (they compute in their accumulation
    dtype; :func:`ctx_plugin.core.api.autocast_inputs` casts the inputs once, as autocast casts torch's own
    attention's); nothing on a device autocast does not know (meta)."""
    try:
        return torch.autocast(device.type, enabled=False)
    except RuntimeError:
        return contextlib.nullcontext()


def refuse_double_backward(what: str, check_group: dist.ProcessGroup | None,
                           counter: Observers) -> None:
    """Raises in an attention backward that runs with ``create_graph=True``: its communication and fused kernels
    have no derivative of their own, so a second-order gradient through it would be silently wrong. With a check
    group (:attr:`ctx_plugin.core.groups.CPGroups.check_group`) the ranks agree first (one all-reduce of one word,
    recorded as ``"agree"``), so a rank whose backward alone has it does not leave the others waiting in the
    backward's communication: every rank raises."""
    mine = anyone = torch.is_grad_enabled()
    if check_group is not None:
        flag = torch.tensor([int(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=check_group)
        counter.record("agree")
        anyone = bool(flag.item())
    if anyone:
        where = "" if mine else " on another rank of the context-parallel group"
        raise RuntimeError(f"{what} has no second derivative: a backward with create_graph=True{where} (double "
                           f"backward, e.g. gradient penalties or Hessian-vector products) cannot pass through "
                           f"ctx_plugin's context-parallel attention; compute higher-order terms without it")


class RingAttention(torch.autograd.Function):
    """Differentiable ring attention; see the module docstring. ``sinks`` (``[H]`` for these heads, or None)
    gets this rank's part of its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel: AttentionKernel, layout: RingLayout, group: RankGroup,
                counter: Observers, mask: Mask, scale: float, check_group: dist.ProcessGroup | None):
        out, lse = ring_forward(q, k, v, kernel=kernel, layout=layout, group=group, counter=counter, mask=mask,
                                scale=scale, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (kernel, layout, group, counter, mask, scale, check_group)
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, layout, group, counter, mask, scale, check_group = ctx.args
        refuse_double_backward("ring attention", check_group, counter)
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        with autocast_off(dout.device):                            # as in the forward (cp_attention)
            dq, dk, dv = ring_backward(dout, q, k, v, out, lse, kernel=kernel, layout=layout, group=group,
                                       counter=counter, mask=mask, scale=scale)
            dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None
