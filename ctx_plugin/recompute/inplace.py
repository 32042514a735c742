"""Collectives that write into their input inside a ``selective`` region (Megatron's RowParallelLinear without
sequence parallelism all-reduces its matmul's output in place; DeepSpeed's AutoTP linears do the same).

Selective checkpointing keeps a saved matmul output as the very tensor the forward goes on with. PyTorch notices an
in-place operator changing it later (its version counter) and stops the backward with an error; a collective's write
does not move that counter, so the saved output silently holds the reduced values, and a recomputation that ran the
all-reduce again would reduce them twice (every gradient upstream off by the tensor-parallel factor). So an in-place
collective on a saved output is saved itself (its recomputation returns the result the forward already has), and
recomputed like every other collective otherwise. A recomputed operator that read the saved output before the
collective changed it would read the reduced values in backward: that is an error, not a silent difference.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

_c10d = torch.ops.c10d
_WRITES_INPUT = frozenset(getattr(_c10d, name).default for name in ("allreduce_", "broadcast_", "reduce_")
                          if hasattr(_c10d, name))
"""The c10d operators that write the result into the tensors they are given (their first argument)."""


def _storage(t: torch.Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


class SavedOutputs(TorchDispatchMode):
    """Entered inside the selective forward's caching mode (so it sees each operator first): which storages the
    saved operators' outputs live in, and whether a recomputed operator read one of them since it last changed.
    :meth:`policy` wraps the region's policy with the decision for in-place collectives."""

    def __init__(self, base) -> None:
        super().__init__()
        self.base = base
        self.saved: dict[int, list] = {}      # storage → [weak reference (keeps the key's address reserved), read]

    def _writes_saved(self, args) -> list:
        return [self.saved[s] for s in (_storage(t) for t in tree_leaves(args[0]) if isinstance(t, torch.Tensor))
                if s in self.saved]

    def policy(self, ctx, op, *args, **kwargs) -> CheckpointPolicy:
        """The same decision in the forward and in its recomputation, where the saved outputs come back from the
        cache in their own storages (a recomputed tensor is a new one)."""
        if op in _WRITES_INPUT:
            return CheckpointPolicy.MUST_SAVE if self._writes_saved(args) else CheckpointPolicy.PREFER_RECOMPUTE
        return self.base(ctx, op, *args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WRITES_INPUT:
            hit = self._writes_saved(args)
            if any(entry[1] for entry in hit):
                raise ValueError(f"selective recompute: {func} writes into a saved matrix product's output that an "
                                 f"operator recomputed in backward read before; that recomputation would read the "
                                 f"collective's result instead; use the full preset for this model (or, on Megatron "
                                 f"with tensor parallelism, --sequence-parallel)")
            for entry in hit:               # read from now on: the collective's result, in backward too
                entry[1] = False
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.base(None, func, *args, **kwargs) == CheckpointPolicy.MUST_SAVE:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.saved[_storage(t)] = [StorageWeakRef(t.untyped_storage()), False]
            return out
        if not self.saved:
            return out
        outputs = {_storage(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        for t in tree_leaves((args, kwargs)):      # a recomputed operator reads what it does not alias (views do not)
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage(t)
            if key in self.saved and key not in outputs:
                self.saved[key][1] = True
        return out
