"""The benchmark's packed-documents case: FLOPs against a brute-force count of the block-diagonal mask, the padded
documents every rank gets, the ideal, the CLI table and its errors."""
from __future__ import annotations

import json

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench import harness
from ctx_plugin.bench.harness import Shape, rank_times
from ctx_plugin.cli import main
from ctx_plugin.names import Backend

B, H, D = 2, 4, 8


def layout(seq_len: int, lengths, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(document id, real?) of every position, written out token by token: the lengths in order, repeated, each
    padded at its end to a multiple of ``unit``, the sequence cut at ``seq_len``."""
    doc, real, d = [], [], 0
    while len(doc) < seq_len:
        n = lengths[d % len(lengths)]
        padded = -(-n // unit) * unit
        doc += [d] * padded
        real += [True] * n + [False] * (padded - n)
        d += 1
    return torch.tensor(doc[:seq_len]), torch.tensor(real[:seq_len])


def brute_pairs(seq_len: int, lengths, unit: int, causal: bool, window: int | None) -> int:
    """The (query, key) pairs of the dense mask: one document, both real, key not after the query (causal or a
    window (w, 0)), at most w tokens back."""
    doc, real = (torch.zeros(seq_len, dtype=torch.long), torch.ones(seq_len, dtype=torch.bool)) if lengths is None \
        else layout(seq_len, lengths, unit)
    i, j = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    ok = (doc[:, None] == doc[None, :]) & real[:, None] & real[None, :]
    if causal or window is not None:
        ok &= j <= i
    if window is not None:
        ok &= j >= i - window
    return int(ok.sum())


@pytest.mark.parametrize("seq,docs,unit,causal,window", [
    (64, (10, 3, 20), 4, True, None), (64, (10, 3, 20), 4, True, 5), (64, (10, 3, 20), 1, True, 0),
    (64, (10, 3, 20), 8, False, None), (96, 7, 8, True, None), (96, 7, 8, False, 3), (96, 7, 1, True, 2),
    (50, 100, 1, True, None), (64, None, 1, True, None), (64, None, 1, False, None), (64, None, 1, True, 100),
    (64, None, 1, True, 9)])
def test_flops_count_the_pairs_of_the_block_diagonal_mask(seq, docs, unit, causal, window):
    shape = Shape(seq_len=seq, batch=B, heads=H, kv_heads=H, head_dim=D, causal=causal, window=window, documents=docs)
    lengths = None if docs is None else (docs,) if isinstance(docs, int) else docs
    want = 4 * B * H * D * brute_pairs(seq, lengths, unit, causal, window)
    assert shape.flops(False, unit) == want
    assert shape.flops(True, unit) == 3.5 * want


@pytest.mark.parametrize("backend", list(Backend))
def test_every_rank_gets_the_documents_padded_to_its_layouts_unit(backend):
    """``documents_for`` lays out exactly the positions the FLOPs count (the token-by-token layout above)."""
    cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=2 if backend == Backend.ULYSSES_RING else 1)
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, documents=(10, 3, 20))
    unit = ctx_plugin.core.rules.document_unit(cfg, 4)
    assert shape.document_unit(cfg, 4) == unit
    docs = shape.documents_for(cfg, 4)
    doc, real = layout(64, (10, 3, 20), unit)
    assert docs.bounds == (0, *[p for p in range(1, 64) if doc[p] != doc[p - 1]], 64)
    assert [docs.real(d) for d in range(docs.count)] == [int(real[doc == d].sum()) for d in range(docs.count)]
    assert all(n % unit == 0 for n in docs.lengths)
    assert shape.documents_for(cfg, 4) is docs                       # one object for every rank and repetition


def test_padded_documents_by_hand():
    shape = Shape(seq_len=64, documents=[10, 3, 20])
    zigzag = shape.documents_for(ctx_plugin.CPConfig(backend="zigzag"), 2)            # unit 2·P = 4
    assert zigzag.bounds == (0, 12, 16, 36, 48, 52, 64) and zigzag.valid == (10, 3, 20, 10, 3, 12)
    ring = shape.documents_for(ctx_plugin.CPConfig(backend="ring"), 2)                # cut anywhere: no padding
    assert ring.bounds == (0, 10, 13, 33, 43, 46, 64) and ring.valid is None
    assert shape.packing(4).padding == 2 + 1 + 2 + 1 and shape.packing(1).padding == 0
    assert Shape(seq_len=64, documents=16).documents == (16,) and Shape(seq_len=64).documents_for(
        ctx_plugin.CPConfig(backend="zigzag"), 2) is None
    with pytest.raises(ValueError, match="--seq-len must be a positive multiple of 8"):
        Shape(seq_len=60, documents=(10,)).documents_for(ctx_plugin.CPConfig(backend="zigzag"), 4)
    with pytest.raises(ValueError, match="document lengths must be >= 1"):
        Shape(seq_len=8, documents=(4, 0))
    with pytest.raises(TypeError, match="documents must be None, a mean document length"):
        Shape(seq_len=8, documents="4")


def test_packed_ideal_is_the_full_mask_call_scaled_by_the_kept_pairs(monkeypatch):
    """One kernel call on the whole sequence, without documents (they need no kernel feature), times the share of
    the full mask's pairs the documents (padded to the row's unit) keep."""
    from ctx_plugin.core.kernels.torch_math import TorchKernel

    seen = []

    class Recording(TorchKernel):
        def forward(self, q, k, v, *, causal, scale, window=(None, None), softcap=None):
            seen.append((q.shape[1], causal, window))
            return super().forward(q, k, v, causal=causal, scale=scale, window=window, softcap=softcap)

    monkeypatch.setattr(harness, "select_kernel", lambda *a: Recording())
    monkeypatch.setattr(harness, "median_time", lambda fn, *a, **kw: (fn(), 2.0)[1])
    for causal, window, full in ((True, None, 64 * 65 / 2), (False, None, 64 * 64), (True, 5, 64 * 65 / 2)):
        shape = Shape(seq_len=64, heads=2, kv_heads=2, head_dim=8, causal=causal, window=window,
                      documents=(10, 3, 20), dtype=torch.float32)
        seconds, _ = harness.ideal_time(shape, ctx_plugin.Kernel.AUTO, False, 1, unit=4)
        assert seconds == pytest.approx(2.0 * brute_pairs(64, (10, 3, 20), 4, causal, window) / full)
        assert seen[-1] == (64, causal, (None, None))


def test_rank_times_call_cp_attention_with_the_padded_documents(monkeypatch):
    calls = []
    real = harness.cp_attention

    def recording(*args, **kwargs):
        calls.append(kwargs["documents"])
        return real(*args, **kwargs)
    monkeypatch.setattr(harness, "cp_attention", recording)
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, documents=(10, 3, 20), dtype=torch.float32)
    cfg = ctx_plugin.CPConfig(backend="striped", kernel="torch")
    times = rank_times(shape, cfg, 4, True, 1)
    assert len(times) == 4 and calls and all(c is shape.documents_for(cfg, 4) for c in calls)
    assert calls[0].lengths == (12, 4, 20, 12, 4, 12)                  # striped over 4: unit 4


def test_cli_packed_table(tmp_path, capsys):
    out = tmp_path / "packed.json"
    assert main(["bench", "--smoke", "--passes", "fwd", "--backends", "ring", "zigzag", "--doc-len", "20",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "documents of 20 tokens filling the sequence" in text and "padded at its end to the layout's" in text
    assert text.splitlines()[1].split()[-5:] == ["docs", "unit", "pad", "plan", "ms"]
    report = json.loads(out.read_text())
    assert report["shape"]["documents"] == [20]
    rows = {(r["backend"], r["ranks"]): r for r in report["rows"]}
    # S = 256: ring cuts documents anywhere (12 of 20 and one of 16); zigzag over 4 pads each to 24 (10 of them,
    # then the 16 positions left, all real)
    assert {k: (r["documents"], r["doc_unit"], r["padding"]) for k, r in rows.items()} == {
        ("ring", 2): (13, 1, 0), ("ring", 4): (13, 1, 0), ("zigzag", 2): (13, 4, 0), ("zigzag", 4): (11, 8, 40)}
    shape = Shape(seq_len=256, heads=4, kv_heads=2, head_dim=16, documents=20)
    full_rate = set()
    for (_, n), r in rows.items():
        flops = shape.flops(False, r["doc_unit"])
        assert flops == 4 * 4 * 16 * brute_pairs(256, (20,), r["doc_unit"], True, None)
        assert r["tflops_per_gpu"] == pytest.approx(flops / n / (r["slowest_ms"] / 1e3) / 1e12)
        assert r["efficiency"] == pytest.approx(r["ideal_ms"] / r["slowest_ms"])
        full_rate.add(round(flops / (r["ideal_ms"] * n / 1e3) / 1e12, 12))   # the one kernel's full-mask rate
    assert len(full_rate) == 1 and report["attention_tflops"] == pytest.approx(full_rate.pop())
    assert all(r["plan_ms"] > 0 for r in rows.values())


@pytest.mark.parametrize("backend,calls,sq,sk", [(Backend.ZIGZAG, 4, 64, 64), (Backend.ALLGATHER, 1, 64, 256),
                                                 (Backend.ULYSSES, 1, 256, 256)])
def test_plan_ms_plans_what_each_ring_rank_plans_with_fresh_caches(monkeypatch, backend, calls, sq, sk):
    """The backends' own planning functions, for every rank of the ring (Ulysses': one rank, the whole sequence),
    each rank starting from empty caches (a new batch): its first plan misses as many times as every other's."""
    from ctx_plugin.bench.planning import plan_ms
    from ctx_plugin.core import block_calls, layouts
    seen, real = [], block_calls.plan_calls

    def spy(kernel, blocks, mask, q_rows, k_rows, batch):
        seen.append((q_rows, k_rows, batch, mask.documents is not None, layouts._document_plan.cache_info().misses))
        return real(kernel, blocks, mask, q_rows, k_rows, batch)
    monkeypatch.setattr(block_calls, "plan_calls", spy)
    shape = Shape(seq_len=256, heads=4, kv_heads=2, head_dim=16, documents=20, batch=2)
    config = ctx_plugin.CPConfig(backend=backend)
    assert plan_ms(shape, config, 4) > 0
    ring = 1 if backend == Backend.ULYSSES else 4
    # an untimed warm-up of the first rank, then every rank
    assert len(seen) == (ring + 1) * calls and {s[:4] for s in seen} == {(sq, sk, 2, True)}
    if backend == Backend.ZIGZAG:
        firsts = [seen[(r + 1) * calls][4] for r in range(ring)]
        assert firsts[0] > 0 and len(set(firsts)) == 1, firsts
    seen.clear()
    plan_ms(shape, config, 4, ring_ranks=(0,))
    assert len(seen) == 2 * calls
    with pytest.raises(ValueError, match="has none"):
        plan_ms(Shape(seq_len=256, heads=4, kv_heads=2, head_dim=16), config, 4)


