"""Varlen calls on the real CUDA kernels (torch's flash op with cum_seq, flash-attn's varlen functions) against the
float64 reference of tests/unit/test_varlen.py, and packed-document runs through simulated ranks on every fused
kernel against the float64 per-document reference. Checks on a GPU what the CPU tests take from stand-ins: the
``[H, total_q]`` LSE layout, +inf/−inf for rows without keys, zero gradients for fillers.

Skipped without CUDA (``python -m pytest -q tests/gpu``; part of launch/gpu_check.sh).
"""
from __future__ import annotations

import itertools

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.harness import simulated_outputs
from ctx_plugin.core.blocks import Block
from ctx_plugin.core.documents import Documents
from ctx_plugin.core.kernels import kernel_unavailable, select_kernel
from ctx_plugin.core.kernels.varlen import has_varlen, pack
from ctx_plugin.names import Backend, Kernel
from tests.reference import documents_with_grads, rel_err
from tests.unit.test_varlen import reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.bfloat16: 2.5e-2, torch.float16: 1e-2}
CUDA = torch.device("cuda")


def _kernel(name: Kernel, dtype: torch.dtype):
    reason = kernel_unavailable(name, CUDA, dtype, 128)
    if reason is not None:
        pytest.skip(reason)
    return select_kernel(name, CUDA, dtype, 128)


@pytest.mark.parametrize("name", [Kernel.SDPA_FLASH, Kernel.FLASH_ATTN], ids=lambda k: k.value)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal,window", [(True, (None, None)), (False, (None, None)), (True, (40, None))],
                         ids=["causal", "full", "causal-window"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_varlen_call_matches_float64(name, dtype, causal, window, kv_heads):
    kern = _kernel(name, dtype)
    if not has_varlen(kern):
        pytest.skip(f"{name.value} has no varlen entry point here: {getattr(kern, 'varlen_unavailable', '')}")
    blocks = (Block(slice(16, 144), slice(0, 160), causal, window), Block(slice(144, 200), slice(200, 256), causal,
                                                                          window),
              Block(slice(260, 380), slice(300, 460), causal, window))
    call = pack(blocks, 400, 480, 2)
    g = torch.Generator().manual_seed(kv_heads)
    mk = lambda t, h: torch.randn(t, h, 128, generator=g).to(dtype)            # noqa: E731
    q, k, v, dout = mk(800, 8), mk(960, kv_heads), mk(960, kv_heads), mk(800, 8)
    want = reference(q, k, v, dout, call, 128 ** -0.5)
    out, lse = kern.forward_varlen(q.cuda(), k.cuda(), v.cuda(), call, scale=128 ** -0.5)
    assert lse.shape == (8, 800) and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(want[1])) and not torch.isposinf(lse).any()
    assert rel_err(out.cpu(), want[0]) < TOL[dtype]
    assert (lse.cpu().double() - want[1]).nan_to_num(0).abs().max() < 1e-2
    grads = kern.backward_varlen(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), want[0].to(dtype).cuda(),
                                 want[1].float().cuda(), call, scale=128 ** -0.5)
    for label, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert rel_err(got.cpu(), ref) < TOL[dtype], f"{label}: {rel_err(got.cpu(), ref):.2e}"


RUNS = [(Backend.ZIGZAG, 2), (Backend.ZIGZAG, 4), (Backend.ALLGATHER, 2), (Backend.RING, 4), (Backend.ULYSSES, 2)]


@pytest.mark.parametrize("name", [Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH, Kernel.FLASH_ATTN], ids=lambda k: k.value)
@pytest.mark.parametrize("backend,size", RUNS, ids=[f"{b.value}-{n}" for b, n in RUNS])
def test_packed_documents_on_simulated_ranks(name, backend, size):
    _kernel(name, torch.bfloat16)
    lengths = [256, 64, 448, 128, 640, 512]
    docs = Documents(tuple(itertools.accumulate([0, *lengths])))
    g = torch.Generator(device="cuda").manual_seed(size)
    mk = lambda h: torch.randn(1, 2048, h, 128, generator=g, device="cuda", dtype=torch.float64)   # noqa: E731
    q, k, v, dout = mk(8), mk(2), mk(2), mk(8)
    cfg = ctx_plugin.CPConfig(backend=backend, kernel=name)
    got = simulated_outputs(cfg, size, *(t.to(torch.bfloat16) for t in (q, k, v, dout)), causal=True,
                            documents=docs)
    want = documents_with_grads(q, k, v, dout, docs, causal=True)
    for label, gt, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(gt, w) < TOL[torch.bfloat16], f"{label}: {rel_err(gt, w):.2e}"
