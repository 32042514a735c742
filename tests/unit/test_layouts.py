"""Layouts: shard/gather round trips, positions are permutations, and the ring plans cover the mask once."""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
from ctx_plugin.layouts import RING_LAYOUTS, Contiguous, Striped, UlyssesRing, Zigzag, ring_layout, shard_layout
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


@pytest.mark.parametrize("layout", RING_LAYOUTS, ids=_name)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("size", SIZES)
def test_plans_cover_the_global_mask_exactly_once(layout, causal, size):
    seq = _seq_len(layout, size)
    n = seq // size
    cover = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(size):
        q_pos = layout.local_indices(seq, rank, size)
        for step in range(size):
            source = (rank - step) % size
            k_pos = layout.local_indices(seq, source, size)
            for blk in layout.plan(rank, source, size, n, causal):
                qi, ki = q_pos[blk.q], k_pos[blk.k]
                mask = torch.ones(len(qi), len(ki), dtype=torch.int64)
                if blk.causal:
                    assert len(qi) == len(ki), "causal blocks must be square"
                    mask = mask.tril()
                cover[qi.unsqueeze(1), ki.unsqueeze(0)] += mask
    want = torch.ones(seq, seq, dtype=torch.int64)
    if causal:
        want = want.tril()
    assert torch.equal(cover, want)


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
