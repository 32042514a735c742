"""Spawned ranks for test_inplace_collectives.py: layers whose matrix product's output is all-reduced in place (as
Megatron's RowParallelLinear without sequence parallelism does), under the selective preset and without recompute."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _ReduceInPlace(torch.autograd.Function):
    """megatron.core.tensor_parallel.mappings._ReduceFromModelParallelRegion: all-reduce in place, identity backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Layer(nn.Module):
    def __init__(self, width: int, read_before: bool) -> None:
        super().__init__()
        self.proj, self.read_before = nn.Linear(width, width, bias=False), read_before

    def forward(self, x):
        y = self.proj(x)                      # aten.mm: saved by the selective preset
        early = y * 2 if self.read_before else 0.0     # a recomputed read of y before the collective changes it
        return torch.tanh(_ReduceInPlace.apply(y) + x) + early


def run(rank: int, world: int, payload) -> dict:
    from ctx_plugin import recompute

    out = {}
    for read_before in (False, True):
        torch.manual_seed(0)                  # the same weights on every rank; different inputs
        layers = nn.ModuleList([Layer(8, read_before) for _ in range(2)]).double()
        x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
        grads = []
        for preset in ("none", "selective"):
            if preset != "none":
                recompute.apply(list(layers), preset)
            h = x
            try:
                for layer in layers:
                    h = layer(h)
                h.square().sum().backward()
            except ValueError as e:
                grads.append(str(e))
                continue
            grads.append([p.grad.clone() for p in layers.parameters()])
            layers.zero_grad()
        plain, selective = grads
        out[f"read_before={read_before}"] = selective if isinstance(selective, str) else max(
            ((a - b).abs().max() / a.abs().max()).item() for a, b in zip(plain, selective))
    return out
