"""Layouts: shard/gather round trips, positions are permutations, and the ring plans cover the mask once."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.core.layouts import (RING_LAYOUTS, Contiguous, Striped, UlyssesRing, Zigzag, ring_layout, ring_schedule,
                                     shard_layout)
from ctx_plugin.core.mask import Mask
from ctx_plugin.names import Backend

SIZES = range(1, 9)
LAYOUT_LIST = [*RING_LAYOUTS, UlyssesRing(1), UlyssesRing(2), UlyssesRing(4)]


def _seq_len(layout, size: int, per_unit: int = 3) -> int:
    return layout.unit(size) * per_unit


def _name(layout) -> str:
    return f"{layout.name}{getattr(layout, 'ulysses_size', '')}"


def _valid(sizes):
    """(layout, size) pairs a group can have: the hybrid's ulysses_size must divide the group size."""
    return [pytest.param(layout, size, id=f"{_name(layout)}-P{size}") for layout in LAYOUT_LIST for size in sizes
            if size % getattr(layout, "ulysses_size", 1) == 0]


@pytest.mark.parametrize("layout,size", _valid(SIZES))
def test_positions_form_a_permutation(layout, size):
    seq = _seq_len(layout, size)
    perm = layout.permutation(seq, size)
    assert perm.dtype == torch.int64
    assert sorted(perm.tolist()) == list(range(seq))
    for rank in range(size):
        local = layout.local_indices(seq, rank, size)
        assert local.numel() == seq // size
        assert torch.all(local[1:] > local[:-1]), "local tokens must stay in increasing global order"


