"""Runs one backend: the all-gather algorithm, or the Ulysses all-to-all around the ring.

The ring family, Ulysses and the hybrid are one composition: all-to-all over the Ulysses axis (skipped when
it has one rank), ring attention over the ring axis (a single local kernel call when it has one rank), and
the inverse all-to-all. ``ring``/``zigzag``/``striped`` use only the ring axis, ``ulysses`` only the
all-to-all, ``ulysses_ring`` both.
"""
from __future__ import annotations

import torch

from ..names import Backend
from .allgather import AllGatherAttention
from .comm import active_observers
from .config import CPConfig
from .groups import CPGroups
from .kernels import AttentionKernel
from .layouts import ring_layout
from .mask import Mask
from .ring import RingAttention
from .ulysses import AllToAll, kv_replicas


def run_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, config: CPConfig, groups: CPGroups,
                kernel: AttentionKernel, mask: Mask, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Each autograd function gets the communication observers active now (its forward's), for its backward.
    ``sinks`` holds every query head's logit; after the all-to-all a rank keeps its own heads' (autograd gathers
    their gradient back)."""
    counter = active_observers()
    if config.backend == Backend.ALLGATHER:
        return AllGatherAttention.apply(q, k, v, sinks, kernel, groups.ring, counter, mask, scale, groups.check_group)
    ulysses = groups.ulysses
    if ulysses.size > 1:
        copies = kv_replicas(k.shape[2], ulysses.size)
        if copies > 1:   # more Ulysses ranks than K/V heads: replicate; autograd sums the copies' gradients
            k, v = (t.unsqueeze(3).expand(*t.shape[:3], copies, t.shape[3]).flatten(2, 3) for t in (k, v))
        if sinks is not None:   # seq_to_heads gives Ulysses rank u the query heads [u·H/U, (u+1)·H/U)
            per_rank = q.shape[2] // ulysses.size
            sinks = sinks[ulysses.rank * per_rank:(ulysses.rank + 1) * per_rank]
        q, k, v = (AllToAll.apply(t, ulysses, counter, True) for t in (q, k, v))
    out = RingAttention.apply(q, k, v, sinks, kernel, ring_layout(config), groups.ring, counter, mask, scale,
                              groups.check_group)
    if ulysses.size == 1:
        return out
    # contiguous: with one head per Ulysses rank the all-to-all's result is a strided view of its receive buffer, and
    # the layer's reshape before its output projection would copy it (once more whenever a region recomputes the
    # layer, the pinned output then being a second copy); with several it is a copy already
    return AllToAll.apply(out, ulysses, counter, False).contiguous()
