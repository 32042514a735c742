"""Packed documents through every backend, against an independent float64 reference: each document's real tokens
attended on their own (plain dense attention per document, so nothing crosses a document or touches padding).

The matrix runs the real ``cp_attention``, ``shard_sequence``, ``sequence_positions`` and ``gather_sequence`` on
simulated ranks (threads exchanging real tensors, :mod:`ctx_plugin.bench.simulated`): every backend × P ∈ {1, 2, 3,
4} (Ulysses where the heads allow) × document mixes (one document, many equal, very unequal, one shorter than a
rank's chunk, single-token documents; padded with ``pad_documents`` to the layout's units) × causal/non-causal, GQA,
outputs and every gradient; a few mixes also with a sliding window, softcap and sinks. Padding rows give 0 and no
gradient flows into padding K/V. The ring skips (document, step) blocks with no pair inside one document.
"""
from __future__ import annotations

import itertools
import threading

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.bench.simulated import run_threaded, simulated_groups
from ctx_plugin.core.documents import Documents, pad_documents
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.core.rules import padding_units
from ctx_plugin.names import Backend

from ..reference import documents_with_grads, rel_err

HEADS, KV_HEADS, DIM = 4, 2, 8
SIZES = {Backend.RING: [(1, 1), (2, 1), (3, 1), (4, 1)], Backend.ZIGZAG: [(1, 1), (2, 1), (3, 1), (4, 1)],
         Backend.STRIPED: [(1, 1), (2, 1), (3, 1), (4, 1)], Backend.ALLGATHER: [(1, 1), (2, 1), (3, 1), (4, 1)],
         Backend.ULYSSES: [(1, 1), (2, 1), (4, 1)], Backend.ULYSSES_RING: [(2, 2), (4, 2)]}
assert set(SIZES) == set(Backend)
# raw document lengths; pad_documents pads them to each layout's units
MIXES = {"one": [37], "equal": [6] * 6, "unequal": [3, 29, 1, 11], "short": [2, 40, 5], "single_tokens": [1, 1, 9, 1]}
CASES = [(b, p, u, causal) for b, sizes in SIZES.items() for p, u in sizes for causal in (True, False)]


def packed(config, size: int, lengths) -> Documents:
    unit, total = padding_units(config, size)
    return pad_documents(lengths, unit, total_unit=total)[0]


def inputs(seq: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(2, seq, h, DIM, generator=g, dtype=torch.float64)  # noqa: E731
    return make(HEADS), make(KV_HEADS), make(KV_HEADS), make(HEADS), torch.randn(HEADS, generator=g,
                                                                                  dtype=torch.float64)


def run(config, size: int, q, k, v, dout, docs: Documents, *, causal: bool, sinks=None, **variants):
    """The whole sequence's out, dq, dk, dv (gathered with gather_sequence on every rank, checked equal), the sum of
    the ranks' sinks.grad, per rank the communication counts, and each rank's sequence_positions."""
    # cu_seqlens as a user passes them when every token is real; Documents carry the padding (valid) otherwise
    given = torch.tensor(docs.bounds, dtype=torch.int32) if docs.valid is None else docs

    def rank_work(rank: int, world):
        groups = simulated_groups(config, rank, size, world, "cpu")
        shard = lambda t: ctx_plugin.shard_sequence(t, config=config, groups=groups, dim=1,  # noqa: E731
                                                    documents=docs)
        local = [shard(t).detach().requires_grad_(True) for t in (q, k, v)]
        own_sinks = None if sinks is None else sinks.detach().clone().requires_grad_(True)
        counter = CommCounter()
        with counter.counting():
            out = ctx_plugin.cp_attention(*local, config=config, groups=groups, causal=causal, sinks=own_sinks,
                                          documents=given, **variants)
            out.backward(shard(dout))
        gather = lambda t: ctx_plugin.gather_sequence(t, config=config, groups=groups, dim=1,  # noqa: E731
                                                      documents=docs)
        with torch.no_grad():
            full = [gather(t) for t in (out, *(x.grad for x in local))]
        positions = ctx_plugin.sequence_positions(docs.seq_len, config=config, groups=groups, documents=docs)
        return full, None if sinks is None else own_sinks.grad, dict(counter.counts), positions, shard(
            torch.arange(docs.seq_len).view(1, -1))[0]

    results = run_threaded(size, rank_work)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r[0], results[0][0])), "ranks gathered different sequences"
    dsinks = None if sinks is None else sum(r[1] for r in results)
    return results[0][0], dsinks, [r[2] for r in results], [(r[3], r[4]) for r in results]


