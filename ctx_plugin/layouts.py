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

Sliding windows (:class:`~ctx_plugin.mask.Mask`): within a block, query and key global positions are arithmetic
progressions with one stride (contiguous and zigzag chunks: 1, striped: P), so the window's allowed offsets
``lo ≤ j − i ≤ hi`` become one band ``blo ≤ b − a ≤ bhi`` of local indices. :func:`band_block` trims each block to
the rows that have a key and the keys that have a query (dropping empty blocks) and states it in the kernels'
bottom-right convention (``Block.window``). Zigzag's shard is two chunks, so its windowed plan has up to four
blocks (one per chunk pair). :func:`ring_schedule` keeps only the ring steps some rank needs: the shortest arc
of offsets ``(r − s) mod P`` covering them (contiguous, causal window of w tokens over shards of n:
offsets 0..⌈w/n⌉).
"""
from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .config import CPConfig
from .mask import Mask
from .names import Backend


@dataclass(frozen=True)
class Block:
    """Local query rows ``q`` meet visiting key rows ``k`` under the kernels' mask convention (bottom-right
    aligned, as flash-attn): with ``sq``/``sk`` rows and keys, row ``a`` sees key ``b`` iff
    ``a + sk − sq − left ≤ b ≤ a + sk − sq + right`` (``None`` sides unbounded), and ``b ≤ a + sk − sq`` if
    ``causal``. Every row sees at least one key and every key is seen (blocks are trimmed)."""

    q: slice
    k: slice
    causal: bool
    window: tuple[int | None, int | None] = (None, None)


def band_block(mask: Mask, q_start: int, k_start: int, stride: int, q_rows: slice, k_rows: slice) -> Block | None:
    """The block of local rows ``q_rows`` (global positions ``q_start + stride·a``) meeting keys ``k_rows``
    (``k_start + stride·b``) under ``mask``, trimmed; ``None`` when no pair is allowed."""
    sq, sk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
    lo, hi = mask.band()
    delta = k_start - q_start                         # allowed: lo ≤ delta + stride·(b − a) ≤ hi
    blo = -(sq - 1) if lo is None else max(-(sq - 1), -((delta - lo) // stride))     # ceil((lo − delta)/stride)
    bhi = sk - 1 if hi is None else min(sk - 1, (hi - delta) // stride)
    a0, a1 = max(0, -bhi), min(sq - 1, sk - 1 - blo)  # rows with a key, keys with a row (inclusive)
    b0, b1 = max(0, blo), min(sk - 1, sq - 1 + bhi)
    if blo > bhi or a0 > a1 or b0 > b1:
        return None
    sq, sk, shift = a1 - a0 + 1, b1 - b0 + 1, b0 - a0
    blo, bhi, diag = blo - shift, bhi - shift, b1 - b0 - (a1 - a0)     # band after trimming; diag = sk − sq
    left = None if blo <= -(sq - 1) else diag - blo
    right = None if bhi >= sk - 1 else bhi - diag
    causal = right == 0
    return Block(slice(q_rows.start + a0, q_rows.start + a1 + 1), slice(k_rows.start + b0, k_rows.start + b1 + 1),
                 causal, (left, None if causal else right))


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
    """A layout the ring can run on: adds the per-step plan (``causal_plan`` without a window, the bands of
    ``segments`` with one)."""

    @abstractmethod
    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        """Blocks for rank ``rank`` meeting the K/V shard of rank ``source`` under a causal mask."""

    @abstractmethod
    def segments(self, rank: int, size: int, local_len: int) -> tuple[tuple[slice, int, int], ...]:
        """This rank's local rows as arithmetic progressions: ``(rows, first global position, stride)``."""

    def plan(self, rank: int, source: int, size: int, local_len: int, mask: Mask) -> tuple[Block, ...]:
        """The blocks to compute at one ring step (pure function of its arguments)."""
        if not mask.windowed:
            return self.causal_plan(rank, source, size, local_len) if mask.causal else _full(local_len)
        blocks = (band_block(mask, q0, k0, stride, q_rows, k_rows)
                  for q_rows, q0, stride in self.segments(rank, size, local_len)
                  for k_rows, k0, _ in self.segments(source, size, local_len))
        return tuple(b for b in blocks if b is not None)


class Contiguous(RingLayout):
    name = "contiguous"

    def local_indices(self, seq_len: int, rank: int, size: int) -> torch.Tensor:
        n = seq_len // size
        return torch.arange(rank * n, (rank + 1) * n)

    def segments(self, rank: int, size: int, local_len: int) -> tuple[tuple[slice, int, int], ...]:
        return ((slice(0, local_len), rank * local_len, 1),)

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

    def segments(self, rank: int, size: int, local_len: int) -> tuple[tuple[slice, int, int], ...]:
        c = local_len // 2
        return ((slice(0, c), rank * c, 1), (slice(c, local_len), (2 * size - 1 - rank) * c, 1))

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

    def segments(self, rank: int, size: int, local_len: int) -> tuple[tuple[slice, int, int], ...]:
        return ((slice(0, local_len), rank, size),)

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        if source <= rank:   # local query j (global j·P+r) sees visiting key m (global m·P+s) iff m ≤ j
            return _causal(local_len)
        if local_len == 1:   # s > r: strictly m < j, i.e. q[1:] × k[:-1] causal; nothing when one token
            return ()
        return (Block(slice(1, local_len), slice(0, local_len - 1), True),)


@dataclass(frozen=True)
class RingSchedule:
    """The ring steps that run: offsets ``start, start + 1, …`` (mod ``size``), ``steps`` of them. At offset ``o``
    rank ``r`` holds the K/V shard of rank ``(r − o) mod size``."""

    size: int
    start: int
    steps: int

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple((self.start + t) % self.size for t in range(self.steps))

    @property
    def last(self) -> int:
        """The offset of the last step (where the accumulated dK/dV are, before they go home)."""
        return (self.start + self.steps - 1) % self.size

    @property
    def kv_transfers(self) -> int:
        """K/V exchanges per pass: a direct fetch of the first shard (when not one's own), then one per step."""
        return (self.start != 0) + self.steps - 1


def ring_schedule(layout: RingLayout, size: int, local_len: int, mask: Mask) -> RingSchedule:
    """The shortest arc of ring offsets that covers every offset at which some rank has a block (the same on
    every rank; a rank with nothing at a step just passes the K/V on)."""
    return _schedule(type(layout), size, local_len, mask)


@functools.lru_cache(maxsize=256)
def _schedule(kind: type[RingLayout], size: int, local_len: int, mask: Mask) -> RingSchedule:
    layout = kind()
    needed = [o for o in range(size)
              if any(layout.plan(r, (r - o) % size, size, local_len, mask) for r in range(size))]
    # Each needed offset may start the arc; it then ends at the needed offset just before it (cyclically).
    arcs = [((needed[i - 1] - start) % size + 1, start != 0, start) for i, start in enumerate(needed)]
    steps, _, start = min(arcs)
    return RingSchedule(size, start, steps)


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
