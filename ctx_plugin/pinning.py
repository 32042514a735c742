"""Keeping the context-parallel attention out of recomputation.

Whole-layer and op-level recompute re-run a layer's forward in backward. Re-running the CP attention would
repeat its ring / all-to-all communication, so while a checkpointed region runs its forward, ``cp_attention``
*records*: it runs with its saved tensors kept out of the checkpoint (plain saved tensors, kept until
backward) and remembers its output; while the region is *replayed* in backward, ``cp_attention`` returns the
remembered output without computing or communicating. The state lives on the :class:`CPGroups` object the
attention is called with (no module-level state); :mod:`ctx_plugin.recompute` drives it.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Recording:
    """One forward run of a checkpointed region (regions may run several forwards before their backwards, as in
    pipeline schedules): the key of its remembered attention outputs, alive while its recomputation may run."""


class AttentionPins:
    """Record/replay state of one :class:`CPGroups` (one model's attention calls)."""

    def __init__(self) -> None:
        self._mode: str | None = None
        self._region: Recording | None = None
        # Entries vanish with their Recording (held by the checkpoint until backward), even without a backward.
        self._cache: weakref.WeakKeyDictionary[Recording, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        self._in_attention = False
        self._recompute_core = False

    @property
    def in_attention(self) -> bool:
        """True while the CP attention runs inside a recording region (its ops are never cached for replay)."""
        return self._in_attention

    @contextmanager
    def _set(self, mode: str | None, region: Recording | None) -> Iterator[None]:
        saved = self._mode, self._region
        self._mode, self._region = mode, region
        try:
            yield
        finally:
            self._mode, self._region = saved

    @contextmanager
    def recording(self, region: Recording) -> Iterator[None]:
        """Forward of a checkpointed region: attention outputs are remembered for its replay."""
        self._cache[region] = []
        with self._set("record", region):
            yield

    @contextmanager
    def replaying(self, region: Recording) -> Iterator[None]:
        """Recomputation of a region in backward: attention calls return the remembered outputs."""
        with self._set("replay", region):
            yield
        self._cache.pop(region, None)

    @contextmanager
    def recomputing_core(self) -> Iterator[None]:
        """``core_attn``: attention calls checkpoint themselves (re-run, with communication, in backward)."""
        saved, self._recompute_core = self._recompute_core, True
        try:
            yield
        finally:
            self._recompute_core = saved

    def run(self, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Runs one attention call (``compute``) according to the current mode."""
        if self._mode == "replay":
            remembered = self._cache.get(self._region)
            if not remembered:
                raise RuntimeError("a recomputed region called cp_attention more often than its forward did; "
                                   "the layer's forward must call attention the same way every time")
            return remembered.pop(0)
        if self._mode == "record" and torch.is_grad_enabled():
            with torch.autograd.graph.saved_tensors_hooks(_identity, _identity):
                self._in_attention = True
                try:
                    out = compute()
                finally:
                    self._in_attention = False
            self._cache[self._region].append(out)
            return out
        if self._recompute_core and torch.is_grad_enabled():
            return checkpoint(compute, use_reentrant=False)
        return compute()