def check(config, size, docs, *, causal, seed=5, sinks=False, **variants):
    q, k, v, dout, s = inputs(docs.seq_len, seed)
    s = s if sinks else None
    got, dsinks, _, positions = run(config, size, q, k, v, dout, docs, causal=causal, sinks=s, **variants)
    want = documents_with_grads(q, k, v, dout, docs, causal=causal, sinks=s, **variants)
    what = f"{config.backend} P{size} {docs} causal={causal} {variants} sinks={sinks}"
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 1e-10, f"{what}: {name} relative error {rel_err(g, w):.2e}"
    if sinks:
        assert rel_err(dsinks, want[4]) < 1e-10, what
    pads = torch.tensor([not docs.is_real(i) for i in range(docs.seq_len)])
    if pads.any():                                              # padding: output 0, no gradient into it
        for t in got:
            assert torch.all(t[:, pads] == 0), what
    per_document = docs.positions()
    for pos, index in positions:
        assert torch.equal(pos, per_document[index]), what


@pytest.mark.parametrize("backend,size,u,causal", CASES,
                         ids=[f"{b.value}-P{p}-u{u}-{'causal' if c else 'full'}" for b, p, u, c in CASES])
def test_documents_match_the_per_document_reference(backend, size, u, causal):
    config = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    for name, lengths in MIXES.items():
        check(config, size, packed(config, size, lengths), causal=causal, seed=len(name))


@pytest.mark.parametrize("backend,size,u", [(Backend.RING, 3, 1), (Backend.ZIGZAG, 4, 1), (Backend.STRIPED, 2, 1),
                                            (Backend.ALLGATHER, 3, 1), (Backend.ULYSSES, 2, 1),
                                            (Backend.ULYSSES_RING, 4, 2)])
def test_documents_with_window_softcap_and_sinks(backend, size, u):
    config = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    docs = packed(config, size, MIXES["unequal"])
    for causal, window in ((True, (4, 0)), (False, (3, 2)), (True, None)):
        check(config, size, docs, causal=causal, window=window, softcap=2.0, sinks=True)


@pytest.mark.parametrize("backend,size,u", [(Backend.ZIGZAG, 2, 1), (Backend.RING, 3, 1), (Backend.ULYSSES_RING, 4, 2)])
def test_a_sink_of_minus_infinity_next_to_padding_gives_zeros(backend, size, u):
    """A sink logit of -inf (no sink for that head) on padding rows, which have no key either: output 0 and no
    gradient there, the sink's gradient 0 (both were 0/0 = NaN), the rest as without that sink."""
    config = ctx_plugin.CPConfig(backend=backend, kernel="torch", ulysses_size=u)
    docs = packed(config, size, MIXES["unequal"])
    assert docs.valid is not None
    q, k, v, dout, sinks = inputs(docs.seq_len, seed=3)
    sinks[1] = float("-inf")
    got, dsinks, _, _ = run(config, size, q, k, v, dout, docs, causal=True, sinks=sinks)
    want = documents_with_grads(q, k, v, dout, docs, causal=True, sinks=sinks)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(g).all() and rel_err(g, w) < 1e-10, name
    assert dsinks[1] == 0 and torch.isfinite(dsinks).all() and rel_err(dsinks, want[4]) < 1e-10, (dsinks, want[4])
    pads = torch.tensor([not docs.is_real(i) for i in range(docs.seq_len)])
    assert all(torch.all(t[:, pads] == 0) for t in got)


