"""Merging partial attention results (out, lse) computed over disjoint key sets, in place, in fp32/fp64.

For two partial results over key sets A and B of the same query rows::

    lse = logaddexp(lse_A, lse_B)
    out = out_A · exp(lse_A − lse) + out_B · exp(lse_B − lse)

Rows where both are −inf (no keys yet) stay zero with lse −inf instead of becoming NaN.

:func:`merge_into` runs the fused Triton kernel (``kernels/merge_triton.py``: one read of the block output
and the accumulators, one write) for fp32 accumulators on CUDA when triton is importable, and
:func:`merge_into_torch`, the reference, everywhere else (CPU, fp64 accumulators, no triton, autograd).
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from ..names import Part
from .profiling import span


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Folds ``(block_out, block_lse)`` into the accumulators ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]``.

    ``out``/``lse`` may be views (slices of the full accumulators); they are updated in place.
    """
    with span(Part.MERGE):
        if _can_fuse(out, lse, block_out, block_lse):
            merge_into_fused(out, lse, block_out, block_lse)
        else:
            merge_into_torch(out, lse, block_out, block_lse)


def merge_into_torch(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                     block_lse: torch.Tensor) -> None:
    """The reference merge in plain torch ops (any device and accumulator dtype); as :func:`merge_into`."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = new_lse.masked_fill(torch.isneginf(new_lse), 0.0)
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)          # [B, S, H, 1]
    w_new = torch.exp(block_lse.to(lse.dtype) - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(block_out, w_new)        # no fp32 copy of block_out, no temporary product
    lse.copy_(new_lse)


def merge_into_fused(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                     block_lse: torch.Tensor) -> None:
    """:func:`merge_into` as one Triton kernel; needs triton and float32 ``out``/``lse``.

    Every tensor is read through its strides (no copies; ``out``/``lse`` are updated in place). The tensors
    must be on a GPU triton can compile for, or on the CPU under triton's interpreter (``TRITON_INTERPRET=1``
    set before triton kernels are first imported). Not differentiable.
    """
    module = _fused_module()
    if module is None:
        raise RuntimeError("merge_into_fused needs triton, which cannot be imported here; use merge_into")
    b, s, h, d = out.shape
    if out.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"merge_into_fused needs float32 out and lse, got {out.dtype} and {lse.dtype}")
    if block_out.shape != out.shape or lse.shape != (b, h, s) or block_lse.shape != lse.shape:
        raise ValueError(f"merge_into_fused needs out/block_out [B, S, H, D] and lse/block_lse [B, H, S] of the "
                         f"same sizes, got {tuple(out.shape)}, {tuple(block_out.shape)}, {tuple(lse.shape)}, "
                         f"{tuple(block_lse.shape)}")
    if len({t.device for t in (out, lse, block_out, block_lse)}) != 1:
        raise ValueError("merge_into_fused needs all four tensors on one device")
    module.merge(out, lse, block_out, block_lse)


def _can_fuse(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> bool:
    if not (out.is_cuda and out.dtype == torch.float32 and lse.dtype == torch.float32):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (out, lse, block_out, block_lse)):
        return False                    # the kernel writes behind autograd's back
    return _fused_module() is not None


@functools.cache
def _fused_module() -> ModuleType | None:
    """The Triton merge module, or ``None`` when triton cannot be imported (probed once, on first use)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    from .kernels import merge_triton
    return merge_triton
