"""Local attention kernels behind one interface, and the registry that picks one.

``select_kernel(name, device, dtype, head_dim)`` returns a kernel object; ``auto`` takes the first
available kernel in :func:`auto_order`, which lists them fastest first for the device.
"""
from __future__ import annotations

import torch

from ..names import Kernel
from . import flash_attn, sdpa
from .base import AttentionKernel, KernelSpec, accum_dtype
from .torch_math import TorchKernel

__all__ = ["AttentionKernel", "KernelSpec", "accum_dtype", "SPECS", "auto_order", "select_kernel",
           "kernel_unavailable"]


def _never(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    if not dtype.is_floating_point:
        return f"attention needs floating-point tensors, got {dtype}"
    return None


SPECS: dict[Kernel, KernelSpec] = {
    Kernel.FLASH_ATTN: KernelSpec(Kernel.FLASH_ATTN.value, flash_attn.unavailable, flash_attn.FlashAttnKernel),
    Kernel.SDPA_CUDNN: KernelSpec(Kernel.SDPA_CUDNN.value, sdpa.cudnn_unavailable,
                                  lambda device: sdpa.CudnnKernel()),
    Kernel.SDPA_FLASH: KernelSpec(Kernel.SDPA_FLASH.value, sdpa.flash_unavailable,
                                  lambda device: sdpa.FlashKernel()),
    Kernel.SDPA_CPU: KernelSpec(Kernel.SDPA_CPU.value, sdpa.cpu_unavailable, lambda device: sdpa.CpuFlashKernel()),
    Kernel.TORCH: KernelSpec(Kernel.TORCH.value, _never, lambda device: TorchKernel()),
}
"""Every concrete kernel (read-only by convention: nothing registers at run time)."""


def auto_order(device: torch.device) -> tuple[Kernel, ...]:
    """Kernels fastest first. On Hopper, flash-attn 3 and cuDNN lead (cuDNN measured ~1.8× torch's flash
    kernel on an H200, DESIGN.md §5); flash-attn 2 sits between cuDNN and torch's flash kernel. On the CPU,
    torch's blockwise flash kernel beats the pure-torch one (which materialises every score)."""
    info = flash_attn.version_info(device) if device.type == "cuda" else None
    if info is not None and info.generation == 3:
        return (Kernel.FLASH_ATTN, Kernel.SDPA_CUDNN, Kernel.SDPA_FLASH, Kernel.SDPA_CPU, Kernel.TORCH)
    return (Kernel.SDPA_CUDNN, Kernel.FLASH_ATTN, Kernel.SDPA_FLASH, Kernel.SDPA_CPU, Kernel.TORCH)


def kernel_unavailable(name: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why kernel ``name`` cannot run here (``None`` when it can). ``auto`` is unavailable only for non-floats."""
    if name == Kernel.AUTO:
        return _never(device, dtype, head_dim)
    return _never(device, dtype, head_dim) or SPECS[name].unavailable(device, dtype, head_dim)


def select_kernel(name: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> AttentionKernel:
    """The kernel to run; raises ValueError (with how to get it) when an explicit one is unavailable."""
    reason = kernel_unavailable(name, device, dtype, head_dim)
    if reason is not None:
        raise ValueError(f"kernel {name.value!r} cannot run here: {reason}")
    if name != Kernel.AUTO:
        return SPECS[name].build(device)
    # The torch kernel (last in the order) runs wherever a floating dtype does, so this always finds one.
    return next(SPECS[c].build(device) for c in auto_order(device)
                if kernel_unavailable(c, device, dtype, head_dim) is None)
