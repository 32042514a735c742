"""torch's fused CUDA attention entry points (cuDNN and FlashAttention-2), called through their aten ops
because ring attention needs the log-sum-exp in forward and a backward that takes the merged out/lse.

Both ops take ``[B, H, S, D]`` views (we pass transposes of our ``[B, S, H, D]`` tensors, no copies) and
need equal head counts, so GQA K/V heads are expanded for the call and their gradients summed back.
Checked on torch 2.13 (schemas, meta kernels); the CUDA behaviour is covered by ``tests/gpu``.
"""
from __future__ import annotations

import torch

from .base import check_block

_HALF = (torch.float16, torch.bfloat16)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.reshape(b, s, h // groups, groups, d).sum(3)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def unavailable_common(device: torch.device, dtype: torch.dtype, head_dim: int, what: str,
                       max_head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"{what} needs a CUDA device (got {device.type}); use kernel='torch' or 'auto' on this device"
    if dtype not in _HALF:
        return f"{what} supports float16 and bfloat16 only (got {dtype}); use kernel='torch' for {dtype}"
    if head_dim % 8 or head_dim > max_head_dim:
        return f"{what} needs a head size that is a multiple of 8 and at most {max_head_dim} (got {head_dim})"
    return None


def cudnn_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    reason = unavailable_common(device, dtype, head_dim, "torch's cuDNN attention", 128)
    if reason is None and not torch.backends.cudnn.is_available():
        reason = "torch's cuDNN attention needs cuDNN, which this torch build cannot load"
    return reason


def flash_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    reason = unavailable_common(device, dtype, head_dim, "torch's flash attention", 256)
    if reason is None and not torch.backends.cuda.is_flash_attention_available():
        reason = "this torch build has no flash attention kernel; use kernel='sdpa_cudnn' or 'torch'"
    return reason


class _SdpaKernel:
    """Shared GQA handling; subclasses call the aten forward/backward ops."""

    name = ""

    def forward(self, q, k, v, *, causal: bool, scale: float):
        check_block(q, k, causal)
        g = q.shape[2] // k.shape[2]
        out, lse = self._fwd(_bhsd(q), _bhsd(_expand_kv(k, g)), _bhsd(_expand_kv(v, g)), causal, scale)
        return _bhsd(out), lse.reshape(lse.shape[:3]).float()

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        check_block(q, k, causal)
        g = q.shape[2] // k.shape[2]
        dq, dk, dv = self._bwd(_bhsd(dout.to(q.dtype)), _bhsd(q), _bhsd(_expand_kv(k, g)), _bhsd(_expand_kv(v, g)),
                               _bhsd(out.to(q.dtype)), lse.float().contiguous(), causal, scale)
        return _bhsd(dq), _reduce_kv(_bhsd(dk), g), _reduce_kv(_bhsd(dv), g)


class CudnnKernel(_SdpaKernel):
    name = "sdpa_cudnn"

    def _fwd(self, q, k, v, causal, scale):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)
        return res[0], res[1]                                   # lse: [B, H, S, 1]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # unused: no dropout
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, seed, None, None, None, q.shape[2], k.shape[2], 0.0,
            causal, scale=scale)


class FlashKernel(_SdpaKernel):
    name = "sdpa_flash"

    def _fwd(self, q, k, v, causal, scale):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]                                   # lse: [B, H, S]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # unused: no dropout
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed, scale=scale)
