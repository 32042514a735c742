"""A backward over several blocks frees each block's kernel gradients before the next block's kernel allocates its
own (the ring's blocks of a step, the all-gather's query chunks): at most one block's dq/dk/dv is alive at a time,
which is what the memory model's ``cp_buffers`` counts (``tests/unit/test_memory_cp_buffers.py``)."""
from __future__ import annotations

import weakref
from unittest import mock

import torch

from ctx_plugin import CPConfig, cp_attention
from ctx_plugin.bench.simulated import SILENT, simulated_groups
from ctx_plugin.core import api
from ctx_plugin.core.block_calls import backward_blocks
from ctx_plugin.core.blocks import Block
from ctx_plugin.core.mask import Mask


class _Watching:
    """A kernel stand-in whose backward returns zeros and records whether the previous call's gradients were still
    alive when it was called."""

    name = "watching"

    def __init__(self, kernel=None) -> None:
        self.kernel, self.previous, self.overlaps, self.calls = kernel, [], 0, 0

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def forward(self, *args, **kwargs):
        return self.kernel.forward(*args, **kwargs)

    def backward(self, dout, q, k, v, out, lse, **kwargs):
        self.calls += 1
        self.overlaps += any(ref() is not None for ref in self.previous)
        grads = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        self.previous = [weakref.ref(g) for g in grads]
        return grads


def test_ring_blocks_of_a_step():
    b, n, h, d = 1, 16, 2, 8
    q, k, v, dout, out = (torch.randn(b, n, h, d) for _ in range(5))
    lse = torch.randn(b, h, n)
    blocks = (Block(slice(0, 8), slice(0, 16), False), Block(slice(8, 16), slice(0, 8), False),
              Block(slice(8, 16), slice(8, 16), True))
    kernel = _Watching()
    dq, dk, dv = torch.zeros(b, n, h, d), torch.zeros(b, n, h, d), torch.zeros(b, n, h, d)
    backward_blocks(kernel, dout, q, k, v, out, lse, blocks, mask=Mask(True), scale=0.3, dq=dq, dk=dk, dv=dv)
    assert kernel.calls == 3 and kernel.overlaps == 0


def test_all_gather_query_chunks():
    cfg = CPConfig(backend="allgather", kernel="sdpa_cpu", check_ranks=False)
    select, kernels = api.select_kernel, []

    def watching(*args, **kwargs):
        kernels.append(_Watching(select(*args, **kwargs)))
        return kernels[-1]
    with mock.patch.object(api, "select_kernel", watching):
        groups = simulated_groups(cfg, 0, 4, SILENT, "cpu")
        q, k, v = (torch.randn(1, 32, h, 8).requires_grad_() for h in (4, 2, 2))
        cp_attention(q, k, v, config=cfg, groups=groups, causal=True).sum().backward()
    assert sum(w.calls for w in kernels) == 2 and sum(w.overlaps for w in kernels) == 0
