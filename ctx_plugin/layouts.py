"""Token layouts: which global tokens a rank holds, and the per-step plan of the ring.

A layout is a permutation of the global sequence into P equal shards. ``local_indices`` is its one source
of truth: sharding, un-sharding and position ids are all derived from it. Ring layouts (contiguous, zigzag,
striped) add the per-step plan; the Ulysses×ring hybrid has a sharding layout of its own (zigzag over the
ring, contiguous within each Ulysses group) and runs its ring with the zigzag plan.

The ring plan says, for rank ``r`` holding the K/V shard of rank ``s`` (``s = (r − step) mod P``), which
slice of local Q meets which slice of that K/V and whether the block is causal. Blocks are either full
or *square* causal (query i sees keys 0..i of the block), so every kernel convention agrees::

    contiguous (P=4, r=2)      zigzag (P=2, r=0: chunks 0 and 3)      striped (r=0, s=1: q[1:] × k[:-1])
    s<r: ■ full                s=r: ◣ causal over both chunks           s≤r: ◣ causal (diagonal included)
    s=r: ◣ causal              s<r: all Q × first K chunk  (■)          s>r: ◣ strictly causal, shifted
    s>r: · skipped             s>r: second Q chunk × all K (■)

Together, over all steps, the blocks cover the global causal (or full) mask exactly once; the unit tests
check that for every layout and P.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .config import CPConfig
from .names import Backend


@dataclass(frozen=True)
class Block:
    """Local query rows ``q`` meet visiting key rows ``k``; ``causal`` means a square top-left causal mask."""

    q: slice
    k: slice
    causal: bool


def _full(n: int) -> tuple[Block, ...]:
    return (Block(slice(0, n), slice(0, n), False),)


def _causal(n: int) -> tuple[Block, ...]:
    return (Block(slice(0, n), slice(0, n), True),)


class Layout(ABC):
    """How the global sequence is split over P ranks. Subclasses define ``name``, ``unit`` and
    ``local_indices``."""

    name: str = ""
    multiple: int = 1

    def unit(self, size: int) -> int:
        """The global sequence length must be a positive multiple of this (checked by
        :func:`ctx_plugin.rules.check_seq_len`)."""
        return self.multiple * size

    @abstractmethod
    def local_indices(self, seq_len: int, rank: int, size: int) -> torch.Tensor:
        """Global positions (int64) of the tokens rank ``rank`` holds, in local order (increasing)."""

    def permutation(self, seq_len: int, size: int) -> torch.Tensor:
        """Concatenation of every rank's ``local_indices`` (rank 0 first): the sharded order of the sequence."""
        return torch.cat([self.local_indices(seq_len, r, size) for r in range(size)])


class RingLayout(Layout):
    """A layout the ring can run on: adds the per-step plan (``causal_plan``)."""

    @abstractmethod
    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        """Blocks for rank ``rank`` meeting the K/V shard of rank ``source`` under a causal mask."""

    def plan(self, rank: int, source: int, size: int, local_len: int, causal: bool) -> tuple[Block, ...]:
        """The blocks to compute at one ring step (pure function of its arguments)."""
        if not causal:
            return _full(local_len)
        return self.causal_plan(rank, source, size, local_len)


class Contiguous(RingLayout):
    name = "contiguous"

    def local_indices(self, seq_len: int, rank: int, size: int) -> torch.Tensor:
        n = seq_len // size
        return torch.arange(rank * n, (rank + 1) * n)

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        if source == rank:
            return _causal(local_len)
        return _full(local_len) if source < rank else ()


class Zigzag(RingLayout):
    name = "zigzag"
    multiple = 2

    def local_indices(self, seq_len: int, rank: int, size: int) -> torch.Tensor:
        c = seq_len // (2 * size)
        late = 2 * size - 1 - rank
        return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        half = local_len // 2
        if source == rank:
            return _causal(local_len)
        if source < rank:   # the visitor's early chunk precedes both of ours; its late chunk follows both
            return (Block(slice(0, local_len), slice(0, half), False),)
        # source > rank: only our late chunk comes after the visitor's chunks, and after both of them
        return (Block(slice(half, local_len), slice(0, local_len), False),)


class Striped(RingLayout):
    name = "striped"

    def local_indices(self, seq_len: int, rank: int, size: int) -> torch.Tensor:
        return torch.arange(rank, seq_len, size)

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        if source <= rank:   # local query j (global j·P+r) sees visiting key m (global m·P+s) iff m ≤ j
            return _causal(local_len)
        if local_len == 1:   # s > r: strictly m < j, i.e. q[1:] × k[:-1] causal; nothing when one token
            return ()
        return (Block(slice(1, local_len), slice(0, local_len - 1), True),)


class UlyssesRing(Layout):
    """The hybrid's sharding: the ring (P/u groups) splits the sequence zigzag-wise; each Ulysses group of u
    consecutive ranks splits its ring shard contiguously, so the all-to-all re-assembles the ring shard."""

    name = "ulysses_ring"

    def __init__(self, ulysses_size: int) -> None:
        self.ulysses_size = ulysses_size

    def unit(self, size: int) -> int:
        return size // self.ulysses_size * math.lcm(2, self.ulysses_size)

    def local_indices(self, seq_len: int, rank: int, size: int) -> torch.Tensor:
        outer, inner = divmod(rank, self.ulysses_size)
        ring_shard = Zigzag().local_indices(seq_len, outer, size // self.ulysses_size)
        n = seq_len // size
        return ring_shard[inner * n:(inner + 1) * n]


RING_LAYOUTS: tuple[RingLayout, ...] = (Contiguous(), Zigzag(), Striped())

_SHARDING: dict[Backend, type[RingLayout]] = {
    Backend.RING: Contiguous,
    Backend.ZIGZAG: Zigzag,
    Backend.STRIPED: Striped,
    Backend.ULYSSES: Contiguous,     # the all-to-all concatenates rank shards: contiguous is the original order
    Backend.ALLGATHER: Zigzag,       # balances the causal rows each rank computes
}


def shard_layout(config: CPConfig) -> Layout:
    """How ``config``'s backend expects the tokens of a sequence to be spread over the ranks."""
    if config.backend == Backend.ULYSSES_RING:
        return UlyssesRing(config.ulysses_size)
    return _SHARDING[config.backend]()


def ring_layout(config: CPConfig) -> RingLayout:
    """The layout whose plan the ring runs (over the ring group; trivial when that group has one rank)."""
    layout = shard_layout(config)
    return layout if isinstance(layout, RingLayout) else Zigzag()
