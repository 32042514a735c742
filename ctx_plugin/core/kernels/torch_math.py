"""Pure-PyTorch attention kernel: any device, any float dtype (float64 included). The test oracle.

It materialises the ``[B, H, Sq, Sk]`` score matrix of one block, so it is meant for CPU runs, tests and
small blocks; GPU runs use the fused kernels. Computes in ``accum_dtype`` (float32 or float64). Applies causal
masks, sliding windows and softcap exactly (see :mod:`.base` for their conventions), forward and backward.
"""
from __future__ import annotations

import torch

from .base import FULL, Window, accum_dtype, check_block, keep_mask
from .varlen import LoopedVarlen


def _raw_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores ``[B, Hkv, G, Sq, Sk]`` in the compute dtype; query head h uses KV head h // G."""
    b, sq, h, d = q.shape
    hkv = k.shape[2]
    return torch.einsum("bqkgd,bskd->bkgqs", q.reshape(b, sq, hkv, h // hkv, d), k) * scale


def _masked(s: torch.Tensor, causal: bool, window: Window) -> torch.Tensor:
    keep = keep_mask(s.shape[-2], s.shape[-1], causal, window, s.device)
    return s if keep is None else s.masked_fill(~keep, float("-inf"))


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s − lse) with fully-masked rows (lse = −inf) giving zeros instead of NaN."""
    safe = lse.masked_fill(torch.isneginf(lse), 0.0)
    return torch.exp(s - safe.unsqueeze(-1))


class TorchKernel(LoopedVarlen):
    """Also the varlen pair, one block per sequence (:class:`.varlen.LoopedVarlen`)."""

    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                window: Window = FULL, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        check_block(q, k, causal, window, softcap)
        cd = accum_dtype(q.dtype)
        b, sq, h, d = q.shape
        s = _raw_scores(q.to(cd), k.to(cd), scale)
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = _masked(s, causal, window)
        lse = torch.logsumexp(s, dim=-1)                                    # [B, Hkv, G, Sq]
        out = torch.einsum("bkgqs,bskd->bqkgd", _probs(s, lse), v.to(cd)).reshape(b, sq, h, d)
        return out.to(q.dtype), lse.reshape(b, h, sq)

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float, window: Window = FULL,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        check_block(q, k, causal, window, softcap)
        cd = accum_dtype(q.dtype)
        b, sq, h, d = q.shape
        hkv = k.shape[2]
        g = h // hkv
        q_, k_, v_ = q.to(cd), k.to(cd), v.to(cd)
        do = dout.to(cd).reshape(b, sq, hkv, g, d)
        s = _raw_scores(q_, k_, scale)
        if softcap is not None:
            t = torch.tanh(s / softcap)
            s = softcap * t
        p = _probs(_masked(s, causal, window), lse.to(cd).reshape(b, hkv, g, sq))
        dv = torch.einsum("bkgqs,bqkgd->bskd", p, do)
        dp = torch.einsum("bqkgd,bskd->bkgqs", do, v_)
        delta = (do * out.to(cd).reshape(b, sq, hkv, g, d)).sum(-1).permute(0, 2, 3, 1)   # [B, Hkv, G, Sq]
        ds = p * (dp - delta.unsqueeze(-1))
        if softcap is not None:
            ds = ds * (1 - t * t)                                 # d/ds of c·tanh(s/c)
        dq = torch.einsum("bkgqs,bskd->bqkgd", ds, k_).reshape(b, sq, h, d) * scale
        dk = torch.einsum("bkgqs,bqkgd->bskd", ds, q_.reshape(b, sq, hkv, g, d)) * scale
        return dq, dk, dv
