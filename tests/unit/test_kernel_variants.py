"""Sliding windows and softcap in the local kernels, against the float64 dense reference (tests/reference.py).

The kernel convention (ctx_plugin/core/kernels/base.py) is flash-attn's, bottom-right aligned: query row a of Sq sees
key b of Sk iff ``a + (Sk − Sq) − left <= b <= a + (Sk − Sq) + right`` (and ``b <= a + Sk − Sq`` when causal);
the reference places query row a at position ``a + Sk − Sq`` and applies the window to positions.
"""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.core.kernels.sdpa import CpuFlashKernel
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.core.merge import merge_into
from tests.reference import dense_scores, dense_with_grads, rel_err

SCALE = 0.3
CAP = 1.0   # scaled scores here are ~N(0, 0.85): tanh(s / 1.0) is far from linear, so a dropped cap shows

# (label, sq, sk, causal, window): every query row keeps at least one key, as the layout plans guarantee.
CASES = [
    ("causal-window-inside-block", 10, 10, True, (3, 0)),
    ("causal-window-left-only", 10, 10, True, (2, None)),     # right is irrelevant under causality
    ("causal-window-right-ignored", 10, 10, True, (4, 5)),
    ("causal-window-larger-than-block", 10, 10, True, (25, 0)),
    ("full-left-only", 10, 10, False, (3, None)),
    ("full-left-and-right", 10, 10, False, (2, 3)),
    ("full-right-only", 10, 10, False, (None, 2)),
    ("full-diagonal-and-next", 10, 10, False, (0, 1)),        # itself and the next key only
    ("causal-prefix-sk>sq", 6, 15, True, (4, 0)),            # bottom-right: the last 6 of 15 positions
    ("full-sk>sq", 6, 15, False, (3, 2)),
    ("full-sq>sk", 8, 5, False, (1, 4)),                      # row 0 sees keys 0..1 only
    ("causal-no-window", 7, 11, True, (None, None)),
]
HEADS = [(4, 4), (4, 2), (4, 1)]


def _qkv(sq, sk, h, hkv, dtype, seed=0, d=8, b=2):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, sq, h, d)


