"""Measuring what a forward pass keeps for backward: every storage created during ``fn`` that is still alive
when it returns (other than the storages of its result), each counted once.

This sees everything backward will use — tensors autograd saved, inputs a checkpoint holds for recomputation,
outputs cached by selective checkpointing, the pinned attention — which ``saved_tensors_hooks`` alone cannot
(checkpoint regions install their own hooks). Storages are tracked by weak reference, so nothing is kept alive
by the measurement itself.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageTracker(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.refs.append((StorageWeakRef(storage), storage.nbytes()))
        return out


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, int]:
    """Runs ``fn()`` and returns ``(result, bytes it left alive for backward)``. Storages of ``exclude``
    (parameters, buffers, inputs: they exist anyway) and of the result are not counted."""
    tracker = _StorageTracker()
    with tracker:
        result = fn()
    gc.collect()     # unreachable reference cycles are not kept for backward: let them go before looking
    leaves = [*tree_leaves(result), *exclude]
    exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in leaves if isinstance(t, torch.Tensor)}
    alive = {}
    for ref, nbytes in tracker.refs:
        if not ref.expired() and ref.cdata not in exclude:
            alive[ref.cdata] = nbytes
    return result, sum(alive.values())
