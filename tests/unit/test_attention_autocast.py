"""cp_attention under autocast: every kernel takes the inputs autocast would give torch's own attention (fp32 cast to
autocast's dtype, float64 left alone) and computes on them as it does outside autocast, in forward and backward
(a backward run inside the autocast context too). Before, the torch kernel's einsums ran in bf16 under autocast (an
fp32-labelled output of bf16 precision, its backward in fp32 from that forward's LSE) while the CPU flash kernel
ignored autocast. Two simulated ranks (threads exchanging real tensors)."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.simulated import run_threaded, simulated_groups

SEQ, HEADS, KV_HEADS, DIM = 16, 4, 2, 8


def _tensors(dtype):
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, SEQ, HEADS, DIM, generator=g, dtype=dtype)
    k, v = (torch.randn(2, SEQ, KV_HEADS, DIM, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, torch.randn(2, SEQ, HEADS, DIM, generator=g, dtype=dtype)


def _run(config, tensors, autocast: bool, cast_first: bool):
    def rank_work(rank, world):
        groups = simulated_groups(config, rank, 2, world, "cpu")
        local = [ctx_plugin.shard_sequence(t, config=config, groups=groups) for t in tensors]
        q, k, v = (t.detach().requires_grad_(True) for t in local[:3])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            inputs = [t.to(torch.bfloat16) for t in (q, k, v)] if cast_first else [q, k, v]
            out = ctx_plugin.cp_attention(*inputs, config=config, groups=groups)
            out.backward(local[3].to(out.dtype))
        return out.detach(), [t.grad for t in (q, k, v)]
    return run_threaded(2, rank_work)


@pytest.mark.parametrize("backend", ["zigzag", "allgather", "ulysses"])
@pytest.mark.parametrize("kernel", ["torch", "sdpa_cpu"])
def test_autocast_gives_every_kernel_autocasts_inputs(backend, kernel):
    config = ctx_plugin.CPConfig(backend=backend, kernel=kernel)
    tensors = _tensors(torch.float32)
    under = _run(config, tensors, autocast=True, cast_first=False)
    cast = _run(config, tensors, autocast=False, cast_first=True)
    for rank, ((out_a, grads_a), (out_b, grads_b)) in enumerate(zip(under, cast)):
        assert out_a.dtype == torch.bfloat16, f"rank {rank}: {out_a.dtype}"
        assert torch.equal(out_a, out_b), f"rank {rank}: the output differs from the cast inputs' outside autocast"
        for name, a, b in zip("qkv", grads_a, grads_b):
            assert a.dtype == torch.float32 and torch.equal(a, b), f"rank {rank}: d{name} differs"


def test_float64_inputs_are_left_alone_under_autocast():
    """As autocast leaves float64 out of its casts: the float64 attention, exactly as without autocast."""
    config = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    tensors = _tensors(torch.float64)
    under = _run(config, tensors, autocast=True, cast_first=False)
    plain = _run(config, tensors, autocast=False, cast_first=False)
    for (out_a, grads_a), (out_b, grads_b) in zip(under, plain):
        assert out_a.dtype == torch.float64 and torch.equal(out_a, out_b)
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
