"""Selective checkpointing's two contexts (torch's ``create_selective_checkpoint_contexts``), with a recomputation
that runs an operator the forward ran fewer times, as long as the forward saved none of that operator's results and
autograd records nothing of it (grad mode off).

DeepSpeed ZeRO-3 gathers a module's parameters in its pre-forward hook (under ``no_grad``), inside the layer, and only
when they are not gathered already: under its live-parameter, reuse-distance and prefetch limits the recomputation
in backward can gather more often than the forward did. torch 2.13's cached mode looks every operator up by its
invocation index in the forward and refuses one it has no entry for (``aten.cat.out invocation index 2 encountered
during backward but not found in storage``), although that operator was never saved: every forward invocation was
to be recomputed. Such an invocation is run here. Not with grad mode on: an operator autograd records saves tensors
for backward, and the checkpoint matches the recomputed saved tensors to the forward's by their order, so an extra
one would shift every later one (torch's refusal stands); nor for an operator with a saved result (its indices must
line up).
"""
from __future__ import annotations

import torch
from torch.utils import checkpoint as _checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

_Cached = getattr(_checkpoint, "_CachedTorchDispatchMode", None)
_RECOMPUTE = getattr(_checkpoint, "_RECOMPUTE", None)
_IGNORED = getattr(_checkpoint, "SAC_IGNORED_OPS", frozenset())
_key = getattr(_checkpoint, "_sac_storage_key", lambda func, args: func)


if _Cached is not None and _RECOMPUTE is not None:
    class _RecomputedOnly(_Cached):
        """torch's cached mode, running invocations of never-saved operators the forward did not record, outside
        autograd."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func not in _IGNORED and not torch.is_grad_enabled():
                key = _key(func, args)
                recorded = self.storage.get(key)
                if (recorded is None or self.func_counter[key] not in recorded) \
                        and all(entry is _RECOMPUTE for entry in (recorded or {}).values()):
                    self.func_counter[key] += 1
                    return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)
else:       # another torch's internals: its own contexts
    _RecomputedOnly = None


def selective_contexts(policy):
    """(forward context, recomputation context) of selective checkpointing under ``policy``."""
    caching, cached = create_selective_checkpoint_contexts(policy)
    if _RecomputedOnly is None or not hasattr(cached, "storage") or not hasattr(cached, "func_counter"):
        return caching, cached
    return caching, _RecomputedOnly(None, cached.storage, getattr(cached, "allow_cache_entry_mutation", False))
