"""Dense single-process attention in plain PyTorch autograd: the reference every test compares against."""
from __future__ import annotations

import torch


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v on ``[B, S, H, D]`` tensors; GQA K/V heads via repeat_interleave."""
    h, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hkv, dim=2)
    v = v.repeat_interleave(h // hkv, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def dense_with_grads(q, k, v, dout, *, causal: bool, scale: float | None = None):
    """Output and (dq, dk, dv) of :func:`dense_attention` for upstream gradient ``dout``."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = dense_attention(q, k, v, causal=causal, scale=scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Norm-wise relative error: max |got − want| / max |want| (computed in float64)."""
    got, want = got.double(), want.double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-300)).item()
