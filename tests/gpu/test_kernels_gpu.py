"""Fused CUDA kernels (torch cuDNN, torch flash, flash-attn) in bf16/fp16 against the torch kernel in fp32, and at
P >= 2 through simulated ranks against a float64 dense reference.

Skipped without CUDA. One short command on a single GPU: ``python -m pytest -q tests/gpu``.
Tolerances follow TransformerEngine's attention tests: bf16 2.5e-2 and fp16 1e-2 relative (norm-wise); the
LSE is fp32 in every kernel, so it must agree within 1e-2 absolute (its values are O(log S)).
"""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.harness import simulated_outputs
from ctx_plugin.core.kernels import kernel_unavailable, select_kernel
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.names import Backend, Kernel
from tests.reference import dense_with_grads, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FUSED = [Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH, Kernel.FLASH_ATTN]
TOL = {torch.bfloat16: 2.5e-2, torch.float16: 1e-2}
# (batch, query length, heads, kv heads, head_dim, key length): "prefix" is a query chunk attending to the
# longer prefix that ends with it (bottom-right causal), as the all-gather backend calls it; "mla-d192" the width
# DeepSeek-V3's latent attention reaches the kernel with (queries and keys 192, values padded to them).
SHAPES = {"mha": (2, 512, 8, 8, 128, 512), "gqa": (2, 512, 8, 2, 128, 512), "mqa-d64": (1, 1024, 4, 1, 64, 1024),
          "prefix": (2, 256, 8, 2, 128, 768), "mla-d192": (1, 512, 8, 8, 192, 512)}


def _inputs(shape, dtype, seed=0):
    b, s, h, hkv, d, sk = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *sh: torch.randn(*sh, generator=g, device="cuda", dtype=torch.float32)  # noqa: E731
    q, k, v, do = mk(b, s, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, s, h, d)
    return [t.to(dtype) for t in (q, k, v, do)]


def _need(kernel, dtype, head_dim):
    reason = kernel_unavailable(kernel, torch.device("cuda"), dtype, head_dim)
    if reason is not None:
        pytest.skip(reason)
    return select_kernel(kernel, torch.device("cuda"), dtype, head_dim)


@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fused_kernel_matches_fp32_reference(kernel, dtype, shape, causal):
    q, k, v, do = _inputs(SHAPES[shape], dtype)
    impl = _need(kernel, dtype, q.shape[-1])
    scale = q.shape[-1] ** -0.5
    ref = TorchKernel()
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    want_out, want_lse = ref.forward(q32, k32, v32, causal=causal, scale=scale)
    want = ref.backward(do32, q32, k32, v32, want_out, want_lse, causal=causal, scale=scale)
    out, lse = impl.forward(q, k, v, causal=causal, scale=scale)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32
    assert rel_err(out, want_out) < TOL[dtype]
    assert (lse - want_lse).abs().max().item() < 1e-2
    grads = impl.backward(do, q, k, v, out, lse, causal=causal, scale=scale)
    for name, got, exp in zip(("dq", "dk", "dv"), grads, want):
        assert got.shape == exp.shape, name
        assert rel_err(got, exp) < TOL[dtype], f"{name}: {rel_err(got, exp):.2e}"


@pytest.mark.parametrize("kernel", [Kernel.AUTO, *FUSED])
@pytest.mark.parametrize("backend", list(ctx_plugin.Backend))
def test_cp_attention_single_gpu(kernel, backend):
    """The full ring path (P = 1) with each kernel, gradients included, in bf16."""
    q, k, v, do = _inputs(SHAPES["gqa"], torch.bfloat16, seed=1)
    if kernel != Kernel.AUTO:
        _need(kernel, torch.bfloat16, q.shape[-1])
    cfg = ctx_plugin.CPConfig(backend=backend, kernel=kernel)
    groups = ctx_plugin.build_cp_groups(cfg)
    ql, kl, vl = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = ctx_plugin.cp_attention(ql, kl, vl, config=cfg, groups=groups, causal=True)
    out.backward(do)
    ref = TorchKernel()
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    want_out, want_lse = ref.forward(q32, k32, v32, causal=True, scale=q.shape[-1] ** -0.5)
    want = ref.backward(do32, q32, k32, v32, want_out, want_lse, causal=True, scale=q.shape[-1] ** -0.5)
    assert rel_err(out, want_out) < TOL[torch.bfloat16]
    for got, exp in zip((ql.grad, kl.grad, vl.grad), want):
        assert got.dtype == torch.bfloat16
        assert rel_err(got, exp) < TOL[torch.bfloat16]


# P >= 2 through simulated ranks (threads exchanging real CUDA tensors): the kernels get the ring's and the
# all-gather's strided sequence slices (zigzag halves, striped q[1:]/k[:-1], K/V views into the packed buffer);
# batch 2 makes those slices non-dense; K/V stay views (GQA ones too: the ops take them unexpanded, cuDNN from
# torch 2.8). Reference: float64 dense.
LAYOUT_CASES = [(b, p, hkv) for b in (Backend.ZIGZAG, Backend.STRIPED, Backend.ALLGATHER, Backend.RING)
                for p in (2, 4) for hkv in (8, 2)]


@pytest.mark.parametrize("kernel", FUSED)
@pytest.mark.parametrize("backend,size,kv_heads", LAYOUT_CASES,
                         ids=[f"{b.value}-p{p}-{'mha' if h == 8 else 'gqa'}" for b, p, h in LAYOUT_CASES])
