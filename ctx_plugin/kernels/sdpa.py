"""torch's fused attention entry points (cuDNN and FlashAttention-2 on CUDA, blockwise flash on CPU), called
through their aten ops
because ring attention needs the log-sum-exp in forward and a backward that takes the merged out/lse.

Both ops take ``[B, H, S, D]`` views (we pass transposes of our ``[B, S, H, D]`` tensors, no copies) and
need equal head counts, so GQA K/V heads are expanded for the call and their gradients summed back. Their
``is_causal`` is aligned top-left, so a causal block with more keys than queries (bottom-right, see base.py)
runs as a full block over the leading keys plus a square causal block, merged in fp32.
Checked on torch 2.13 (schemas, meta kernels); the CUDA behaviour is covered by ``tests/gpu``.
"""
from __future__ import annotations

import torch

from ..merge import merge_into
from .base import accum_dtype, check_block

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


def cpu_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if device.type != "cpu":
        return f"torch's CPU flash attention runs on the CPU only (got {device.type}); use kernel='auto'"
    if dtype not in (torch.float32, torch.float64, *_HALF):
        return f"torch's CPU flash attention supports float64/float32/bfloat16/float16, got {dtype}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return f"torch {torch.__version__} has no CPU flash attention op; use kernel='torch'"
    return None


class _SdpaKernel:
    """Shared GQA handling; subclasses call the aten forward/backward ops."""

    name = ""

    def forward(self, q, k, v, *, causal: bool, scale: float):
        check_block(q, k, causal)
        lead = k.shape[1] - q.shape[1]
        if causal and lead:
            out, lse = self._block_forward(q, k[:, :lead], v[:, :lead], False, scale)
            out = out.to(accum_dtype(q.dtype))
            merge_into(out, lse, *self._block_forward(q, k[:, lead:], v[:, lead:], True, scale))
            return out.to(q.dtype), lse
        return self._block_forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float):
        check_block(q, k, causal)
        lead = k.shape[1] - q.shape[1]
        if causal and lead:
            dq, dk0, dv0 = self._block_backward(dout, q, k[:, :lead], v[:, :lead], out, lse, False, scale)
            dq1, dk1, dv1 = self._block_backward(dout, q, k[:, lead:], v[:, lead:], out, lse, True, scale)
            acc = accum_dtype(q.dtype)
            return dq.to(acc) + dq1.to(acc), torch.cat((dk0, dk1), 1), torch.cat((dv0, dv1), 1)
        return self._block_backward(dout, q, k, v, out, lse, causal, scale)

    def _block_forward(self, q, k, v, causal: bool, scale: float):
        g = q.shape[2] // k.shape[2]
        out, lse = self._fwd(_bhsd(q), _bhsd(_expand_kv(k, g)), _bhsd(_expand_kv(v, g)), causal, scale)
        return _bhsd(out), lse.reshape(lse.shape[:3]).to(accum_dtype(q.dtype))

    def _block_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        g = q.shape[2] // k.shape[2]
        dq, dk, dv = self._bwd(_bhsd(dout.to(q.dtype)), _bhsd(q), _bhsd(_expand_kv(k, g)), _bhsd(_expand_kv(v, g)),
                               _bhsd(out.to(q.dtype)), lse.to(accum_dtype(q.dtype)).contiguous(), causal, scale)
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


class CpuFlashKernel(_SdpaKernel):
    name = "sdpa_cpu"

    def _fwd(self, q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                                   causal, scale=scale)