def test_cli_packed_with_a_window_memory_and_lengths_from_a_file(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("40 8  # two documents\n100\n")
    out = tmp_path / "packed.json"
    assert main(["bench", "--smoke", "--passes", "fwd", "--backends", "striped", "--doc-lengths", str(lengths),
                 "--window", "16", "--memory", "--json", str(out)]) == 0
    assert "3 document lengths (mean 49.3 tokens)" in capsys.readouterr().out
    for r in json.loads(out.read_text())["rows"]:
        assert r["vs_full"] > 0 and r["peak_mib"] > 0 and r["doc_unit"] == r["ranks"]


@pytest.mark.parametrize("flags,message", [
    (["--doc-len", "0"], "'0' is not a whole number of tokens ≥ 1"),
    (["--doc-len", "2.5"], "'2.5' is not a whole number of tokens"),
    (["--doc-len", "20", "--doc-lengths", "ZERO4"], "argument --doc-lengths: not allowed with argument --doc-len"),
    (["--doc-lengths", "/nonexistent/lengths"], "cannot read /nonexistent/lengths"),
    (["--doc-lengths", "ZERO"], "length 2 is 0, not a whole number of tokens ≥ 1")])
def test_cli_bad_document_flags(flags, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "ZERO").write_text("[4, 0]")
    (tmp_path / "ZERO4").write_text("4")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["bench", "--smoke", *flags])
    assert message in capsys.readouterr().err


