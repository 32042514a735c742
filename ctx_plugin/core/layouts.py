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

Sliding windows (:class:`~ctx_plugin.core.mask.Mask`): within a block, query and key global positions are arithmetic
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
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

import numpy as np
import torch

from ..names import Backend
from .blocks import Block, Segment, SegmentTable, band_block, block_pairs, document_blocks, gc_paused, segments_of
from .config import CPConfig
from .documents import Documents
from .mask import Mask


def _full(n: int) -> tuple[Block, ...]:
    return (Block(slice(0, n), slice(0, n), False),)


def _causal(n: int) -> tuple[Block, ...]:
    return (Block(slice(0, n), slice(0, n), True),)


Pieces = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""A rank's tokens as runs, in local order: int64 arrays ``(first, count, stride, document)``, run ``i`` holding global
positions ``first[i] + stride[i]·t`` for ``t < count[i]``, all in document ``document[i]``."""


def _pieces(first, count, stride, doc) -> Pieces:
    return tuple(np.ascontiguousarray(np.broadcast_to(np.asarray(x, dtype=np.int64), np.shape(first)))
                 for x in (first, count, stride, doc))


def _indices(pieces: Pieces) -> torch.Tensor:
    first, count, stride, _ = pieces
    starts = np.cumsum(count) - count                       # each run's first local row
    rows = np.arange(int(count.sum()), dtype=np.int64)
    return torch.from_numpy(np.repeat(first - stride * starts, count) + np.repeat(stride, count) * rows)


class Layout(ABC):
    """How the global sequence is split over P ranks. Subclasses define ``name``, ``unit`` and
    ``local_indices``. Every method that depends on the sequence takes its packed ``documents`` (``None``: one
    document): layouts that split each document (zigzag, striped) then apply their rule per document."""

    name: str = ""
    multiple: int = 1

    def unit(self, size: int) -> int:
        """The global sequence length must be a positive multiple of this (checked by
        :func:`ctx_plugin.core.rules.check_seq_len`)."""
        return self.multiple * size

    def document_unit(self, size: int) -> int:
        """With packed documents, every document's length must be a multiple of this (1: documents may be cut
        anywhere; checked by :func:`ctx_plugin.core.rules.check_documents_fit`)."""
        return 1

    @abstractmethod
    def local_indices(self, seq_len: int, rank: int, size: int, documents: Documents | None = None) -> torch.Tensor:
        """Global positions (int64) of the tokens rank ``rank`` holds, in local order (increasing)."""

    def permutation(self, seq_len: int, size: int, documents: Documents | None = None) -> torch.Tensor:
        """Concatenation of every rank's ``local_indices`` (rank 0 first): the sharded order of the sequence."""
        return torch.cat([self.local_indices(seq_len, r, size, documents) for r in range(size)])


