"""Blocks of the attention mask: a slice of local query rows meeting a slice of key rows under the kernels'
(bottom-right aligned) mask convention, and how they are cut from segments of known global positions.

A *segment* is a run of local rows whose global positions form one arithmetic progression inside one document:
``(rows, first global position, stride, document index)`` (document 0 without packed documents). Within a pair of
segments with one stride, the mask's allowed offsets ``lo ≤ j − i ≤ hi`` are one band of local indices, which
:func:`band_block` states as one trimmed :class:`Block`. With packed documents (:class:`ctx_plugin.mask.Mask`'s
``documents``) :func:`document_blocks` pairs only segments of one document, each first trimmed to the document's
real (non-padding) tokens, so the blocks cover the block-diagonal mask and never a padding row or key; rows no
block covers (padding) keep output 0, lse −inf and get no gradient.
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass

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


def band_block(mask: Mask, q_start: int, k_start: int, stride: int, q_rows: slice, k_rows: slice) -> Block | None:
    """The block of local rows ``q_rows`` (global positions ``q_start + stride·a``) meeting keys ``k_rows``
    (``k_start + stride·b``) under ``mask``'s band (not its documents), trimmed; ``None`` when no pair is allowed."""
    sq, sk = q_rows.stop - q_rows.start, k_rows.stop - k_rows.start
    if sq <= 0 or sk <= 0:
        return None
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


def segments_of(pieces) -> tuple[Segment, ...]:
    """Segments from ``(first, count, stride, document)`` pieces laid out one after another in local order."""
    out, row = [], 0
    for first, count, stride, d in pieces:
        out.append((slice(row, row + count), first, stride, d))
        row += count
    return tuple(out)


def real_rows(segment: Segment, documents: Documents) -> slice:
    """The rows of ``segment`` that hold real tokens of its document (a prefix: positions increase)."""
    rows, first, stride, d = segment
    end = documents.bounds[d] + documents.real(d)          # first padding position of the document
    count = max(0, min(rows.stop - rows.start, -(-(end - first) // stride)))
    return slice(rows.start, rows.start + count)


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


def document_blocks(q_segments, k_segments, mask: Mask) -> tuple[Block, ...]:
    """The blocks of ``q_segments`` meeting ``k_segments`` under ``mask`` with its documents: every pair of segments of
    one document (trimmed to real tokens) through :func:`band_block`, then adjacent full blocks merged."""
    documents = mask.documents
    by_document: dict[int, list[tuple[slice, int, int]]] = {}
    for seg in k_segments:
        by_document.setdefault(seg[3], []).append((real_rows(seg, documents), seg[1], seg[2]))
    per_document: dict[int, list[Block]] = {}
    for seg in q_segments:
        q_rows = real_rows(seg, documents)
        for k_rows, k_first, stride in by_document.get(seg[3], ()):
            blk = band_block(mask, seg[1], k_first, stride, q_rows, k_rows)
            if blk is not None:
                per_document.setdefault(seg[3], []).append(blk)
    # Blocks of two documents never share their rows nor their keys: merged document by document (small lists).
    return tuple(blk for blocks in per_document.values()
                 for blk in (blocks if len(blocks) == 1 else merge_blocks(blocks)))


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