def test_cli_plan_only(tmp_path, capsys):
    """No attention runs: any length on any machine; every backend's plan ms, the kernel and whether its varlen
    calls are part of it."""
    out = tmp_path / "plan.json"
    assert main(["bench", "--plan-only", "--seq-len", "4k", "--ranks", "2", "4", "--doc-len", "100", "--kernel",
                 "torch", "--backends", "zigzag", "ulysses", "allgather", "--heads", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "plan only" in text and text.splitlines()[1].split() == ["backend", "N", "docs", "unit", "kernel",
                                                                    "varlen", "plan", "ms"]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["backend"], r["ranks"]) for r in rows] == [(b, n) for n in (2, 4) for b in ("zigzag", "ulysses",
                                                                                           "allgather")]
    assert all(r["plan_ms"] > 0 and r["kernel"] == "torch" and r["varlen"] for r in rows)
    assert {(r["backend"], r["ranks"]): r["doc_unit"] for r in rows} == {
        ("zigzag", 2): 4, ("ulysses", 2): 1, ("allgather", 2): 4, ("zigzag", 4): 8, ("ulysses", 4): 1,
        ("allgather", 4): 8}


@pytest.mark.parametrize("flags,message", [
    (["--plan-only"], "add --doc-len or --doc-lengths"),
    (["--plan-only", "--doc-len", "20", "--memory"], "--memory does not apply to --plan-only"),
    (["--plan-only", "--doc-len", "20", "--distributed"], "--distributed does not apply to --plan-only")])
def test_cli_plan_only_refusals(flags, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", *flags])
    assert stop.value.code == 2 and message in capsys.readouterr().err