def test_fused_kernels_at_p_ge_2_layouts(kernel, backend, size, kv_heads):
    q, k, v, do = _inputs((2, 1024, 8, kv_heads, 128, 1024), torch.bfloat16, seed=size + kv_heads)
    _need(kernel, torch.bfloat16, q.shape[-1])
    cfg = ctx_plugin.CPConfig(backend=backend, kernel=kernel)
    got = simulated_outputs(cfg, size, q, k, v, do, causal=True)
    want = dense_with_grads(*(t.double() for t in (q, k, v, do)), causal=True)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape, name
        assert rel_err(g, w) < TOL[torch.bfloat16], f"{name}: {rel_err(g, w):.2e}"


def test_auto_picks_a_fused_kernel_on_gpu():
    picked = select_kernel(Kernel.AUTO, torch.device("cuda"), torch.bfloat16, 128)
    assert picked.name != Kernel.TORCH.value


# (shape, causal, window): left-only, left+right and right-only windows, a diagonal-only one, windows smaller and
# larger than the block, and the bottom-right alignment of a query chunk against a longer prefix.
WINDOWED = [("mha", True, (127, 0)), ("gqa", True, (0, 0)), ("mha", False, (64, 31)), ("gqa", False, (None, 100)),
            ("mha", False, (300, None)), ("prefix", True, (200, 0)), ("prefix", False, (333, 17)),
            ("mqa-d64", True, (5000, 0))]


@pytest.mark.parametrize("shape,causal,window", WINDOWED, ids=str)
def test_sdpa_flash_applies_windows_like_the_torch_kernel(shape, causal, window):
    """torch's flash kernel through aten::_flash_attention_forward/_backward (window_size_left/right), bf16."""
    dtype, features = torch.bfloat16, frozenset({"window"})
    q, k, v, do = _inputs(SHAPES[shape], dtype, seed=11)
    reason = kernel_unavailable(Kernel.SDPA_FLASH, torch.device("cuda"), dtype, q.shape[-1], features)
    if reason is not None:
        pytest.skip(reason)
    impl = select_kernel(Kernel.SDPA_FLASH, torch.device("cuda"), dtype, q.shape[-1], features)
    scale = q.shape[-1] ** -0.5
    ref = TorchKernel()
    q32, k32, v32, do32 = (t.float() for t in (q, k, v, do))
    want_out, want_lse = ref.forward(q32, k32, v32, causal=causal, scale=scale, window=window)
    want = ref.backward(do32, q32, k32, v32, want_out, want_lse, causal=causal, scale=scale, window=window)
    out, lse = impl.forward(q, k, v, causal=causal, scale=scale, window=window)
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == want_lse.shape
    assert rel_err(out, want_out) < TOL[dtype]
    assert (lse - want_lse).abs().max().item() < 1e-2
    grads = impl.backward(do, q, k, v, out, lse, causal=causal, scale=scale, window=window)
    for name, got, exp in zip(("dq", "dk", "dv"), grads, want):
        err = (got.float() - exp).abs().max().item() / max(exp.abs().max().item(), 1.0)   # dq ~ 0 at (0, 0)
        assert got.shape == exp.shape and err < TOL[dtype], f"{name}: {err:.2e}"
    assert select_kernel(Kernel.AUTO, torch.device("cuda"), dtype, q.shape[-1], features).name != Kernel.TORCH.value


def test_sdpa_flash_backward_split_over_heads_is_exact(monkeypatch):
    """With the int32 limit lowered, torch's FlashAttention-2 backward runs over head chunks (dense and varlen
    paths share the split): the gradients equal one call's."""
    import ctx_plugin.core.kernels.head_chunks as head_chunks
    from ctx_plugin.core.kernels.sdpa import FlashKernel

    torch.manual_seed(0)
    q = torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kernel = FlashKernel()
    out, lse = kernel.forward(q, k, v, causal=True, scale=128 ** -0.5)
    dout = torch.randn_like(out)
    want = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=128 ** -0.5)
    monkeypatch.setattr(head_chunks, "INT32_LIMIT", 1024 * 128 * 3)          # 3 heads fit: chunks of 2
    assert head_chunks.fa2_head_chunk(1024, 8, 2, 128) == 2
    got = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=128 ** -0.5)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_sdpa_flash_backward_beyond_int32_offsets():
    """524,416 query rows × 32 heads of 128 (past 2^31 dQ offsets): the last rows' dQ against the torch kernel on
    those rows alone (about 50 GiB; about 30 s on an H200: 2.3 PFLOP forward, 5.6 backward at FlashAttention-2's
    rates)."""
    from ctx_plugin.core.kernels.sdpa import FlashKernel

    if torch.cuda.mem_get_info()[0] < 64 * 2**30:       # an H100 80GB has 79.6 GiB in all
        pytest.skip("needs 64 GiB of free GPU memory")
    torch.manual_seed(0)
    s, tail = 524_416, 64
    q = torch.randn(1, s, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, s, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = 128 ** -0.5
    kernel = FlashKernel()
    out, lse = kernel.forward(q, k, v, causal=True, scale=scale)
    dout = torch.randn_like(out)
    dq = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=scale)[0][:, -tail:]
    ref = TorchKernel()
    q_t, do_t, o_t = (t[:, -tail:].float() for t in (q, dout, out))
    want = ref.backward(do_t, q_t, k.float(), v.float(), o_t, lse[:, :, -tail:].float(), causal=True,
                        scale=scale)[0]
    assert rel_err(dq.float(), want) < 2e-2, rel_err(dq.float(), want)
