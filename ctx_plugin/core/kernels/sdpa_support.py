"""When torch's fused attention kernels can run (:mod:`.sdpa`): device, dtype, head size, hardware and build, and
the mask features they apply, each refusal naming the kernel to use instead. Checked against torch 2.13's
``sdp_utils.cpp``."""
from __future__ import annotations

import torch

from .base import describe

_HALF = (torch.float16, torch.bfloat16)

# torch 2.13's sdp_utils.cpp: cuDNN attention and the flash kernel both accept [sm80, sm121] (check_sm_version);
# FlashAttention-2 has no sm75 kernels (torch's sm75 support ended with FlashAttention-1, torch < 2.2).
_SM_RANGE = ((8, 0), (12, 1))
_CUDNN_MAX_HEAD_DIM = 128   # 256 needs sm90/sm10x, cuDNN > 9.22 and a cudnn-frontend >= 1.24 build (not visible here)


def _no_features(features: frozenset[str], what: str) -> str | None:
    """These aten ops take no softcap (and cuDNN's and the CPU kernel's no window), so these kernels refuse it
    (``auto`` then falls back to flash-attn or the torch kernel)."""
    if features:
        return f"{what} applies no {describe(features)}; kernel='torch' or 'flash_attn' (or 'auto') can"
    return None


def _common(device: torch.device, dtype: torch.dtype, head_dim: int, what: str, max_head_dim: int) -> str | None:
    if device.type != "cuda":
        return f"{what} needs a CUDA device (got {device.type}); use kernel='torch' or 'auto' on this device"
    if dtype not in _HALF:
        return f"{what} supports float16 and bfloat16 only (got {dtype}); use kernel='torch' for {dtype}"
    if head_dim % 8 or head_dim > max_head_dim:
        return f"{what} needs a head size that is a multiple of 8 and at most {max_head_dim} (got {head_dim})"
    return None


def _hardware(device: torch.device, what: str) -> tuple[tuple[int, int] | None, str | None]:
    """(compute capability, None) on a usable NVIDIA GPU in torch's range, else (None or capability, reason)."""
    if not torch.cuda.is_available():
        return None, f"{what} needs CUDA, but torch.cuda.is_available() is False; use kernel='auto'"
    cap = tuple(torch.cuda.get_device_capability(device))
    if torch.version.hip is None and not _SM_RANGE[0] <= cap <= _SM_RANGE[1]:
        return cap, (f"{what} runs on sm80 to sm121 GPUs only (torch's own check), {device} is sm{cap[0]}{cap[1]}; "
                     f"use kernel='auto' (it falls back) or 'torch'")
    return cap, None


def cudnn_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int,
                      features: frozenset[str] = frozenset()) -> str | None:
    what = "torch's cuDNN attention"
    reason = _no_features(features, what) or _common(device, dtype, head_dim, what, _CUDNN_MAX_HEAD_DIM)
    if reason is None and torch.version.hip is not None:
        reason = f"{what} is not part of ROCm builds of torch; use kernel='sdpa_flash' or 'auto'"
    if reason is None and not torch.backends.cudnn.is_available():
        reason = f"{what} needs cuDNN, which this torch build cannot load"
    if reason is None and (torch.backends.cudnn.version() or 0) < 90000:
        reason = (f"{what} needs cuDNN 9.0 or newer (torch refuses older ones), this is "
                  f"{torch.backends.cudnn.version()}; use kernel='auto'")
    return reason or _hardware(device, what)[1]


def flash_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int,
                      features: frozenset[str] = frozenset()) -> str | None:
    what = "torch's flash attention"
    reason = _no_features(features - {"window"}, what) or _common(device, dtype, head_dim, what, 256)
    if reason is None and not torch.backends.cuda.is_flash_attention_available():
        reason = "this torch build has no flash attention kernel; use kernel='sdpa_cudnn' or 'torch'"
    if reason is not None:
        return reason
    cap, reason = _hardware(device, what)
    if reason is None and torch.version.hip is None and 192 < head_dim <= 224 \
            and ((8, 6) <= cap <= (8, 9) or (12, 0) <= cap <= (12, 1)):
        # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: no backward for these sizes.
        reason = (f"{what} has no backward for head sizes 193-224 on sm86-sm89 and sm120-sm121 GPUs ({device} is "
                  f"sm{cap[0]}{cap[1]}, head size {head_dim}); use kernel='auto' or 'torch'")
    return reason


def cpu_unavailable(device: torch.device, dtype: torch.dtype, head_dim: int,
                    features: frozenset[str] = frozenset()) -> str | None:
    if features:
        return _no_features(features, "torch's CPU flash attention")
    if device.type != "cpu":
        return f"torch's CPU flash attention runs on the CPU only (got {device.type}); use kernel='auto'"
    if dtype not in (torch.float32, torch.float64, *_HALF):
        return f"torch's CPU flash attention supports float64/float32/bfloat16/float16, got {dtype}"
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return f"torch {torch.__version__} has no CPU flash attention op; use kernel='torch'"
    return None
