"""Counting communication operations: an observer for :func:`ctx_plugin.core.comm.observing` (tests and diagnostics).

    counter = CommCounter()
    with counter.counting():
        out = cp_attention(q, k, v, config=config, groups=groups)
    out.backward(dout)          # counted too: the attention's backward reports to its forward's observers
    counter.counts["ring_kv"]

Kinds are those of :mod:`ctx_plugin.core.comm` (``"ring_kv"``, ``"ring_dkv"``, ``"a2a"``, ``"allgather_kv"``,
``"reduce_scatter_dkv"``, ``"reduce_scatter_grad"``, ``"agree"``).
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from ..core import comm


@dataclass(eq=False)
class CommCounter:
    """Counts the communication operations issued while it is active (:meth:`counting`), and the backwards of
    the forwards run then (also on autograd's worker threads)."""

    counts: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] += n

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def counting(self) -> AbstractContextManager:
        """``with counter.counting():`` counts what runs inside (nested counters each count)."""
        return comm.observing(self)
