"""The one interface every local attention kernel implements.

Tensors use the ``[batch, seq, heads, head_dim]`` layout throughout (the layout of the public API and of
flash-attn). ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA); a kernel handles that itself and
returns ``dk``/``dv`` with ``k``'s head count.

``causal=True`` is aligned bottom-right: query i of Sq may see keys ``0 .. i + Sk − Sq`` (so a square block
is the usual lower triangle, and a query chunk attending to the prefix that ends with it is one call).
Blocks with fewer keys than queries are never causal; kernels reject them.

The log-sum-exp is ``[batch, heads, seq]`` in natural log, in ``accum_dtype(q.dtype)`` (float32 for half
precision inputs, float64 for float64 inputs) so partial results can be merged exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype used for LSE, merges and gradient accumulation: at least float32."""
    return torch.promote_types(dtype, torch.float32)


class AttentionKernel(Protocol):
    """forward → (out, lse); backward → (dq, dk, dv)."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``out`` (q's shape and dtype) and ``lse`` ``[B, H, Sq]`` in ``accum_dtype``."""
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of the block given the *final* (merged) ``out`` and ``lse`` of these query rows.

        Returns ``dq`` (q's shape), ``dk`` and ``dv`` (k's shape), in any floating dtype of at least the
        inputs' precision; callers accumulate them in ``accum_dtype``.
        """
        ...


@dataclass(frozen=True)
class KernelSpec:
    """A registry entry: how to build a kernel and when it can run.

    ``unavailable(device, dtype, head_dim)`` returns ``None`` when the kernel can run, else a sentence saying
    why not and how to get it. ``build(device)`` returns the kernel object for that device.
    """

    name: str
    unavailable: Callable[[torch.device, torch.dtype, int], str | None]
    build: Callable[[torch.device], AttentionKernel]


def check_block(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """Shared argument check for kernels (causal blocks need at least as many keys as queries)."""
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention blocks need at least as many keys as queries (bottom-right aligned), "
                         f"got {q.shape[1]} queries and {k.shape[1]} keys")
