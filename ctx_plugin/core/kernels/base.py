"""The one interface every local attention kernel implements.

Tensors use the ``[batch, seq, heads, head_dim]`` layout throughout (the layout of the public API and of
flash-attn). ``k``/``v`` may have fewer heads than ``q`` (GQA/MQA); a kernel handles that itself and
returns ``dk``/``dv`` with ``k``'s head count.

``causal=True`` is aligned bottom-right: query i of Sq may see keys ``0 .. i + Sk − Sq`` (so a square block
is the usual lower triangle, and a query chunk attending to the prefix that ends with it is one call).
Blocks with fewer keys than queries are never causal; kernels reject them.

``window=(left, right)`` (flash-attn's convention, also bottom-right aligned): query row a sees key b iff
``a + (Sk − Sq) − left <= b <= a + (Sk − Sq) + right``, each side an int >= 0 or ``None`` (unbounded), and also
``b <= a + (Sk − Sq)`` when causal. Callers hand kernels blocks in which every query row has at least one key.
``softcap=c`` (a float > 0, or ``None``) replaces the scaled scores s by ``c·tanh(s / c)`` before the softmax;
the LSE is that of the capped scores, so merging partial results is unchanged.

The log-sum-exp is ``[batch, heads, seq]`` in natural log, in ``accum_dtype(q.dtype)`` (float32 for half
precision inputs, float64 for float64 inputs) so partial results can be merged exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

Window = tuple[int | None, int | None]
"""(left, right): how far before/after its own (bottom-right aligned) position a query sees; None = unbounded."""
FULL: Window = (None, None)
FEATURES = frozenset({"window", "softcap"})
"""Mask features a kernel may or may not apply (``ctx_plugin.core.mask.Mask.features`` names the ones a call needs)."""


def describe(features: frozenset[str]) -> str:
    """``{"window", "softcap"}`` → ``"sliding windows and softcap"`` (sorted, for messages)."""
    words = {"window": "sliding windows", "softcap": "softcap"}
    return " and ".join(words[f] for f in sorted(features))


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype used for LSE, merges and gradient accumulation: at least float32."""
    return torch.promote_types(dtype, torch.float32)


class AttentionKernel(Protocol):
    """forward → (out, lse); backward → (dq, dk, dv)."""

    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                window: Window = FULL, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``out`` (q's shape and dtype) and ``lse`` ``[B, H, Sq]`` in ``accum_dtype``."""
        ...

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, *, causal: bool, scale: float, window: Window = FULL,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of the block given the *final* (merged) ``out`` and ``lse`` of these query rows.

        Returns ``dq`` (q's shape), ``dk`` and ``dv`` (k's shape), in any floating dtype of at least the
        inputs' precision; callers accumulate them in ``accum_dtype``.
        """
        ...


@dataclass(frozen=True)
class KernelSpec:
    """A registry entry: how to build a kernel and when it can run.

    ``unavailable(device, dtype, head_dim, features=frozenset())`` returns ``None`` when the kernel can run and
    apply every feature in ``features`` (a subset of :data:`FEATURES`), else a sentence saying why not and how to
    get it. ``build(device)`` returns the kernel object for that device.
    """

    name: str
    unavailable: Callable[[torch.device, torch.dtype, int, frozenset[str]], str | None]
    build: Callable[[torch.device], AttentionKernel]


def check_block(q: torch.Tensor, k: torch.Tensor, causal: bool, window: Window = FULL,
                softcap: float | None = None) -> None:
    """Shared argument check for kernels (causal blocks need at least as many keys as queries; window sides are
    ints >= 0 or None; softcap is None or a finite float > 0)."""
    if causal and q.shape[1] > k.shape[1]:
        raise ValueError(f"causal attention blocks need at least as many keys as queries (bottom-right aligned), "
                         f"got {q.shape[1]} queries and {k.shape[1]} keys")
    if not isinstance(window, tuple) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) tuple, got {window!r}")
    for side in window:
        if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side < 0):
            raise ValueError(f"window sides must be ints >= 0 or None, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def is_windowed(window: Window) -> bool:
    """Whether ``window`` bounds either side."""
    return window[0] is not None or window[1] is not None


def keep_mask(sq: int, sk: int, causal: bool, window: Window, device: torch.device) -> torch.Tensor | None:
    """``[sq, sk]`` bool, True where query row a may see key b (bottom-right aligned); None when all may."""
    left, right = window
    if not causal and left is None and right is None:
        return None
    diff = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= diff <= 0
    if right is not None:
        keep &= diff <= right
    if left is not None:
        keep &= diff >= -left
    return keep


def fa2_window(sq: int, sk: int, causal: bool, window: Window) -> Window | None:
    """``window`` as FlashAttention-2 must be given it for an ``sq`` × ``sk`` block (bottom-right aligned; None: a
    side left unbounded), or None when it bounds nothing beyond ``causal`` (plain attention then).

    FlashAttention-2 (``flash_api.cpp``: ``mha_fwd``/``mha_bwd``, then ``set_params_fprop``; torch's copy alike)
    reads a side ``>= Sk`` as unbounded, and then gives an unbounded right side next to a bounded left one the value
    Sk. Both are exact for every row only when ``Sq <= Sk + 1`` (a right side of Sk reaches the last key from row
    ``Sq − Sk − 1`` on). A non-causal block with more queries than that whose window bounds the left side, or bounds
    the right side at ``>= Sk`` where some row still sees fewer keys, is a LookupError: run it on a kernel that
    takes the mask as it is (the torch kernel). The 2024 FlashAttention-3 builds (clamping each side to Sk, an
    unbounded one set to Sk) apply the sides returned here exactly too, and hide the same keys otherwise."""
    left = None if window[0] is None or window[0] >= sk - 1 else int(window[0])   # reaches key 0 from every row
    right = None if causal or window[1] is None or window[1] >= sq - 1 else int(window[1])
    if left is None and right is None:
        return None
    if not causal and sq > sk + 1 and (right is None or right >= sk):       # right None: left is bounded
        raise LookupError(f"FlashAttention-2 cannot apply window {window} to a non-causal {sq} × {sk} block")
    return left, right


def fa2_max_seqlen_k(max_q: int, max_k: int, causal: bool, window: Window) -> int:
    """The ``max_seqlen_k`` to give FlashAttention-2's varlen call: at least ``max_q − 1`` when the window bounds the
    left side and not the right of a non-causal call, so the value it gives that right side (``max_seqlen_k``, see
    :func:`fa2_window`) reaches every sequence's last key from its first row; the actual longest key sequence
    otherwise (the argument is an upper bound; a larger one changes no result)."""
    if not causal and window[0] is not None and window[1] is None:
        return max(max_k, max_q - 1)
    return max_k