class RingLayout(Layout):
    """A layout the ring can run on: adds the per-step plan (``causal_plan`` without a window or documents, the
    bands of ``segments`` with them)."""

    @abstractmethod
    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        """Blocks for rank ``rank`` meeting the K/V shard of rank ``source`` under a causal mask."""

    @abstractmethod
    def pieces(self, rank: int, size: int, local_len: int, documents: Documents) -> Pieces:
        """This rank's tokens under ``documents`` as runs in local order (:data:`Pieces`; arrays, one entry per
        document or two: thousands with short documents)."""

    def segments(self, rank: int, size: int, local_len: int,
                 documents: Documents | None = None) -> tuple[Segment, ...]:
        """This rank's local rows as arithmetic progressions inside one document each:
        ``(rows, first global position, stride, document index)``."""
        if documents is None:
            documents = Documents((0, local_len * size))
        return _segments(type(self), rank, size, local_len, documents)

    def segment_table(self, rank: int, size: int, local_len: int, documents: Documents) -> SegmentTable:
        """This rank's :meth:`segments` under ``documents`` as arrays, rows trimmed to real tokens (cached)."""
        return _segment_table(type(self), rank, size, local_len, documents)

    def local_indices(self, seq_len: int, rank: int, size: int, documents: Documents | None = None) -> torch.Tensor:
        return _indices(self.pieces(rank, size, seq_len // size, documents or Documents((0, seq_len))))

    def plan(self, rank: int, source: int, size: int, local_len: int, mask: Mask) -> tuple[Block, ...]:
        """The blocks to compute at one ring step (pure function of its arguments)."""
        if mask.documents is not None:
            return _document_plan(type(self), rank, source, size, local_len, mask)
        if not mask.windowed:
            return self.causal_plan(rank, source, size, local_len) if mask.causal else _full(local_len)
        blocks = (band_block(mask, q0, k0, stride, q_rows, k_rows)
                  for q_rows, q0, stride, _ in self.segments(rank, size, local_len)
                  for k_rows, k0, _, _ in self.segments(source, size, local_len))
        return tuple(b for b in blocks if b is not None)


@functools.lru_cache(maxsize=256)
def _segments(kind: type[RingLayout], rank: int, size: int, local_len: int, documents: Documents) -> tuple:
    """A rank's segments (cached: a step's plans read the same ranks' segments ``size`` times each)."""
    return segments_of(*kind().pieces(rank, size, local_len, documents))


@functools.lru_cache(maxsize=256)
def _segment_table(kind: type[RingLayout], rank: int, size: int, local_len: int, documents: Documents) -> SegmentTable:
    return SegmentTable(*kind().pieces(rank, size, local_len, documents), documents)


@functools.lru_cache(maxsize=1024)
@gc_paused()
def _document_plan(kind: type[RingLayout], rank: int, source: int, size: int, local_len: int,
                   mask: Mask) -> tuple[Block, ...]:
    layout = kind()
    return document_blocks(layout.segment_table(rank, size, local_len, mask.documents),
                           layout.segment_table(source, size, local_len, mask.documents), mask)


class Contiguous(RingLayout):
    """Rank r holds tokens r·n .. (r+1)·n − 1; with documents, its shard is cut at their boundaries."""

    name = "contiguous"

    def local_indices(self, seq_len: int, rank: int, size: int, documents: Documents | None = None) -> torch.Tensor:
        n = seq_len // size
        return torch.arange(rank * n, (rank + 1) * n)

    def pieces(self, rank, size, local_len, documents):
        lo, hi, bounds = rank * local_len, (rank + 1) * local_len, documents.bounds
        docs = np.arange(bisect_right(bounds, lo) - 1, bisect_left(bounds, hi), dtype=np.int64)  # those meeting [lo, hi)
        ends = np.asarray(bounds, dtype=np.int64)
        first = np.maximum(lo, ends[docs])
        return _pieces(first, np.minimum(hi, ends[docs + 1]) - first, 1, docs)

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        if source == rank:
            return _causal(local_len)
        return _full(local_len) if source < rank else ()


class Zigzag(RingLayout):
    """Each document (the whole sequence without documents) is split into 2P chunks; rank r holds chunks r and
    2P − 1 − r of every document (TransformerEngine's THD rule), in document order."""

    name = "zigzag"
    multiple = 2

    def document_unit(self, size: int) -> int:
        return 2 * size

    def pieces(self, rank, size, local_len, documents):
        bounds = np.asarray(documents.bounds, dtype=np.int64)
        c = np.diff(bounds) // (2 * size)
        first = bounds[:-1, None] + np.array([rank, 2 * size - 1 - rank]) * c[:, None]   # per document, both chunks
        return _pieces(first.ravel(), np.repeat(c, 2), 1, np.repeat(np.arange(documents.count), 2))

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        half = local_len // 2
        if source == rank:
            return _causal(local_len)
        if source < rank:   # the visitor's early chunk precedes both of ours; its late chunk follows both
            return (Block(slice(0, local_len), slice(0, half), False),)
        # source > rank: only our late chunk comes after the visitor's chunks, and after both of them
        return (Block(slice(half, local_len), slice(0, local_len), False),)


class Striped(RingLayout):
    """Token t of each document (of the sequence without documents) goes to rank t mod P."""

    name = "striped"

    def document_unit(self, size: int) -> int:
        return size

    def pieces(self, rank, size, local_len, documents):
        bounds = np.asarray(documents.bounds, dtype=np.int64)
        return _pieces(bounds[:-1] + rank, np.diff(bounds) // size, size, np.arange(documents.count))

    def causal_plan(self, rank: int, source: int, size: int, local_len: int) -> tuple[Block, ...]:
        if source <= rank:   # local query j (global j·P+r) sees visiting key m (global m·P+s) iff m ≤ j
            return _causal(local_len)
        if local_len == 1:   # s > r: strictly m < j, i.e. q[1:] × k[:-1] causal; nothing when one token
            return ()
        return (Block(slice(1, local_len), slice(0, local_len - 1), True),)


def rank_work(layout: RingLayout, size: int, local_len: int, mask: Mask) -> list[int]:
    """Per rank, the (query, key) pairs its blocks compute over all ring steps: the balance of the layout."""
    return [sum(block_pairs(blk) for o in range(size) for blk in layout.plan(r, (r - o) % size, size, local_len, mask))
            for r in range(size)]


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


def ring_schedule(layout: RingLayout, size: int, local_len: int, mask: Mask, rank: int = 0) -> RingSchedule:
    """The shortest arc of ring offsets that covers every offset at which some rank has a block (the same on
    every rank; a rank with nothing at a step just passes the K/V on). ``rank``: whose plans are looked at first —
    the caller's own, which it computes anyway (the result does not depend on it)."""
    return _schedule(type(layout), size, local_len, mask, rank)


@functools.lru_cache(maxsize=256)
def _schedule(kind: type[RingLayout], size: int, local_len: int, mask: Mask, rank: int) -> RingSchedule:
    layout = kind()
    order = [(rank + i) % size for i in range(size)]
    needed = [o for o in range(size)
              if any(layout.plan(r, (r - o) % size, size, local_len, mask) for r in order)]
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

    def document_unit(self, size: int) -> int:
        return 2 * (size // self.ulysses_size)

    def local_indices(self, seq_len: int, rank: int, size: int, documents: Documents | None = None) -> torch.Tensor:
        outer, inner = divmod(rank, self.ulysses_size)
        ring_shard = Zigzag().local_indices(seq_len, outer, size // self.ulysses_size, documents)
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