def test_known_layouts():
    assert Contiguous().local_indices(8, 1, 2).tolist() == [4, 5, 6, 7]
    assert Zigzag().local_indices(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert Zigzag().local_indices(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert Striped().local_indices(8, 1, 4).tolist() == [1, 5]


def _kernel_mask(blk) -> torch.Tensor:
    """The block's mask in the kernels' bottom-right convention (flash-attn's), written out."""
    sq, sk = blk.q.stop - blk.q.start, blk.k.stop - blk.k.start
    left, right = blk.window
    d = torch.arange(sk).unsqueeze(0) - torch.arange(sq).unsqueeze(1) - (sk - sq)       # b − a − (sk − sq)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        keep &= d >= -left
    if right is not None:
        keep &= d <= right
    if blk.causal:
        keep &= d <= 0
    return keep


def _global_mask(seq: int, mask: Mask) -> torch.Tensor:
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    left, right = mask.window
    keep = torch.ones(seq, seq, dtype=torch.bool)
    if mask.causal:
        keep &= j <= i
    if left is not None:
        keep &= j >= i - left
    if right is not None:
        keep &= j <= i + right
    return keep.to(torch.int64)


def _check_cover(layout, size: int, n: int, mask: Mask) -> None:
    """Over the schedule's steps the blocks cover the global mask exactly once; every block is trimmed with
    kernel-window sides ≥ 0; steps off the schedule have no block on any rank; the schedule is the shortest arc."""
    seq = n * size
    cover = torch.zeros(seq, seq, dtype=torch.int64)
    schedule = ring_schedule(layout, size, n, mask)
    needed = set()
    for rank in range(size):
        q_pos = layout.local_indices(seq, rank, size)
        for offset in range(size):
            source = (rank - offset) % size
            k_pos = layout.local_indices(seq, source, size)
            blocks = layout.plan(rank, source, size, n, mask)
            if blocks:
                needed.add(offset)
            for blk in blocks:
                assert all(side is None or side >= 0 for side in blk.window), blk
                keep = _kernel_mask(blk)
                assert keep.any(1).all() and keep.any(0).all(), f"untrimmed block {blk}"
                qi, ki = q_pos[blk.q], k_pos[blk.k]
                cover[qi.unsqueeze(1), ki.unsqueeze(0)] += keep.to(torch.int64)
    assert torch.equal(cover, _global_mask(seq, mask)), (layout.name, size, n, mask)
    assert needed <= set(schedule.offsets)
    assert {schedule.offsets[0], schedule.offsets[-1]} <= needed
    shortest = min(length for start in range(size) for length in range(1, size + 1)
                   if needed <= {(start + t) % size for t in range(length)})
    assert schedule.steps == shortest


WINDOWS = [(None, None), (0, 0), (1, 0), (2, None), (3, 0), (7, 0), (100, 0), (None, 0), (2, 3), (0, 5), (None, 2),
           (5, 1)]


@pytest.mark.parametrize("layout", RING_LAYOUTS, ids=_name)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("size", range(1, 6))
def test_plans_cover_the_global_mask_exactly_once(layout, causal, size):
    """Every window (none, 0, 1, smaller than a chunk, between, larger than the sequence, left-only, left+right,
    right-only) over local lengths including 1 and 2 (zigzag: even ones)."""
    lengths = (2, 4, 6) if layout.multiple == 2 else (1, 2, 3, 5)
    for n in lengths:
        for window in WINDOWS:
            _check_cover(layout, size, n, Mask(causal, window))


def test_plans_without_a_window_cover_the_mask_for_larger_rings():
    for layout in RING_LAYOUTS:
        for size in (6, 7, 8):
            for causal in (True, False):
                _check_cover(layout, size, 2 * layout.multiple, Mask(causal))


@pytest.mark.parametrize("size", range(1, 9))
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_contiguous_causal_window_needs_ceil_w_over_n_transfers(size, n):
    """A causal window reaching w tokens back over shards of n tokens: ⌈w/n⌉ + 1 steps and ⌈w/n⌉ K/V transfers
    instead of P and P − 1; a right side (non-causal) adds ⌈right/n⌉ shards ahead, fetched in one exchange."""
    for w in (0, 1, 2, 5, 9, 40):
        schedule = ring_schedule(Contiguous(), size, n, Mask(True, (w, 0)))
        back = min(-(-w // n), size - 1)
        assert (schedule.start, schedule.steps, schedule.kv_transfers) == (0, back + 1, back)
        for right in (1, 4):
            ahead = -(-right // n)
            schedule = ring_schedule(Contiguous(), size, n, Mask(False, (w, right)))
            if back + ahead + 1 >= size:
                assert schedule.steps == size and schedule.kv_transfers == size - 1
            else:
                assert (schedule.start, schedule.steps) == (size - ahead, back + ahead + 1)
                assert schedule.kv_transfers == back + ahead + 1


def test_striped_and_zigzag_windows_need_more_steps():
    """What the other layouts allow (README): zigzag needs shards on both sides (its late chunk's neighbours sit
    on the next rank), striped needs every shard once the window reaches P − 1 tokens back."""
    assert ring_schedule(Zigzag(), 8, 8, Mask(True, (4, 0))).offsets == (7, 0, 1)
    assert ring_schedule(Striped(), 8, 8, Mask(True, (3, 0))).offsets == (0, 1, 2, 3)
    assert ring_schedule(Striped(), 8, 8, Mask(True, (7, 0))).steps == 8


def test_hybrid_layout_regroups_into_zigzag_ring_shards():
    """Concatenating a Ulysses group's shards (what its all-to-all does) gives that ring rank's zigzag shard."""
    seq, size, u = 48, 4, 2
    hybrid = UlyssesRing(u)
    for outer in range(size // u):
        group = torch.cat([hybrid.local_indices(seq, outer * u + i, size) for i in range(u)])
        assert torch.equal(group, Zigzag().local_indices(seq, outer, size // u))
    assert hybrid.unit(size) == 4 and UlyssesRing(4).unit(4) == 4 and UlyssesRing(1).unit(4) == 8


def test_backend_layouts():
    layout = lambda backend, u=1: shard_layout(ctx_plugin.CPConfig(backend=backend, ulysses_size=u))  # noqa: E731
    assert isinstance(layout(Backend.RING), Contiguous)
    assert isinstance(layout(Backend.ZIGZAG), Zigzag)
    assert isinstance(layout(Backend.STRIPED), Striped)
    assert isinstance(layout(Backend.ULYSSES), Contiguous)
    assert isinstance(layout(Backend.ALLGATHER), Zigzag)
    hybrid = layout(Backend.ULYSSES_RING, 2)
    assert isinstance(hybrid, UlyssesRing) and hybrid.ulysses_size == 2
    assert isinstance(ring_layout(ctx_plugin.CPConfig(backend="ulysses_ring", ulysses_size=2)), Zigzag)
    assert all(shard_layout(ctx_plugin.CPConfig(backend=b)) is not None for b in Backend)


@pytest.mark.parametrize("backend", list(Backend))
def test_shard_gather_round_trip_single_process(backend):
    cfg = ctx_plugin.CPConfig(backend=backend)
    groups = ctx_plugin.build_cp_groups(cfg)
    x = torch.randn(2, 12, 3)
    shard = ctx_plugin.shard_sequence(x, config=cfg, groups=groups, dim=1)
    assert torch.equal(ctx_plugin.gather_sequence(shard, config=cfg, groups=groups, dim=1), x)
    assert ctx_plugin.sequence_positions(12, config=cfg, groups=groups).tolist() == list(range(12))


@pytest.mark.parametrize("layout,size", _valid([2, 3, 4]))
def test_shards_reassemble_through_the_permutation(layout, size):
    """Sharding every rank's part and undoing the permutation (what gather_sequence does) gives x back."""
    seq = _seq_len(layout, size)
    x = torch.randn(seq, 5)
    parts = [x.index_select(0, layout.local_indices(seq, r, size)) for r in range(size)]
    inverse = torch.argsort(layout.permutation(seq, size))
    assert torch.equal(torch.cat(parts).index_select(0, inverse), x)
