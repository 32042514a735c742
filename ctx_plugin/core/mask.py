"""One description of the attention's mask: causality, a sliding window and a logit softcap.

``cp_attention`` builds one :class:`Mask` per call and hands it to the backends, which hand it to the layout
plans (which blocks exist, and each block's kernel window) and to the kernels (the softcap). Windows follow
flash-attn / megatron-core: global query position ``i`` sees key position ``j`` iff
``i − left ≤ j ≤ i + right`` (a ``None`` side is unbounded), intersected with ``j ≤ i`` when causal. So the
allowed offsets ``d = j − i`` form one interval, :meth:`Mask.band`::

    causal, window (2, None)         non-causal, window (1, 2)
       j: 0 1 2 3 4 5                   j: 0 1 2 3 4 5
    i=3   · ■ ■ ■ · ·   d ∈ [−2, 0]  i=3   · · ■ ■ ■ ■   d ∈ [−1, 2]

Packed documents (:class:`~ctx_plugin.core.documents.Documents`) restrict this further: query and key must lie in one
document and both be real (not padding). They need no kernel feature: the layouts' plans cut them into blocks.

Attention sinks are not part of the mask (they are a tensor, applied after the blocks are merged:
:mod:`ctx_plugin.core.sinks`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .documents import Documents


def check_window(window) -> tuple[int | None, int | None]:
    """``window`` as a ``(left, right)`` pair of ``None`` or ints ≥ 0; raises TypeError/ValueError otherwise."""
    if window is None:
        return (None, None)
    if not isinstance(window, (tuple, list)):
        raise TypeError(f"window must be None or a (left, right) pair, got {type(window).__name__}")
    if len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair (each None or an int >= 0), got {tuple(window)!r}")
    for side, value in zip(("left", "right"), window):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"window {side} must be None (unlimited) or an int >= 0, got {type(value).__name__} "
                            f"{value!r}")
        if value < 0:
            raise ValueError(f"window {side} must be None (unlimited) or an int >= 0, got {value}; "
                             f"a causal sliding window of w tokens (the query included) is window=(w - 1, 0)")
    return (window[0], window[1])


def check_softcap(softcap) -> float | None:
    """``softcap`` as ``None`` or a finite float > 0; raises TypeError/ValueError otherwise."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be None or a positive finite number, got {type(softcap).__name__}")
    if not finite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r} (None turns it off)")
    return float(softcap)


def finite(value: int | float) -> bool:
    """Whether a number is finite as a float (an int past float's range is not: ``math.isfinite`` raises
    OverflowError for it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


@dataclass(frozen=True)
class Mask:
    """What one attention call computes besides plain softmax attention (checked in ``__post_init__``)."""

    causal: bool
    """Query ``i`` sees only keys ``j ≤ i``."""
    window: tuple = (None, None)
    """``(left, right)``: query ``i`` sees keys ``i − left .. i + right``; ``None`` sides are unbounded (stored
    with ``right = None`` when causal, where it changes nothing)."""
    softcap: float | None = None
    """Scores ``s`` (after the softmax scale) become ``softcap · tanh(s / softcap)`` before the softmax."""
    documents: Documents | None = None
    """The packed documents of the global sequence (``None``: one document, all real)."""

    def __post_init__(self) -> None:
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        left, right = check_window(self.window)
        object.__setattr__(self, "window", (left, None if self.causal else right))   # causal: right changes nothing
        object.__setattr__(self, "softcap", check_softcap(self.softcap))
        if self.documents is not None and not isinstance(self.documents, Documents):
            raise TypeError(f"documents must be None or a ctx_plugin.Documents, got {type(self.documents).__name__}")
        if self.documents is not None and self.documents.count == 1 and self.documents.valid is None:
            object.__setattr__(self, "documents", None)          # one document, all real: no documents

    def within(self, seq_len: int) -> Mask:
        """This mask over a sequence of ``seq_len`` tokens: window sides that reach past it become ``None`` (so a
        window longer than the sequence needs no kernel that applies windows)."""
        left, right = (None if side is not None and side >= seq_len - 1 else side for side in self.window)
        return Mask(self.causal, (left, right), self.softcap, self.documents)

    def band(self) -> tuple[int | None, int | None]:
        """The allowed offsets ``j − i`` as ``(lo, hi)``, ``None`` unbounded; ``lo ≤ 0 ≤ hi`` always."""
        left, right = self.window
        hi = 0 if self.causal else right
        return (None if left is None else -left, hi)

    @property
    def windowed(self) -> bool:
        """Whether the window excludes anything causality does not (a finite side that matters)."""
        left, right = self.window
        return left is not None or (right is not None and not self.causal)

    @property
    def features(self) -> frozenset[str]:
        """The kernel features this mask needs (``KernelSpec.unavailable``'s ``features``)."""
        return frozenset(name for name, needed in (("window", self.windowed), ("softcap", self.softcap is not None))
                         if needed)

    def allows(self, i: int, j: int) -> bool:
        """Whether global query position ``i`` sees key position ``j`` (the definition; tests compare with it)."""
        lo, hi = self.band()
        if not ((lo is None or j - i >= lo) and (hi is None or j - i <= hi)):
            return False
        docs = self.documents
        if docs is None:
            return True
        d = docs.document_of(i)
        return docs.document_of(j) == d and docs.is_real(i) and docs.is_real(j)
