"""Blocks of the attention mask: a slice of local query rows meeting a slice of key rows under the kernels'
(bottom-right aligned) mask convention, and how they are cut from segments of known global positions.

A *segment* is a run of local rows whose global positions form one arithmetic progression inside one document:
``(rows, first global position, stride, document index)`` (document 0 without packed documents). Within a pair of
segments with one stride, the mask's allowed offsets ``lo ≤ j − i ≤ hi`` are one band of local indices, which
:func:`band_block` states as one trimmed :class:`Block`. With packed documents (:class:`ctx_plugin.core.mask.Mask`'s
``documents``) :func:`document_blocks` pairs only segments of one document, each first trimmed to the document's
real (non-padding) tokens, so the blocks cover the block-diagonal mask and never a padding row or key; rows no
block covers (padding) keep output 0, lse −inf and get no gradient. A step holds a block or more per document —
thousands with short documents — so that is done on arrays (:class:`SegmentTable` in, a :class:`BlockPlan` out: the
blocks with their :class:`BlockTable`, which the varlen planning reads), not block by block in Python.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .documents import Documents
from .mask import Mask

Segment = tuple[slice, int, int, int]
"""``(local rows, first global position, stride, document index)``."""


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


UNBOUNDED = int(np.iinfo(np.int64).min)
"""A window side that is ``None`` (unbounded), in a :class:`BlockTable`."""


class BlockTable:
    """Blocks as int64 arrays, one entry each: rows ``q0 .. q1 − 1`` meet keys ``k0 .. k1 − 1``, ``causal`` (bool), window
    sides ``left``/``right`` (:data:`UNBOUNDED` for ``None``). What the varlen planning reads (thousands of blocks a
    step with packed documents) instead of every block's attributes."""

    __slots__ = ("q0", "q1", "k0", "k1", "causal", "left", "right")

    def __init__(self, q0, q1, k0, k1, causal, left, right) -> None:
        self.q0, self.q1, self.k0, self.k1, self.causal, self.left, self.right = q0, q1, k0, k1, causal, left, right

    @classmethod
    def of(cls, blocks) -> BlockTable:
        """``blocks``' table: a :class:`BlockPlan`'s own, else read from the blocks."""
        if isinstance(blocks, BlockPlan):
            return blocks.table
        rows = [(b.q.start, b.q.stop, b.k.start, b.k.stop, b.causal, *(UNBOUNDED if w is None else w for w in b.window))
                for b in blocks]
        t = np.array(rows, dtype=np.int64).reshape(-1, 7).T
        return cls(t[0], t[1], t[2], t[3], t[4].astype(bool), t[5], t[6])

    def __len__(self) -> int:
        return self.q0.size

    def blocks(self, index=None) -> list[Block]:
        """The blocks (those at ``index``, an int array, if given) as :class:`Block` objects."""
        cols = (self.q0, self.q1, self.k0, self.k1, self.causal, self.left, self.right)
        cols = cols if index is None else tuple(c[index] for c in cols)
        return [Block(slice(a, z), slice(b, y), c, (None if w == UNBOUNDED else w, None if e == UNBOUNDED else e))
                for a, z, b, y, c, w, e in zip(*(c.tolist() for c in cols))]


class BlockPlan(Sequence):
    """A step's blocks held as their :class:`BlockTable` (``table``; built by :func:`document_blocks`): the
    :class:`Block` objects are made when first asked for — with a varlen kernel only the few blocks that run a call
    of their own ever are — then kept. Equal to the tuple of its blocks, and hashed as it."""

    __slots__ = ("table", "_blocks")

    def __init__(self, table: BlockTable, blocks: tuple[Block, ...] | None = None) -> None:
        self.table, self._blocks = table, blocks

    def all(self) -> tuple[Block, ...]:
        if self._blocks is None:
            self._blocks = tuple(self.table.blocks())
        return self._blocks

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if self._blocks is not None or not isinstance(i, int):
            return self.all()[i]
        return self.table.blocks(np.array([i]))[0]

    def __iter__(self):
        return iter(self.all())

    def pick(self, index: list[int]) -> tuple[Block, ...]:
        """The blocks at ``index`` (made from the table unless all are made already)."""
        if self._blocks is not None:
            return tuple(self._blocks[i] for i in index)
        return tuple(self.table.blocks(np.asarray(index, dtype=np.int64)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (BlockPlan, tuple)):
            return self.all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.all())

    def __repr__(self) -> str:
        return f"BlockPlan({self.all()!r})"

    def __reduce__(self):
        return BlockPlan, (self.table, self.all())


