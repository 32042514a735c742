"""Measuring what a forward pass keeps for backward, and the peak of a whole forward+backward step.

:func:`saved_bytes` counts every storage created during ``fn`` that is still alive when it returns (other than the
storages of its result), each counted once. This sees everything backward will use — tensors autograd saved,
inputs a checkpoint holds for recomputation, outputs cached by selective checkpointing, the pinned attention —
which ``saved_tensors_hooks`` alone cannot (checkpoint regions install their own hooks). Storages are tracked by
weak reference, so nothing is kept alive by the measurement itself.

:func:`step_bytes` also follows the live bytes after every operator of the forward and the backward and returns
their maximum: the step's activation peak (storages that existed before the step — parameters, their
pre-allocated ``.grad``, inputs — are not counted). Temporaries inside one operator's kernel are not visible.

When a collective ran inside the measured forward (an operator of the ``c10d`` namespace), the saved bytes are read
once they have settled: gloo's worker thread still holds a collective's tensors for a moment after ``wait()``
returns (it drops the finished work when it next takes its queue's lock), and freeing a tensor whose Python object
has already gone needs the GIL, which the worker gets only when the measuring thread blocks. So a temporary sent by
an all-to-all can still be alive after the call that freed it (up to one call in five), and a single read would
count it as kept for backward; the reads sleep between polls, which hands the worker the GIL.
"""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _StorageTracker(TorchDispatchMode):
    def __init__(self, follow_peak: bool = False, ignore: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}
        # Keyed by the storage's address, holding its weak reference: the reference keeps the address reserved
        # (the storage object outlives its data while weakly referenced), so a storage created after an ignored one
        # died is never ignored by taking its address.
        self.ignore: dict[int, StorageWeakRef] = {}
        self.follow_peak, self.peak = follow_peak, 0
        self.collectives = False        # whether a c10d operator (a collective) ran under the tracker
        for t in ignore:
            if isinstance(t, torch.Tensor):
                self.ignore_storage(t)

    def ignore_storage(self, t: torch.Tensor) -> None:
        """Never counts ``t``'s storage from now on (nor any more if already counted)."""
        ref = StorageWeakRef(t.untyped_storage())
        self.refs.pop(ref.cdata, None)
        self.ignore[ref.cdata] = ref

    def live(self) -> int:
        dead = [key for key, (ref, _) in self.refs.items() if ref.expired()]
        for key in dead:
            del self.refs[key]
        return sum(nbytes for _, nbytes in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.collectives = True
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                ref = StorageWeakRef(storage)
                if ref.cdata in self.ignore:
                    continue
                if ref.cdata not in self.refs or self.refs[ref.cdata][0].expired():
                    self.refs[ref.cdata] = (ref, storage.nbytes())
        if self.follow_peak:
            self.peak = max(self.peak, self.live())
        return out


def _alive_except(tracker: _StorageTracker, leaves: Iterable) -> int:
    exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in leaves if isinstance(t, torch.Tensor)}
    return sum(nbytes for key, (ref, nbytes) in tracker.refs.items() if not ref.expired() and key not in exclude)


# A read stands once it has not changed over this many consecutive polls this far apart; the wait ends anyway at
# the deadline (the worker thread lets go within microseconds of its next loop: a tensor still held after two
# seconds is kept by something else, and counts).
_SETTLE_POLLS, _SETTLE_POLL_S, _SETTLE_DEADLINE_S = 5, 0.002, 2.0


def _settled_alive(tracker: _StorageTracker, leaves: Iterable) -> int:
    """Bytes alive besides ``leaves`` after a garbage collection, read until they stop changing when a collective
    ran (see the module docstring)."""
    leaves = list(leaves)
    gc.collect()     # unreachable reference cycles are not kept for backward: let them go before looking
    alive = _alive_except(tracker, leaves)
    if not tracker.collectives:
        return alive
    deadline, same = time.monotonic() + _SETTLE_DEADLINE_S, 0
    while same < _SETTLE_POLLS and time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL_S)
        now = _alive_except(tracker, leaves)
        same = same + 1 if now == alive else 0
        alive = now
    return alive


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> tuple[object, int]:
    """Runs ``fn()`` and returns ``(result, bytes it left alive for backward)``. Storages of ``exclude``
    (parameters, buffers, inputs: they exist anyway) and of the result are not counted."""
    tracker = _StorageTracker()
    with tracker:
        result = fn()
    return result, _settled_alive(tracker, [*tree_leaves(result), *exclude])


def step_bytes(forward: Callable[[], torch.Tensor], backward: Callable[[torch.Tensor], None] | None = None, *,
               exclude: Iterable[torch.Tensor] = ()) -> tuple[int, int]:
    """Runs ``out = forward()`` then ``backward(out)`` (default ``out.backward()``) and returns ``(saved, peak)``:
    the bytes the forward left alive besides ``out``, and the most bytes alive at once after any operator of
    either pass. Storages of ``exclude`` (parameters, their ``.grad``, buffers, inputs) are never counted:
    pre-allocate parameters' ``.grad`` (zeros) so gradients accumulate in place and only their per-operator
    temporaries are seen."""
    tracker = _StorageTracker(follow_peak=True, ignore=exclude)
    with tracker:
        out = forward()
        saved = _settled_alive(tracker, tree_leaves(out))
        if backward is None:
            out.backward()
        else:
            backward(out)
        del out
    return saved, tracker.peak
