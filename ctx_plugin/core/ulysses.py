"""DeepSpeed-Ulysses all-to-alls: sequence-sharded ``[B, n, H, D]`` ↔ head-sharded ``[B, P·n, H/P, D]``.

After :func:`seq_to_heads` rank j holds heads ``[j·H/P, (j+1)·H/P)`` of the whole (group's) sequence, its
tokens in rank order; :func:`heads_to_seq` is the exact inverse. :class:`AllToAll` makes either differentiable,
with the other as its backward.
"""
from __future__ import annotations

import torch

from .comm import Observers, all_to_all
from .groups import RankGroup


def seq_to_heads(x: torch.Tensor, group: RankGroup, counter: Observers) -> torch.Tensor:
    b, n, h, d = x.shape
    p = group.size
    send = x.reshape(b, n, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()     # [P, B, n, H/P, D]
    recv = all_to_all(torch.empty_like(send), send, group, counter)              # recv[i]: rank i's tokens
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * n, h // p, d)


def heads_to_seq(y: torch.Tensor, group: RankGroup, counter: Observers) -> torch.Tensor:
    b, s, hp, d = y.shape
    p = group.size
    send = y.reshape(b, p, s // p, hp, d).permute(1, 0, 2, 3, 4).contiguous()  # [P, B, n, H/P, D]
    recv = all_to_all(torch.empty_like(send), send, group, counter)              # recv[i]: rank i's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * hp, d)


class AllToAll(torch.autograd.Function):
    """``seq_to_heads`` (``to_heads=True``) or ``heads_to_seq``; the backward is the other one, itself
    differentiable (both are linear), so higher-order gradients through the all-to-all are exact."""

    @staticmethod
    def forward(ctx, x, group: RankGroup, counter: Observers, to_heads: bool):
        ctx.args = (group, counter, to_heads)
        return (seq_to_heads if to_heads else heads_to_seq)(x, group, counter)

    @staticmethod
    def backward(ctx, grad):
        group, counter, to_heads = ctx.args
        return AllToAll.apply(grad.contiguous(), group, counter, not to_heads), None, None, None


def kv_replicas(kv_heads: int, ulysses_size: int) -> int:
    """How many copies of each K/V head the all-to-all needs: 1 when ``ulysses_size`` divides the K/V heads,
    ``ulysses_size / kv_heads`` when ``kv_heads`` divides ``ulysses_size`` (each rank then gets one head)."""
    return ulysses_size // kv_heads if kv_heads < ulysses_size else 1
