"""The array construction of a step's blocks with packed documents (all documents at once: thousands a step) against
the plain one, written here block by block: for each document, every pair of its query and key segments, each
trimmed to the document's real tokens, through band_block, then merge_blocks. Also: a plan's table is its blocks,
and the all-gather backend's query chunks are built the same way."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ctx_plugin.core import allgather, layouts
from ctx_plugin.core.blocks import BlockPlan, BlockTable, band_block, merge_blocks
from ctx_plugin.core.documents import Documents, pad_documents
from ctx_plugin.core.layouts import RING_LAYOUTS, Contiguous, Zigzag
from ctx_plugin.core.mask import Mask

from .test_document_layouts import WINDOWS, mixes


def _real(segment, docs: Documents) -> slice:
    rows, first, stride, d = segment
    end = docs.bounds[d] + docs.real(d)
    count = sum(1 for t in range(rows.stop - rows.start) if first + t * stride < end)
    return slice(rows.start, rows.start + count)


def scan(q_segments, k_segments, mask: Mask) -> tuple:
    docs, per_document = mask.documents, {}
    for q in q_segments:
        for k in k_segments:
            if k[3] == q[3]:
                blk = band_block(mask, q[1], k[1], k[2], _real(q, docs), _real(k, docs))
                if blk is not None:
                    per_document.setdefault(q[3], []).append(blk)
    return tuple(itertools.chain.from_iterable(merge_blocks(b) for b in per_document.values()))


def _same_table(plan) -> None:
    assert isinstance(plan, BlockPlan)
    read = BlockTable.of(tuple(plan))
    for field in BlockTable.__slots__:
        assert np.array_equal(getattr(plan.table, field), getattr(read, field)), field


def _random_documents(rng: random.Random, unit: int, total_units: int) -> Documents:
    cuts = sorted(rng.sample(range(1, total_units), min(total_units - 1, rng.randint(1, 40))))
    bounds = [0, *(c * unit for c in cuts), total_units * unit]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    return Documents(tuple(bounds), tuple(rng.randint(1, n) if rng.random() < 0.4 else n for n in lengths))


def _cases(layout, size: int):
    unit = layout.document_unit(size)
    rng = random.Random(size)
    docs = list(mixes(unit, size).values())
    docs += [_random_documents(rng, unit, rng.randint(2, 60) * 2 * size) for _ in range(3)]
    for d, causal, window in itertools.product(docs, (True, False), WINDOWS):
        yield d, Mask(causal, window, documents=d).within(d.seq_len)


@pytest.mark.parametrize("layout", RING_LAYOUTS, ids=lambda lay: lay.name)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_document_plans_are_the_per_document_scan(layout, size):
    for docs, mask in _cases(layout, size):
        if mask.documents is None:
            continue
        n = docs.seq_len // size
        for rank, source in itertools.product(range(size), repeat=2):
            plan = layout.plan(rank, source, size, n, mask)
            want = scan(layout.segments(rank, size, n, docs), layout.segments(source, size, n, docs), mask)
            assert tuple(plan) == want, (layout.name, size, docs, mask, rank, source)
            if plan:
                _same_table(plan)


def test_the_plans_merge_full_blocks_per_document():
    """Zigzag's plan meeting an earlier rank is one full block per document (the merge of two), and without a causal
    mask one per document (of four), also where the document's end is padding."""
    docs = Documents(tuple(range(0, 8 * 64 + 1, 64)))
    mask = Mask(True, documents=docs).within(docs.seq_len)
    plan = Zigzag().plan(2, 0, 4, docs.seq_len // 4, mask)
    assert len(plan) == docs.count and all(not b.causal and b.window == (None, None) for b in plan)
    full = Zigzag().plan(2, 0, 4, docs.seq_len // 4, Mask(False, documents=docs).within(docs.seq_len))
    assert [(b.q, b.k) for b in full] == [(slice(16 * d, 16 * d + 16), slice(16 * d, 16 * d + 16)) for d in range(8)]
    padded, _ = pad_documents([60, 64], 8 * 4)                 # chunks of 8; rank 0's late one: 4 real, 4 padding
    ends = Zigzag().plan(0, 0, 4, padded.seq_len // 4, Mask(False, documents=padded).within(padded.seq_len))
    assert [(b.q, b.k) for b in ends] == [(slice(0, 12), slice(0, 12)), (slice(16, 32), slice(16, 32))]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_the_all_gather_query_chunks_are_the_per_document_scan(size):
    for docs, mask in _cases(Zigzag(), size):
        if mask.documents is None:
            continue
        n = docs.seq_len // size
        for rank in range(size):
            chunks = allgather._query_chunks(rank, size, n, mask)
            want = scan(Zigzag().segments(rank, size, n, docs), Contiguous().segments(0, 1, docs.seq_len, docs), mask)
            assert tuple(chunks) == want
            if chunks:
                _same_table(chunks)


def test_documents_hash_as_their_boundaries_do():
    """Plans are cached under keys holding the documents, and their hash is computed once per object: it must still
    follow equality, also for a copy from another process (pickled)."""
    import pickle
    docs = Documents(tuple(range(0, 4097 * 8, 8)), tuple([8] * 4095 + [3]))
    assert hash(docs) == hash(Documents(docs.bounds, docs.valid)) and docs == Documents(docs.bounds, docs.valid)
    copy = pickle.loads(pickle.dumps(docs))
    assert copy == docs and hash(copy) == hash(docs) == hash(Documents(docs.bounds, docs.valid))
    others = {Documents(docs.bounds), Documents(docs.bounds[:-1] + (docs.bounds[-1] + 8,), docs.valid)}
    assert docs not in others and Documents(docs.bounds) in others
    mask = Mask(True, documents=docs)
    assert {mask: 1}[Mask(True, documents=Documents(docs.bounds, docs.valid))] == 1


def test_a_plan_makes_block_objects_only_for_the_blocks_that_run_alone():
    """With a varlen kernel the calls are read from the plan's table: no Block object is made for the blocks inside a
    varlen call, and the result equals that of the same blocks handed in as a tuple. The plan equals (and hashes as)
    the tuple of its blocks."""
    from ctx_plugin.core.block_calls import plan_calls
    from ctx_plugin.core.kernels.torch_math import TorchKernel
    docs = Documents(tuple(range(0, 64 * 12 + 1, 64)))
    for causal, window in ((True, (None, None)), (False, (2, 3))):     # (2, 3): right-bounded blocks run alone
        mask = Mask(causal, window, documents=docs).within(docs.seq_len)
        layouts._document_plan.cache_clear()                            # a new plan (others may have used it)
        plan = Zigzag().plan(1, 1, 2, docs.seq_len // 2, mask)
        singles, calls = plan_calls(TorchKernel(), plan, mask, docs.seq_len // 2, docs.seq_len // 2, 1)
        assert plan._blocks is None                                      # nothing made but the singles
        assert (singles, calls) == plan_calls(TorchKernel(), tuple(plan), mask, docs.seq_len // 2,
                                              docs.seq_len // 2, 1)
        bounded = {b for b in plan if not b.causal and b.window[1] is not None}   # (plan's blocks made now)
        assert calls and (not singles if causal else bounded and bounded <= set(singles))
    blocks = tuple(plan)
    assert plan == blocks and blocks == plan and hash(plan) == hash(blocks) and plan[-1] == blocks[-1]
    assert list(plan[1:3]) == list(blocks[1:3]) and plan.pick([2, 0]) == (blocks[2], blocks[0])
