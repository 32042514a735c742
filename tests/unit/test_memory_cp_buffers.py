"""The memory model's ``cp_buffers`` (one attention call's transient buffers at its backward's peak) against the
bytes a rank's backward holds, every backend, simulated ranks on CPU: GQA, multi-head, one K/V head, a micro batch of
two, bf16, fp16, fp32 and fp64. The local kernel is a stand-in whose backward allocates exactly its gradients (what
every kernel returns): a real CPU kernel's own temporaries are not a GPU's, and on CUDA the model adds
FlashAttention-2's workspace instead (checked below). Measured as a GPU holds them
(:func:`ctx_plugin.bench.memory.transient_peak`): the returned gradients and the CPU's dtype-promotion copies left
out."""
from __future__ import annotations


import pytest
import torch

from ctx_plugin import CPConfig, cp_attention
from ctx_plugin.bench.memory import transient_peak
from ctx_plugin.bench.simulated import SILENT, simulated_groups
from ctx_plugin.memory import ModelSpec, ParallelSpec, estimate
from tests.memory_blocks import stand_in_kernel

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 32
MODEL = ModelSpec(layers=1, hidden=HEADS * HEAD_DIM, heads=HEADS, kv_heads=KV_HEADS, ffn=64, vocab=64)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _measured(backend: str, ulysses_size: int, cp: int, n: int, batch: int = 1, heads: int = HEADS,
              kv_heads: int = KV_HEADS, dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """Every rank's transient bytes in one backward (after a warm-up call)."""
    cfg = CPConfig(backend=backend, kernel="sdpa_cpu", check_ranks=False, ulysses_size=ulysses_size)
    ranks = []
    with stand_in_kernel():
        for rank in range(cp):
            groups = simulated_groups(cfg, rank, cp, SILENT, "cpu")
            g = torch.Generator().manual_seed(rank)
            q, k, v = (torch.randn(batch, n, h, HEAD_DIM, generator=g).to(dtype).requires_grad_()
                       for h in (heads, kv_heads, kv_heads))
            dout = torch.randn(batch, n, heads, HEAD_DIM, generator=g).to(dtype)
            cp_attention(q, k, v, config=cfg, groups=groups, causal=True).backward(dout)     # warm-up
            out = cp_attention(q, k, v, config=cfg, groups=groups, causal=True)
            q.grad = k.grad = v.grad = None           # the returned gradients allocated anew, as in training
            ranks.append(transient_peak(lambda: out.backward(dout, retain_graph=True), q.device))
    return ranks


def _model(backend: str, ulysses_size: int, cp: int, n: int, device: str = "cpu", batch: int = 1,
           heads: int = HEADS, kv_heads: int = KV_HEADS, dtype: torch.dtype = torch.bfloat16) -> int:
    m = ModelSpec(layers=1, hidden=heads * HEAD_DIM, heads=heads, kv_heads=kv_heads, ffn=64, vocab=64)
    p = ParallelSpec(cp=cp, backend=backend, ulysses_size=ulysses_size)
    return estimate(m, p, "none", seq_len=n * cp, micro_batch=batch, dtype=dtype, device=device).cp_buffers


# (backend, ulysses ranks, CP, tokens per rank, micro batch, heads, K/V heads, dtype)
CASES = [("ring", 1, 4, 128, 1, 8, 2, "bf16"), ("ring", 1, 2, 128, 2, 8, 8, "bf16"),
         ("ring", 1, 3, 96, 1, 4, 1, "bf16"),
         ("zigzag", 1, 4, 128, 1, 8, 2, "bf16"), ("zigzag", 1, 2, 256, 1, 8, 2, "bf16"),
         ("zigzag", 1, 8, 64, 2, 8, 2, "bf16"), ("zigzag", 1, 4, 128, 1, 8, 8, "bf16"),
         ("zigzag", 1, 4, 64, 1, 8, 2, "fp32"), ("zigzag", 1, 4, 64, 1, 8, 2, "fp16"),
         ("zigzag", 1, 4, 64, 1, 8, 2, "fp64"), ("striped", 1, 4, 128, 1, 8, 2, "bf16"),
         ("striped", 1, 2, 128, 1, 8, 2, "bf16"), ("ring", 1, 2, 64, 2, 8, 8, "fp32"),
         ("allgather", 1, 4, 128, 1, 8, 2, "bf16"), ("allgather", 1, 8, 64, 1, 8, 2, "bf16"),
         ("allgather", 1, 2, 128, 2, 8, 8, "bf16"), ("allgather", 1, 4, 64, 1, 4, 1, "bf16"),
         ("allgather", 1, 4, 64, 1, 8, 2, "fp32"), ("ulysses", 1, 2, 256, 1, 8, 2, "bf16"),
         ("ulysses", 1, 4, 128, 1, 8, 2, "bf16"), ("ulysses", 1, 2, 128, 2, 8, 2, "bf16"),
         ("ulysses", 1, 4, 64, 2, 8, 8, "bf16"), ("ulysses", 1, 4, 64, 2, 4, 1, "bf16"),
         ("ulysses", 1, 2, 128, 1, 8, 8, "bf16"), ("ulysses", 1, 2, 64, 2, 8, 2, "fp32"),
         ("ulysses_ring", 2, 4, 128, 1, 8, 2, "bf16"), ("ulysses_ring", 2, 2, 256, 1, 8, 2, "bf16"),
         ("ulysses_ring", 2, 8, 64, 1, 8, 2, "bf16"), ("ulysses_ring", 2, 4, 64, 2, 8, 2, "bf16"),
         ("ulysses_ring", 2, 4, 64, 1, 8, 8, "bf16"), ("ulysses_ring", 4, 8, 32, 1, 8, 2, "bf16"),
         ("ulysses_ring", 2, 4, 64, 2, 4, 1, "bf16"), ("ulysses_ring", 2, 4, 64, 2, 8, 8, "fp32"),
         ("ulysses_ring", 2, 4, 64, 2, 8, 2, "fp16")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_cp_buffers_match_a_ranks_backward(case):
    """The model against the worst rank, to the byte: a dropped or extra buffer, dq's fp32 accumulator counted in
    fp32 training (where it is the returned gradient), a K/V receive buffer too many on a ring of two, the zigzag's
    half blocks counted whole, or a backward that holds a freed buffer longer (the last block's kernel gradients,
    the all-gather's K/V during the reorder, a fourth dK/dV buffer for the hop home) each fail."""
    backend, u, cp, n, batch, heads, kv_heads, dtype = case
    shape = {"batch": batch, "heads": heads, "kv_heads": kv_heads, "dtype": DTYPES[dtype]}
    measured = _measured(backend, u, cp, n, **shape)
    assert _model(backend, u, cp, n, **shape) == max(measured), (case, measured)


def test_cuda_adds_flash_attention_2_workspace():
    """On CUDA: the fp32 dQ accumulator of the block at the peak and, under GQA, dK/dV for every query head (what
    flash_api.cpp's mha_bwd allocates); the contiguous ring's blocks are all whole, so its peak moment stays."""
    n = 128
    workspace = n * HEADS * HEAD_DIM * 4 + 2 * n * HEADS * HEAD_DIM * 2
    assert _model("ring", 1, 4, n, "cuda") - _model("ring", 1, 4, n) == workspace
    mha = ModelSpec(layers=1, hidden=HEADS * HEAD_DIM, heads=HEADS, kv_heads=HEADS, ffn=64, vocab=64)
    p = ParallelSpec(cp=4, backend="ring")
    cuda, cpu = (estimate(mha, p, "none", seq_len=4 * n, dtype=torch.bfloat16, device=dev).cp_buffers
                 for dev in ("cuda", "cpu"))
    assert cuda - cpu == n * HEADS * HEAD_DIM * 4          # no expansion without GQA