def _trim(lo, hi, delta, stride, sq, sk, mx, mn):
    """The band ``blo ≤ b − a ≤ bhi`` of local indices that the mask's allowed offsets ``lo ≤ j − i ≤ hi`` leave
    between ``sq`` rows and ``sk`` keys whose global positions differ by ``delta + stride·(b − a)``, and the rows
    ``a0..a1`` with a key and the keys ``b0..b1`` with a row (inclusive): ``(blo, bhi, a0, a1, b0, b1)``. One formula
    for Python ints (``mx, mn = max, min``) and for arrays of them (``numpy.maximum, numpy.minimum``)."""
    blo = -(sq - 1) if lo is None else mx(-(sq - 1), -((delta - lo) // stride))     # ceil((lo − delta)/stride)
    bhi = sk - 1 if hi is None else mn(sk - 1, (hi - delta) // stride)
    return blo, bhi, mx(0, -bhi), mn(sq - 1, sk - 1 - blo), mx(0, blo), mn(sk - 1, sq - 1 + bhi)


def _sides(blo, bhi, a0, a1, b0, b1):
    """The trimmed block's window in the kernels' bottom-right convention: ``(left, left unbounded, right, right
    unbounded)`` (ints or arrays, as :func:`_trim` gave)."""
    sq, sk, shift = a1 - a0 + 1, b1 - b0 + 1, b0 - a0
    blo, bhi, diag = blo - shift, bhi - shift, b1 - b0 - (a1 - a0)     # band after trimming; diag = sk − sq
    return diag - blo, blo <= -(sq - 1), bhi - diag, bhi >= sk - 1


def band_block(mask: Mask, q_start: int, k_start: int, stride: int, q_rows: slice, k_rows: slice) -> Block | None:
    """The block of local rows ``q_rows`` (global positions ``q_start + stride·a``) meeting keys ``k_rows``
    (``k_start + stride·b``) under ``mask``'s band (not its documents), trimmed; ``None`` when no pair is allowed."""
    sq, sk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
    if sq <= 0 or sk <= 0:
        return None
    lo, hi = mask.band()
    blo, bhi, a0, a1, b0, b1 = _trim(lo, hi, k_start - q_start, stride, sq, sk, max, min)
    if blo > bhi or a0 > a1 or b0 > b1:
        return None
    left, no_left, right, no_right = _sides(blo, bhi, a0, a1, b0, b1)
    causal = not no_right and right == 0
    return Block(slice(q_rows.start + a0, q_rows.start + a1 + 1), slice(k_rows.start + b0, k_rows.start + b1 + 1),
                 causal, (None if no_left else left, None if causal or no_right else right))


def segments_of(first, count, stride, doc) -> tuple[Segment, ...]:
    """Segments of runs ``first[i] + stride[i]·t`` (``t < count[i]``) in document ``doc[i]`` (arrays or sequences of
    ints) laid out one after another in local order."""
    out, row = [], 0
    for f, n, step, d in zip(*(np.asarray(x).tolist() for x in (first, count, stride, doc))):
        out.append((slice(row, row + n), f, step, d))
        row += n
    return tuple(out)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off for a block or function (back on after, if it was on): planning a batch of
    packed documents allocates tens of thousands of small acyclic objects, all kept, and the collections they set
    off (walking every object of the training process) made the same plan take 1-4x as long from rank to rank,
    as Megatron's ``--manual-gc`` notes for training steps."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class SegmentTable:
    """A rank's segments as int64 arrays, one entry each, their rows trimmed to the real tokens of their document (a
    prefix: positions increase): rows ``start .. stop − 1``, global positions ``first + stride·(row − start)``,
    document ``doc``. Built from a layout's pieces (:func:`segments_of`'s runs, as arrays) once per rank and batch of
    documents (the layouts cache it), read by :func:`document_blocks` for every step."""

    __slots__ = ("start", "stop", "first", "stride", "doc")

    def __init__(self, first: np.ndarray, count: np.ndarray, stride: np.ndarray, doc: np.ndarray,
                 documents: Documents) -> None:
        self.first, self.stride, self.doc = first, stride, doc
        self.start = np.cumsum(count) - count
        bounds = np.asarray(documents.bounds, dtype=np.int64)
        real = np.diff(bounds) if documents.valid is None else np.asarray(documents.valid, dtype=np.int64)
        end = bounds[doc] + real[doc]                       # first padding position of each one's document
        self.stop = self.start + np.clip(np.minimum(count, -((first - end) // stride)), 0, None)


def _same_document_pairs(q: SegmentTable, k: SegmentTable) -> tuple[np.ndarray, np.ndarray]:
    """Indices ``(i, j)`` of every query segment ``i`` and key segment ``j`` of one document: by ``i``, then ``j``."""
    order = np.argsort(k.doc, kind="stable")
    lo = np.searchsorted(k.doc[order], q.doc, "left")
    n = np.searchsorted(k.doc[order], q.doc, "right") - lo
    i = np.repeat(np.arange(q.doc.size), n)
    return i, order[np.repeat(lo - (np.cumsum(n) - n), n) + np.arange(i.size)]


def document_blocks(q: SegmentTable, k: SegmentTable, mask: Mask) -> BlockPlan | tuple[()]:
    """The blocks of query segments ``q`` meeting key segments ``k`` under ``mask`` with its documents: every pair of
    segments of one document as :func:`band_block` trims it (all pairs at once, as arrays: thousands of documents
    per step), grouped by document (in the order their first block comes), each document's full blocks merged: into
    one where they tile a rectangle, else as :func:`merge_blocks` joins them."""
    i, j = _same_document_pairs(q, k)
    qa, ka = q.start[i], k.start[j]
    sq, sk = q.stop[i] - qa, k.stop[j] - ka
    lo, hi = mask.band()
    blo, bhi, a0, a1, b0, b1 = _trim(lo, hi, k.first[j] - q.first[i], k.stride[j], sq, sk, np.maximum, np.minimum)
    keep = (sq > 0) & (sk > 0) & (blo <= bhi) & (a0 <= a1) & (b0 <= b1)
    if not keep.any():
        return ()
    doc, qa, ka, blo, bhi, a0, a1, b0, b1 = (x[keep] for x in (q.doc[i], qa, ka, blo, bhi, a0, a1, b0, b1))
    left, no_left, right, no_right = _sides(blo, bhi, a0, a1, b0, b1)
    causal = ~no_right & (right == 0)
    # Blocks of two documents never share their rows nor their keys: each document's merged on its own. Its blocks
    # made contiguous, documents in the order of their first block (a stable sort; already so when q is in order).
    _, first, inverse = np.unique(doc, return_index=True, return_inverse=True)
    order = np.argsort(first[inverse], kind="stable")
    q0, q1, k0, k1 = (x[order] for x in (qa + a0, qa + a1 + 1, ka + b0, ka + b1 + 1))
    causal, no_left, no_right, left, right = (x[order] for x in (causal, no_left, no_right, left, right))
    group = first[inverse][order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    sizes = np.diff(np.r_[starts, group.size])
    full = ~causal & no_left & no_right
    fulls = np.add.reduceat(full, starts)
    # A document's blocks, all full, that tile the rectangle around them (two sharing keys with adjacent rows, or rows
    # with adjacent keys; zigzag without a causal mask: its two chunks of rows × its two of keys): one block.
    area = np.add.reduceat((q1 - q0) * (k1 - k0), starts)
    box = [f.reduceat(x, starts) for f, x in ((np.minimum, q0), (np.maximum, q1), (np.minimum, k0), (np.maximum, k1))]
    tiled = (sizes >= 2) & (fulls == sizes) & (area == (box[1] - box[0]) * (box[3] - box[2]))
    for x, edge in zip((q0, q1, k0, k1), box):
        x[starts[tiled]] = edge[tiled]
    member = np.repeat(np.arange(starts.size), sizes)             # each block's group
    alive = ~(tiled[member] & (np.arange(group.size) > starts[member]))
    left, right = np.where(no_left, UNBOUNDED, left), np.where(no_right | causal, UNBOUNDED, right)
    table = BlockTable(*(x[alive] for x in (q0, q1, k0, k1, causal, left, right)))
    # Other documents with two full blocks or more (besides blocks that are not): the scan of merge_blocks.
    slow = (fulls >= 2) & ~tiled
    if not slow.any():
        return BlockPlan(table)
    blocks = table.blocks()
    at = np.cumsum(alive) - alive                                  # each block's index among the kept ones
    for start, size in sorted(zip(at[starts[slow]].tolist(), sizes[slow].tolist()), reverse=True):
        blocks[start:start + size] = merge_blocks(blocks[start:start + size])
    return BlockPlan(BlockTable.of(blocks), tuple(blocks))


def _full(blk: Block) -> bool:
    return not blk.causal and blk.window == (None, None)


def _joined(a: Block, b: Block) -> Block | None:
    """``a`` and ``b`` as one block when both are full and share their keys with adjacent rows, or their rows with
    adjacent keys; else ``None``."""
    if not (_full(a) and _full(b)):
        return None
    if a.k == b.k and (a.q.stop == b.q.start or b.q.stop == a.q.start):
        return Block(slice(min(a.q.start, b.q.start), max(a.q.stop, b.q.stop)), a.k, False)
    if a.q == b.q and (a.k.stop == b.k.start or b.k.stop == a.k.start):
        return Block(a.q, slice(min(a.k.start, b.k.start), max(a.k.stop, b.k.stop)), False)
    return None


def merge_blocks(blocks) -> tuple[Block, ...]:
    """Full blocks joined while any two share their keys and have adjacent rows, or share their rows and have
    adjacent keys (fewer kernel calls; the pairs covered are the same). A scan of the blocks kept so far: quadratic,
    so it is run per document (:func:`document_blocks`), where a rank has at most two segments of queries and two
    of keys, hence at most four blocks."""
    out: list[Block] = []
    for blk in blocks:
        i = 0
        while i < len(out):
            joined = _joined(out[i], blk)
            if joined is None:
                i += 1
            else:                       # the joined block may now join one seen earlier
                del out[i]
                blk, i = joined, 0
        out.append(blk)
    return tuple(out)


def block_pairs(blk: Block) -> int:
    """How many (query row, key) pairs ``blk`` computes (its work)."""
    sq, sk = blk.q.stop - blk.q.start, blk.k.stop - blk.k.start
    left, right = blk.window
    diag = sk - sq
    total = 0
    for a in range(sq):
        lo = 0 if left is None else max(0, a + diag - left)
        hi = a + diag if blk.causal else (sk - 1 if right is None else a + diag + right)
        total += max(0, min(sk - 1, hi) - lo + 1)
    return total