def test_unpadded_documents_that_fit_need_no_padding():
    """Documents already a multiple of the unit run as given (no valid counts): zigzag over 2 ranks, unit 4."""
    config = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    docs = Documents(tuple(itertools.accumulate([0, 4, 12, 8])))
    assert docs.valid is None
    check(config, 2, docs, causal=True)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Forward kernel launches per rank (thread): a block call, or a varlen call (whose per-sequence block calls
    inside the torch kernel's reference pair are not launches)."""
    calls: dict = {}
    inside = threading.local()
    fwd, fwd_varlen = TorchKernel.forward, TorchKernel.forward_varlen

    def count(self, *args, **kwargs):
        if not getattr(inside, "varlen", False):
            key = threading.current_thread().name
            calls[key] = calls.get(key, 0) + 1
        return fwd(self, *args, **kwargs)

    def count_varlen(self, *args, **kwargs):
        key = threading.current_thread().name
        calls[key] = calls.get(key, 0) + 1
        inside.varlen = True
        try:
            return fwd_varlen(self, *args, **kwargs)
        finally:
            inside.varlen = False

    monkeypatch.setattr(TorchKernel, "forward", count)
    monkeypatch.setattr(TorchKernel, "forward_varlen", count_varlen)
    return calls


def test_the_ring_skips_steps_no_document_spans(kernel_calls):
    """Contiguous shards of 8 tokens over 4 ranks and documents that never cross a shard: every step but the own
    block has nothing to compute, so no K/V moves at all and each rank calls the kernel once: its
    one document's block, or its two documents' blocks in one varlen call."""
    config = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    docs = Documents(tuple(itertools.accumulate([0, 3, 5, 8, 2, 6, 8])))
    q, k, v, dout, _ = inputs(32)
    got, _, counts, _ = run(config, 4, q, k, v, dout, docs, causal=True)
    want = documents_with_grads(q, k, v, dout, docs, causal=True)
    assert all(rel_err(g, w) < 1e-10 for g, w in zip(got, want))
    for c in counts:
        assert c.get("ring_kv", 0) == 0 and c.get("ring_dkv", 0) == 0, c
    assert sorted(kernel_calls.values()) == [1, 1, 1, 1]
    # one document spanning shards 1 and 2: one transfer each way, other ranks pass the K/V on
    docs = Documents((0, 8, 12, 20, 32))
    _, _, counts, _ = run(config, 4, q, k, v, dout, docs, causal=True)
    assert all(c.get("ring_kv", 0) == 2 for c in counts), counts


def test_bad_documents_are_refused_before_anything_runs():
    config = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    groups = ctx_plugin.build_cp_groups(config)
    q, k, v, _, _ = inputs(12)
    call = lambda docs: ctx_plugin.cp_attention(q, k, v, config=config, groups=groups, documents=docs)  # noqa: E731
    for docs, error, text in (
            ([0, 5, 12], ValueError, r"document 0 holds 5 tokens, not a multiple of 2.*pad_documents\(lengths, 2, "
                                     r"total_unit=2\)"),
            ([0, 6, 10], ValueError, "last boundary is 10"),
            (torch.tensor([0.0, 12.0]), TypeError, "integer tensor"),
            ("0,12", TypeError, "cu_seqlens")):
        with pytest.raises(error, match=text):
            call(docs)
        with pytest.raises(error, match=text.split(".*")[0]):
            ctx_plugin.shard_sequence(q, config=config, groups=groups, documents=docs)
    # contiguous shards cut documents anywhere: no document unit
    ring = ctx_plugin.CPConfig(backend="ring", kernel="torch")
    out = ctx_plugin.cp_attention(q, k, v, config=ring, groups=ctx_plugin.build_cp_groups(ring), documents=[0, 5, 12])
    assert out.shape == q.shape


def test_pad_documents_pads_each_document_and_the_sequence():
    docs, index = pad_documents([3, 5, 1], 4, total_unit=8)
    assert docs.bounds == (0, 4, 12, 16) and docs.valid == (3, 5, 1)
    assert index.tolist() == [0, 1, 2, -1, 3, 4, 5, 6, 7, -1, -1, -1, 8, -1, -1, -1]
    docs, _ = pad_documents([3, 5], 2, total_unit=8)
    assert docs.bounds == (0, 4, 16) and docs.valid == (3, 5)
    docs, _ = pad_documents([4, 4], 1, total_unit=4)
    assert docs.bounds == (0, 4, 8) and docs.valid is None
    with pytest.raises(ValueError, match="must be a multiple of unit"):
        pad_documents([3], 4, total_unit=6)
    with pytest.raises(ValueError, match="positive document lengths"):
        pad_documents([3, 0], 4)
