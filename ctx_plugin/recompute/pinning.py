"""Keeping the context-parallel attention out of recomputation.

Whole-layer and op-level recompute re-run a layer's forward in backward. Re-running the CP attention would
repeat its ring / all-to-all communication, so while a checkpointed region runs its forward, ``cp_attention``
*records*: it runs with its saved tensors kept out of the checkpoint (plain saved tensors, kept until
backward) and remembers its output; while the region is *replayed* in backward, ``cp_attention`` returns the
remembered output without computing or communicating. Regions under the ``+recompute_attn`` modifier run
their attention :func:`unpinned`: recomputed with the region. :mod:`ctx_plugin.recompute.apply` drives it.

The state is context-scoped (a ``ContextVar``; :func:`recording`, :func:`replaying`, :func:`unpinned` and
:func:`recomputing_core` set it for the ``with`` block and reset it on exit; :func:`run` reads it), not kept on
the groups or the model: a region's forward sees only its own recording, and a model called outside any region
runs its attention plainly, so two models never see each other's state. This also holds when backward runs on
autograd's worker threads (CUDA), where the forward's context is not set: ``torch.utils.checkpoint`` enters a
region's recompute context (``context_fn``, :class:`Reusable`) in the thread that recomputes, so the replay
state is set exactly where the recomputed attention calls :func:`run`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace

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


@dataclass(frozen=True)
class _Cursor:
    """The replay position of one entered :func:`replaying` context (the next remembered output it hands out)."""

    region: Recording
    next: list = field(default_factory=lambda: [0])


@dataclass(frozen=True)
class PinState:
    """The record/replay state of the current context (see the module docstring)."""

    mode: str | None = None
    """``"record"``, ``"replay"`` or ``None`` (attention runs plainly)."""
    cursor: _Cursor | None = None
    in_attention: bool = False
    """True while the CP attention runs inside a recording region (its ops are never cached for replay)."""
    recompute_core: bool = False
    """``core_attn``: attention calls checkpoint themselves."""
    recomputing: bool = False
    """True while a region recomputes its layers in backward (:func:`recomputation`): what the layers' modules
    keep on themselves is put back after each layer (:mod:`ctx_plugin.recompute.checkpointing`), and framework
    modules with running state undo what they add (megatron-core's MoE router: :mod:`ctx_plugin.megatron.spec`)."""


_STATE: ContextVar[PinState] = ContextVar("ctx_plugin_attention_pins", default=PinState())


def state() -> PinState:
    """The record/replay state of this context (tests and the selective policy read it)."""
    return _STATE.get()


def in_attention() -> bool:
    """True while the CP attention runs inside a recording region (its ops are never cached for replay)."""
    return _STATE.get().in_attention


@contextmanager
def _entered(**changes) -> Iterator[None]:
    token = _STATE.set(replace(_STATE.get(), **changes))
    try:
        yield
    finally:
        _STATE.reset(token)


@contextmanager
def recording(region: Recording) -> Iterator[None]:
    """Forward of a checkpointed region: attention outputs are remembered for its replay."""
    region.outputs.clear()
    with _entered(mode="record", cursor=_Cursor(region)):
        yield


@contextmanager
def replaying(region: Recording) -> Iterator[None]:
    """Recomputation of a region in backward: attention calls return the remembered outputs, in order."""
    if region.once and region.replays:
        raise RuntimeError("a second backward through a layer under the 'selective' recompute preset: PyTorch's "
                           "selective checkpointing frees what it saved after the first backward, so "
                           "backward(retain_graph=True) can run only once there; use the 'full', 'sqrt' or "
                           "'mlp' preset (they support repeated backwards) or run the forward again")
    region.replays += 1
    with _entered(mode="replay", cursor=_Cursor(region)):
        yield


def unpinned() -> AbstractContextManager:
    """A region whose attention is recomputed with it (``+recompute_attn``), in its forward and its
    recomputation: attention calls run plainly (their tensors saved by the region's checkpoint, their
    communication repeated in backward), whatever mode an enclosing region had set."""
    return _entered(mode=None, cursor=None)


def recomputation() -> AbstractContextManager:
    """A region's recomputation in backward (:attr:`PinState.recomputing`)."""
    return _entered(recomputing=True)


def recomputing_core() -> AbstractContextManager:
    """``core_attn``: attention calls checkpoint themselves (re-run, with communication, in backward)."""
    return _entered(recompute_core=True)


def run(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Runs one attention call (``compute``) according to the current context's state."""
    current = _STATE.get()
    if current.mode == "replay":
        cursor = current.cursor
        remembered = cursor.region.outputs
        if cursor.next[0] >= len(remembered):
            raise RuntimeError("a recomputed region called cp_attention more often than its forward did; "
                               "the layer's forward must call attention the same way every time")
        cursor.next[0] += 1
        return cursor.region.unpack(remembered[cursor.next[0] - 1])
    if current.mode == "record" and torch.is_grad_enabled():
        region = current.cursor.region
        with torch.autograd.graph.saved_tensors_hooks(region.pack, region.unpack), _entered(in_attention=True):
            out = compute()
        region.outputs.append(region.pack(out))
        return out
    if current.recompute_core and torch.is_grad_enabled():
        return checkpoint(compute, use_reentrant=False)
    return compute()
