"""Local attention kernels behind one interface, and the registry that picks one.

``select_kernel(name, device, dtype, head_dim, features)`` returns a kernel object; ``auto`` takes the first
kernel in :func:`auto_order` (fastest first for the device) that can run here and apply every mask feature in
``features`` (``"window"``, ``"softcap"``). Cheap enough to call on every attention call (~10 µs): flash-attn's
import probe runs once per process (:func:`.flash_attn.forget_probe`).
"""
from __future__ import annotations

import torch

from ...names import Kernel
from . import flash_attn, sdpa, sdpa_support
from .base import FEATURES, AttentionKernel, KernelSpec, accum_dtype, describe
from .torch_math import TorchKernel

__all__ = ["AttentionKernel", "KernelSpec", "accum_dtype", "SPECS", "FEATURES", "auto_order", "select_kernel",
           "kernel_unavailable"]

_NONE: frozenset[str] = frozenset()


def _never(device: torch.device, dtype: torch.dtype, head_dim: int, features: frozenset[str] = _NONE) -> str | None:
    """The torch kernel's rule (it applies every feature), also the floor for ``auto``."""
    if not dtype.is_floating_point:
        return f"attention needs floating-point tensors, got {dtype}"
    return None


SPECS: dict[Kernel, KernelSpec] = {
    Kernel.FLASH_ATTN: KernelSpec(Kernel.FLASH_ATTN.value, flash_attn.unavailable, flash_attn.FlashAttnKernel),
    Kernel.SDPA_CUDNN: KernelSpec(Kernel.SDPA_CUDNN.value, sdpa_support.cudnn_unavailable,
                                  lambda device: sdpa.CudnnKernel()),
    Kernel.SDPA_FLASH: KernelSpec(Kernel.SDPA_FLASH.value, sdpa_support.flash_unavailable,
                                  lambda device: sdpa.FlashKernel()),
    Kernel.SDPA_CPU: KernelSpec(Kernel.SDPA_CPU.value, sdpa_support.cpu_unavailable,
                                lambda device: sdpa.CpuFlashKernel()),
    Kernel.TORCH: KernelSpec(Kernel.TORCH.value, _never, lambda device: TorchKernel()),
}
"""Every concrete kernel (read-only by convention: nothing registers at run time)."""


def auto_order(device: torch.device) -> tuple[Kernel, ...]:
    """Kernels fastest first. On Hopper, flash-attn 3 and cuDNN lead (cuDNN measured ~1.8× torch's flash
    kernel on an H200 before this code existed: BENCHMARKS.md); flash-attn 2 sits between cuDNN and torch's flash
    kernel. On the CPU, torch's blockwise flash kernel beats the pure-torch one (which materialises every score)."""
    info = flash_attn.version_info(device) if device.type == "cuda" else None
    if info is not None and info.generation == 3:
        return (Kernel.FLASH_ATTN, Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH, Kernel.SDPA_CPU, Kernel.TORCH)
    return (Kernel.SDPA_CUDNN, Kernel.FLASH_ATTN, Kernel.SDPA_FLASH, Kernel.SDPA_CPU, Kernel.TORCH)


def _check_features(features: frozenset[str]) -> None:
    if not features <= FEATURES:
        raise ValueError(f"unknown kernel features {sorted(features - FEATURES)}; known: {sorted(FEATURES)}")


def kernel_unavailable(name: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int,
                       features: frozenset[str] = _NONE) -> str | None:
    """Why kernel ``name`` cannot run here or cannot apply ``features`` (``None`` when it can). ``auto`` is
    unavailable only for non-floats (the torch kernel applies every feature)."""
    _check_features(features)
    if name == Kernel.AUTO:
        return _never(device, dtype, head_dim)
    return _never(device, dtype, head_dim) or SPECS[name].unavailable(device, dtype, head_dim, features)


def select_kernel(name: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int,
                  features: frozenset[str] = _NONE) -> AttentionKernel:
    """The kernel to run; raises ValueError (with how to get it) when an explicit one is unavailable, naming the
    kernels that can apply ``features`` here when those are what it lacks."""
    reason = kernel_unavailable(name, device, dtype, head_dim, features)
    if reason is not None:
        message = f"kernel {name.value!r} cannot run here: {reason}"
        if features and kernel_unavailable(name, device, dtype, head_dim) is None:
            capable = [c.value for c in auto_order(device)
                       if kernel_unavailable(c, device, dtype, head_dim, features) is None]
            message = (f"kernel {name.value!r} cannot apply {describe(features)} here ({reason}); kernels that "
                       f"can: {', '.join(capable)} (or kernel='auto')")
        raise ValueError(message)
    if name != Kernel.AUTO:
        return SPECS[name].build(device)
    # The torch kernel (last in the order) runs wherever a floating dtype does and applies every feature.
    return next(SPECS[c].build(device) for c in auto_order(device)
                if kernel_unavailable(c, device, dtype, head_dim, features) is None)