def _reference(q, k, v, dout, causal, window, softcap):
    """float64 out, lse, dq, dk, dv of the very same (possibly rounded) input values."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, dq, dk, dv = dense_with_grads(q, k, v, dout, causal=causal, scale=SCALE, window=window, softcap=softcap)
    lse = torch.logsumexp(dense_scores(q, k, causal=causal, scale=SCALE, window=window, softcap=softcap), -1)
    return out, lse, dq, dk, dv


# float64: exact up to rounding. float32: computed in float32 (unit roundoff 6e-8, ~10 sums). bfloat16: the
# kernel computes in float32 but returns out in bfloat16 (unit roundoff 2^-9 ≈ 2e-3, so out is within ~4e-3 of
# its maximum) and its backward reads that rounded out for delta = sum(dout·out): gradients within ~1e-2.
TOLS = {torch.float64: (1e-12, 1e-12, 1e-12), torch.float32: (1e-5, 1e-5, 1e-5),
        torch.bfloat16: (8e-3, 1e-5, 2.5e-2)}


@pytest.mark.parametrize("label,sq,sk,causal,window", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("softcap", [None, CAP], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_torch_kernel_window_and_softcap_match_float64(label, sq, sk, causal, window, softcap, dtype):
    h, hkv = HEADS[hash(label) % 3] if dtype == torch.float64 else (4, 2)
    q, k, v, dout = _qkv(sq, sk, h, hkv, dtype, seed=len(label))
    kernel = TorchKernel()
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE, window=window, softcap=softcap)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE, window=window, softcap=softcap)
    ref_out, ref_lse, *ref_grads = _reference(q, k, v, dout, causal, window, softcap)
    out_tol, lse_tol, grad_tol = TOLS[dtype]
    assert out.dtype == dtype and lse.dtype == torch.promote_types(dtype, torch.float32)
    assert rel_err(out, ref_out) < out_tol
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=lse_tol)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        assert rel_err(got, want) < grad_tol, rel_err(got, want)


@pytest.mark.parametrize("h,hkv", HEADS)
def test_windows_differ_from_full_attention(h, hkv):
    """The cases above are not vacuous: each window changes the result against the unwindowed block."""
    for label, sq, sk, causal, window in CASES[:-1]:
        if label == "causal-window-larger-than-block":
            continue
        q, k, v, _ = _qkv(sq, sk, h, hkv, torch.float64)
        windowed, _ = TorchKernel().forward(q, k, v, causal=causal, scale=SCALE, window=window)
        full, _ = TorchKernel().forward(q, k, v, causal=causal, scale=SCALE)
        assert rel_err(windowed, full) > 1e-3, label


def test_softcapped_blocks_merge_like_plain_ones():
    """The lse of capped scores merges exactly: two key blocks, merged in fp64, each backward with the merged
    (out, lse), equal the single capped softmax."""
    q, k, v, dout = _qkv(6, 14, 4, 2, torch.float64, seed=3)
    kernel = TorchKernel()
    blocks = [(k[:, :5], v[:, :5]), (k[:, 5:], v[:, 5:])]
    out, lse = kernel.forward(q, *blocks[0], causal=False, scale=SCALE, softcap=CAP)
    merge_into(out, lse, *kernel.forward(q, *blocks[1], causal=False, scale=SCALE, softcap=CAP))
    grads = [kernel.backward(dout, q, kb, vb, out, lse, causal=False, scale=SCALE, softcap=CAP) for kb, vb in blocks]
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, False, (None, None), CAP)
    assert rel_err(out, ref_out) < 1e-12
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    assert rel_err(grads[0][0] + grads[1][0], ref_dq) < 1e-12
    assert rel_err(torch.cat([grads[0][1], grads[1][1]], 1), ref_dk) < 1e-12
    assert rel_err(torch.cat([grads[0][2], grads[1][2]], 1), ref_dv) < 1e-12


@pytest.mark.parametrize("kernel", [TorchKernel(), CpuFlashKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("window,softcap,error,words", [
    ((-1, 0), None, ValueError, "ints >= 0"), ((True, 0), None, ValueError, "ints >= 0"),
    ((2.0, 0), None, ValueError, "ints >= 0"), ([3, 0], None, TypeError, "tuple"),
    ((3,), None, TypeError, "tuple"), ((None, None), 0.0, ValueError, "softcap"),
    ((None, None), float("inf"), ValueError, "softcap"), ((None, None), -2.0, ValueError, "softcap")])
def test_bad_window_or_softcap_is_refused(kernel, window, softcap, error, words):
    q, k, v, _ = _qkv(4, 4, 2, 2, torch.float64)
    with pytest.raises(error, match=words):
        kernel.forward(q, k, v, causal=True, scale=SCALE, window=window, softcap=softcap)


@pytest.mark.parametrize("window,softcap", [((3, 0), None), ((None, 2), None), ((None, None), 5.0)])
def test_sdpa_cpu_kernel_refuses_what_it_cannot_apply(window, softcap):
    q, k, v, dout = _qkv(6, 6, 4, 2, torch.float32)
    kernel = CpuFlashKernel()
    with pytest.raises(ValueError, match="neither sliding windows nor softcap"):
        kernel.forward(q, k, v, causal=True, scale=SCALE, window=window, softcap=softcap)
    out, lse = kernel.forward(q, k, v, causal=True, scale=SCALE, window=(None, None), softcap=None)
    with pytest.raises(ValueError, match="neither sliding windows nor softcap"):
        kernel.backward(dout, q, k, v, out, lse, causal=True, scale=SCALE, window=window, softcap=softcap)
