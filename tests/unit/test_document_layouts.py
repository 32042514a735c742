"""Packed documents in the layouts: per-document shards, positions that restart, and ring plans whose blocks cover
the block-diagonal mask (Mask.allows, the definition) exactly once for every layout, P and document mix; causal
work stays balanced for skewed mixes."""
from __future__ import annotations

import pytest
import torch

from ctx_plugin.core.block_calls import plan_calls
from ctx_plugin.core.blocks import Block, merge_blocks
from ctx_plugin.core.documents import Documents, check_documents, pad_documents
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.core.layouts import RING_LAYOUTS, Contiguous, Striped, UlyssesRing, Zigzag, rank_work, ring_schedule
from ctx_plugin.core.mask import Mask

from .test_layouts import _kernel_mask

WINDOWS = [(None, None), (0, 0), (2, 0), (3, 1), (None, 2)]


def mixes(unit: int, size: int) -> dict[str, Documents]:
    """Document mixes whose lengths are multiples of ``unit`` and whose total is a multiple of ``size`` and of 2."""
    step = unit * size * 2 // __import__("math").gcd(unit, size * 2)
    out = {"one": [2 * step], "equal": [unit] * (2 * step // unit), "unequal": [step - unit, unit, 2 * step]}
    out["unequal"] = [n for n in out["unequal"] if n]
    short = [unit, 3 * step - unit]               # shorter than one rank's chunk of the sequence
    out["short"] = short
    docs = {name: Documents(tuple(__import__("itertools").accumulate([0, *lengths]))) for name, lengths in out.items()}
    padded, _ = pad_documents([1, 2 * unit + 1, unit], step)
    docs["padded"] = padded
    return docs


def definition(mask: Mask, seq: int) -> torch.Tensor:
    return torch.tensor([[int(mask.allows(i, j)) for j in range(seq)] for i in range(seq)], dtype=torch.int64)


def check_cover(layout, size: int, mask: Mask, docs) -> None:
    """``docs``: the mask's documents as given (one all-real document leaves the mask without documents)."""
    seq = docs.seq_len
    n = seq // size
    cover = torch.zeros(seq, seq, dtype=torch.int64)
    schedule = ring_schedule(layout, size, n, mask)
    for rank in range(size):
        q_pos = layout.local_indices(seq, rank, size, docs)
        for offset in range(size):
            source = (rank - offset) % size
            k_pos = layout.local_indices(seq, source, size, docs)
            blocks = layout.plan(rank, source, size, n, mask)
            assert not blocks or offset in schedule.offsets, (rank, offset)
            for blk in blocks:
                keep = _kernel_mask(blk)
                assert keep.any(1).all() and keep.any(0).all(), f"untrimmed block {blk}"
                cover[q_pos[blk.q].unsqueeze(1), k_pos[blk.k].unsqueeze(0)] += keep.to(torch.int64)
    assert torch.equal(cover, definition(mask, seq)), (layout.name, size, docs, mask)


@pytest.mark.parametrize("layout", RING_LAYOUTS, ids=lambda l: l.name)
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_plans_cover_the_document_mask_exactly_once(layout, size):
    for name, docs in mixes(layout.document_unit(size), size).items():
        for causal in (True, False):
            for window in WINDOWS:
                check_cover(layout, size, Mask(causal, window, documents=docs), docs)


@pytest.mark.parametrize("layout", [*RING_LAYOUTS, UlyssesRing(2)], ids=lambda l: l.name)
@pytest.mark.parametrize("size", [2, 4])
def test_document_shards_form_a_permutation(layout, size):
    for docs in mixes(layout.document_unit(size), size).values():
        seq = docs.seq_len
        perm = layout.permutation(seq, size, docs)
        assert perm.dtype == torch.int64 and sorted(perm.tolist()) == list(range(seq))
        for rank in range(size):
            local = layout.local_indices(seq, rank, size, docs)
            assert local.numel() == seq // size and torch.all(local[1:] > local[:-1])


def test_known_document_layouts():
    docs = Documents((0, 4, 12))
    assert Zigzag().local_indices(12, 0, 2, docs).tolist() == [0, 3, 4, 5, 10, 11]
    assert Zigzag().local_indices(12, 1, 2, docs).tolist() == [1, 2, 6, 7, 8, 9]
    assert Striped().local_indices(12, 1, 2, docs).tolist() == [1, 3, 5, 7, 9, 11]
    assert Striped().local_indices(12, 0, 4, Documents((0, 4, 12))).tolist() == [0, 4, 8]
    assert Contiguous().segments(0, 2, 6, docs) == ((slice(0, 4), 0, 1, 0), (slice(4, 6), 4, 1, 1))
    assert UlyssesRing(2).local_indices(12, 1, 4, docs).tolist() == [5, 10, 11]     # ring rank 0: 0,3,4,5,10,11
    assert Documents((0, 4, 12)).positions().tolist() == [0, 1, 2, 3, *range(8)]


@pytest.mark.parametrize("layout,factor", [(Zigzag(), 1.1), (Striped(), 1.1)], ids=["zigzag", "striped"])
@pytest.mark.parametrize("size", [2, 4])
def test_causal_work_is_balanced_for_skewed_documents(layout, factor, size):
    """Many short documents and one long one at the end: every rank's causal work within ``factor`` of the mean,
    while contiguous shards are far off (the skew is real)."""
    unit = 2 * size
    lengths = [unit] * 16 + [3 * unit] * 4 + [64 * unit]
    docs = Documents(tuple(__import__("itertools").accumulate([0, *lengths])))
    mask = Mask(True, documents=docs)
    work = rank_work(layout, size, docs.seq_len // size, mask)
    mean = sum(work) / size
    assert sum(work) == int(definition(mask, docs.seq_len).sum())
    assert max(work) <= factor * mean and min(work) >= mean / factor, work
    contiguous = rank_work(Contiguous(), size, docs.seq_len // size, mask)
    assert max(contiguous) > 1.5 * sum(contiguous) / size, contiguous


def test_plans_without_documents_are_unchanged():
    """Documents covering the sequence as one document give the same coverage; without them the fast plans run."""
    assert Zigzag().plan(1, 1, 2, 8, Mask(True)) == Zigzag().causal_plan(1, 1, 2, 8)
    one = Mask(False, documents=Documents((0, 16)))
    assert Zigzag().plan(0, 1, 2, 8, one) == (Zigzag().plan(0, 1, 2, 8, Mask(False))[0],)


def test_bad_documents_are_refused():
    for bad, error, text in (
            (torch.tensor([0.0, 4.0]), TypeError, "integer tensor"),
            ([0, 4.5], TypeError, "must hold ints"),
            ("0,4", TypeError, "cu_seqlens"),
            ([1, 4, 8], ValueError, "start at 0"),
            ([0, 4, 4, 8], ValueError, "document 1 runs from 4 to 4"),
            ([0, 4, 6], ValueError, "sequence length 8.*last boundary is 6"),
            ([0], ValueError, "at least two")):
        with pytest.raises(error, match=text):
            check_documents(bad, 8)
    with pytest.raises(ValueError, match=r"valid\[1\] must be between 1 and the document's length 4"):
        Documents((0, 4, 8), (4, 5))
    assert check_documents(torch.tensor([0, 3, 8], dtype=torch.int32), 8) == Documents((0, 3, 8))
    assert Documents((0, 4, 8), (4, 4)) == Documents((0, 4, 8))


# ---------------------------------------------------------------- a step's blocks, merged and planned once
def _pairs(blocks, size: int = 16) -> torch.Tensor:
    """How many times each (row, key) pair is computed by ``blocks`` (their masks written out)."""
    count = torch.zeros(size, size, dtype=torch.int64)
    for blk in blocks:
        count[blk.q, blk.k] += _kernel_mask(blk).long()
    return count


def _joinable(a: Block, b: Block) -> bool:
    full = all(not x.causal and x.window == (None, None) for x in (a, b))
    rows = a.k == b.k and (a.q.stop == b.q.start or b.q.stop == a.q.start)
    keys = a.q == b.q and (a.k.stop == b.k.start or b.k.stop == a.k.start)
    return full and (rows or keys)


def test_merge_blocks_joins_until_nothing_more_joins():
    """The pairs computed stay the same, the blocks that are not full are kept as they are, and no two full blocks
    left share keys with adjacent rows or rows with adjacent keys (shuffled grids: joins cascade both ways)."""
    import random
    rng = random.Random(5)
    for _ in range(1500):
        tiles = [Block(slice(i, i + 1), slice(j, j + 1), rng.random() < 0.1)
                 for i in range(rng.randrange(1, 6)) for j in range(rng.randrange(1, 6))]
        tiles += [Block(slice(8, 10), slice(8, 12), False, (1, None))] if rng.random() < 0.3 else []
        rng.shuffle(tiles)
        merged = merge_blocks(tiles)
        assert torch.equal(_pairs(merged), _pairs(tiles)), tiles
        partial = [b for b in tiles if b.causal or b.window != (None, None)]
        assert [b for b in merged if b.causal or b.window != (None, None)] == partial
        assert not any(_joinable(a, b) for i, a in enumerate(merged) for b in merged[i + 1:]), merged


def test_a_plan_is_chained_and_packed_once():
    """Every layer hands the same cached plan again, forward and backward: its varlen calls are built once."""
    docs = Documents((0, 16, 40, 64))
    mask = Mask(True, documents=docs).within(64)
    blocks = Zigzag().plan(0, 1, 2, 32, mask)
    assert blocks is Zigzag().plan(0, 1, 2, 32, mask)                       # the layouts' cache
    first = plan_calls(TorchKernel(), blocks, mask, 32, 32, 2)
    assert first[1] and plan_calls(TorchKernel(), blocks, mask, 32, 32, 2) is first
    again = plan_calls(TorchKernel(), tuple(list(blocks)), mask, 32, 32, 2)   # an equal plan, another object
    assert again == first and again is not first
    call = first[1][0]
    assert call.cu_seqlens(torch.device("cpu"))[0] is not None and call._boundaries is call._boundaries
    cu_q, cu_k = call.cu_seqlens(torch.device("cpu"))
    assert cu_q.tolist() == [0, *(s[1] for s in call.seqs)] and cu_k.tolist() == [0, *(s[3] for s in call.seqs)]


@pytest.mark.parametrize("layout", RING_LAYOUTS, ids=lambda lay: lay.name)
def test_the_schedule_is_the_same_whichever_rank_looks_first(layout):
    """Each rank checks its own plans first (it needs them anyway); the arc must not depend on who asks."""
    for size, mask in ((4, Mask(True, (3, 0))), (8, Mask(True, (5, 0))), (4, Mask(False, (2, 6))),
                       (4, Mask(True, documents=Documents((0, 8, 64, 128))).within(128))):
        n = 128 // size
        arcs = {ring_schedule(layout, size, n, mask, rank) for rank in range(size)}
        assert len(arcs) == 1, arcs


def test_planning_pauses_the_garbage_collector_and_restores_it():
    import gc
    from ctx_plugin.core.blocks import gc_paused
    seen = []
    with gc_paused():
        seen.append(gc.isenabled())
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:                                    # off before (Megatron's --manual-gc): stays off
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    with pytest.raises(RuntimeError):       # and back on after an error
        with gc_paused():
            raise RuntimeError
    assert gc.isenabled()
