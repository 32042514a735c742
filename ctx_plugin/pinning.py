"""Keeping the context-parallel attention out of recomputation.

Whole-layer and op-level recompute re-run a layer's forward in backward. Re-running the CP attention would
repeat its ring / all-to-all communication, so while a checkpointed region runs its forward, ``cp_attention``
*records*: it runs with its saved tensors kept out of the checkpoint (plain saved tensors, kept until
backward) and remembers its output; while the region is *replayed* in backward, ``cp_attention`` returns the
remembered output without computing or communicating. The state lives on the :class:`CPGroups` object the
attention is called with (no module-level state); :mod:`ctx_plugin.recompute` drives it. Regions under the
``+recompute_attn`` modifier run their attention :meth:`~AttentionPins.unpinned`: recomputed with the region.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
from torch.utils.checkpoint import checkpoint


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class Recording:
    """One forward run of a checkpointed region (regions may run several forwards before their backwards, as in
    pipeline schedules): the attention outputs it remembers for its recomputation. It lives as long as the
    checkpoint that holds it (until that region's backward is done and the graph is freed), so a second backward
    with ``retain_graph=True`` replays the same outputs again."""

    def __init__(self, *, once: bool = False, hooks: tuple[Callable, Callable] | None = None) -> None:
        self.outputs: list = []
        self.replays = 0
        self.once = once
        """Set for regions whose recomputation PyTorch allows only once (selective checkpointing)."""
        self.pack, self.unpack = hooks or (_identity, _identity)
        """How the attention's saved tensors and remembered outputs are kept until backward: as they are, or
        (``+offload_attn``) in host memory (:mod:`ctx_plugin.recompute.offload`)."""


class Reusable:
    """A context manager entered anew on every ``with`` (``torch.utils.checkpoint`` enters a region's recompute
    context on each recomputation, i.e. once per backward; a ``@contextmanager`` object can be entered once)."""

    def __init__(self, factory: Callable[[], AbstractContextManager]) -> None:
        self._factory = factory
        self._open: list[AbstractContextManager] = []

    def __enter__(self):
        manager = self._factory()
        self._open.append(manager)
        return manager.__enter__()

    def __exit__(self, *exc_info):
        return self._open.pop().__exit__(*exc_info)


class AttentionPins:
    """Record/replay state of one :class:`CPGroups` (one model's attention calls)."""

    def __init__(self) -> None:
        self._mode: str | None = None
        self._region: Recording | None = None
        self._next = 0                       # the next remembered output a replay hands out
        self._in_attention = False
        self._recompute_core = False

    @property
    def in_attention(self) -> bool:
        """True while the CP attention runs inside a recording region (its ops are never cached for replay)."""
        return self._in_attention

    @contextmanager
    def _set(self, mode: str | None, region: Recording | None) -> Iterator[None]:
        saved = self._mode, self._region, self._next
        self._mode, self._region, self._next = mode, region, 0
        try:
            yield
        finally:
            self._mode, self._region, self._next = saved

    @contextmanager
    def recording(self, region: Recording) -> Iterator[None]:
        """Forward of a checkpointed region: attention outputs are remembered for its replay."""
        region.outputs.clear()
        with self._set("record", region):
            yield

    @contextmanager
    def replaying(self, region: Recording) -> Iterator[None]:
        """Recomputation of a region in backward: attention calls return the remembered outputs, in order."""
        if region.once and region.replays:
            raise RuntimeError("a second backward through a layer under the 'selective' recompute preset: PyTorch's "
                               "selective checkpointing frees what it saved after the first backward, so "
                               "backward(retain_graph=True) can run only once there; use the 'full', 'sqrt' or "
                               "'mlp' preset (they support repeated backwards) or run the forward again")
        region.replays += 1
        with self._set("replay", region):
            yield

    @contextmanager
    def unpinned(self) -> Iterator[None]:
        """A region whose attention is recomputed with it (``+recompute_attn``), in its forward and its
        recomputation: attention calls run plainly (their tensors saved by the region's checkpoint, their
        communication repeated in backward), whatever mode an enclosing region had set."""
        with self._set(None, None):
            yield

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
            remembered = self._region.outputs
            if self._next >= len(remembered):
                raise RuntimeError("a recomputed region called cp_attention more often than its forward did; "
                                   "the layer's forward must call attention the same way every time")
            self._next += 1
            return self._region.unpack(remembered[self._next - 1])
        if self._mode == "record" and torch.is_grad_enabled():
            with torch.autograd.graph.saved_tensors_hooks(self._region.pack, self._region.unpack):
                self._in_attention = True
                try:
                    out = compute()
                finally:
                    self._in_attention = False
            self._region.outputs.append(self._region.pack(out))
            return out
        if self._recompute_core and torch.is_grad_enabled():
            return checkpoint(compute, use_reentrant=False)
        return compute()
