"""Pure-PyTorch attention kernel: any device, any float dtype (float64 included). The test oracle.

It materialises the ``[B, H, Sq, Sk]`` score matrix of one block, so it is meant for CPU runs, tests and
small blocks; GPU runs use the fused kernels. Computes in ``accum_dtype`` (float32 or float64).
"""
from __future__ import annotations

import torch

from .base import accum_dtype, check_block


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Scores ``[B, Hkv, G, Sq, Sk]`` in the compute dtype; query head h uses KV head h // G."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, sq, hkv, h // hkv, d)
    s = torch.einsum("bqkgd,bskd->bkgqs", qg, k) * scale
    if causal:
        mask = torch.ones(sq, k.shape[1], dtype=torch.bool, device=q.device).triu_(1 + k.shape[1] - sq)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s − lse) with fully-masked rows (lse = −inf) giving zeros instead of NaN."""
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    return torch.exp(s - safe.unsqueeze(-1))


class TorchKernel:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        check_block(q, k, causal)
        cd = accum_dtype(q.dtype)
        b, sq, h, d = q.shape
        s = _scores(q.to(cd), k.to(cd), causal, scale)
        lse = torch.logsumexp(s, dim=-1)                                    # [B, Hkv, G, Sq]
        out = torch.einsum("bkgqs,bskd->bqkgd", _probs(s, lse), v.to(cd)).reshape(b, sq, h, d)
        return out.to(q.dtype), lse.reshape(b, h, sq)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_block(q, k, causal)
        cd = accum_dtype(q.dtype)
        b, sq, h, d = q.shape
        hkv = k.shape[2]
        g = h // hkv
        q_, k_, v_ = q.to(cd), k.to(cd), v.to(cd)
        do = dout.to(cd).reshape(b, sq, hkv, g, d)
        p = _probs(_scores(q_, k_, causal, scale), lse.to(cd).reshape(b, hkv, g, sq))
        dv = torch.einsum("bkgqs,bqkgd->bskd", p, do)
        dp = torch.einsum("bqkgd,bskd->bkgqs", do, v_)
        delta = (do * out.to(cd).reshape(b, sq, hkv, g, d)).sum(-1).permute(0, 2, 3, 1)   # [B, Hkv, G, Sq]
        ds = p * (dp - delta.unsqueeze(-1))
        dq = torch.einsum("bkgqs,bskd->bqkgd", ds, k_).reshape(b, sq, h, d) * scale
        dk = torch.einsum("bkgqs,bqkgd->bskd", ds, q_.reshape(b, sq, hkv, g, d)) * scale
        return dq, dk, dv
