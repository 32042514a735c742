"""The benchmark's memory column (``ctx-plugin bench --memory``, ctx_plugin/bench/memory.py): bytes allocated, copied
and held at the peak per rank and call, checked against byte counts worked out by hand (CPU: the allocator reports
exactly what was asked for), and the local copies the sdpa kernels no longer make."""
from __future__ import annotations

import json
import os

import pytest
import torch

import ctx_plugin
import ctx_plugin.core.api
from ctx_plugin.bench import memory
from ctx_plugin.bench.harness import Shape, attention_step
from ctx_plugin.bench.memory import CallBytes, call_bytes, memory_columns, rank_bytes, single_device_bytes
from ctx_plugin.bench.simulated import SILENT, simulated_groups
from ctx_plugin.cli import main
from ctx_plugin.core.kernels.sdpa import CpuFlashKernel
from ctx_plugin.names import Kernel

CPU = torch.device("cpu")


def test_call_bytes_counts_allocations_copies_and_the_peak_exactly():
    def call():
        a = torch.empty(1000)                     # 4000 B allocated, nothing written
        b = a.clone()                             # + 4000 B allocated and copied (live 8000)
        c = b.to(torch.float64)                   # + 8000 B allocated and copied (live 16000: the peak)
        del a, c                                  # live 4000
        d = torch.cat((b, b))                     # + 8000 B allocated and copied (live 12000)
        b.mul_(b)                                 # arithmetic: neither allocated nor copied
        d[:1000].copy_(b)                         # 4000 B copied into a view: no allocation
        return d                                  # dropped by call_bytes: freed

    assert call_bytes(call, CPU) == CallBytes(allocated=24000, copied=24000, peak=16000)


def test_fills_and_scatters_count_what_they_write():
    src, index = torch.ones(10), torch.arange(10)

    def call():
        e = torch.zeros(250)                      # 1000 B allocated and filled
        e.index_copy_(0, index, src)              # writes 10 floats: 40 B
        f = torch.full((50,), 2.0, dtype=torch.float64)   # 400 B allocated and filled
        f[:5].fill_(1.0)                          # fill_ of a 5-element view: 40 B
        return e, f

    assert call_bytes(call, CPU) == CallBytes(allocated=1400, copied=1480, peak=1400)


def test_what_was_alive_before_the_call_is_not_counted():
    held = [torch.empty(500)]                     # 2000 B from before the call

    def call():
        held.pop()                                # its release does not lower the call's own peak
        a = torch.empty(1000)
        return a.clone()                          # 4000 B + 4000 B, both alive at once

    assert call_bytes(call, CPU) == CallBytes(allocated=8000, copied=4000, peak=8000)


def test_memory_columns_arithmetic():
    """Bound = one-device peak / N + two K/V blocks of one rank; the columns take the largest rank."""
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    kv = 2 * 16 * 2 * 8 * 4                       # N = 4: one rank's K and V, 16 tokens × 2 heads × 8, fp32: 2048 B
    single = CallBytes(allocated=0, copied=0, peak=40960)
    ranks = [CallBytes(allocated=9000, copied=100, peak=10240), CallBytes(allocated=8000, copied=300, peak=16384),
             CallBytes(allocated=7000, copied=200, peak=1024), CallBytes(allocated=100, copied=0, peak=0)]
    cols = memory_columns(shape, 4, single, ranks)
    mib = 2 ** 20
    assert cols["kv_block_mib"] == kv / mib
    assert cols["bound_mib"] == (40960 / 4 + 2 * kv) / mib            # 14336 B
    assert (cols["alloc_mib"], cols["copied_mib"], cols["peak_mib"]) == (9000 / mib, 300 / mib, 16384 / mib)
    assert cols["peak_vs_bound"] == 16384 / 14336
    assert cols["rank_peak_mib"] == [10240 / mib, 16384 / mib, 1024 / mib, 0.0]
    assert cols["single_peak_mib"] == 40960 / mib


class _KnownKernel:
    """A stand-in local kernel whose allocations are known: forward fills out and lse, backward returns an
    uninitialised dq and copies of k and v."""

    name = "known"

    def forward(self, q, k, v, *, causal, scale, window=(None, None), softcap=None):
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, window=(None, None), softcap=None):
        return torch.empty_like(q), k.clone(), v.clone()


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_single_device_call_with_a_kernel_of_known_sizes(monkeypatch, backward):
    monkeypatch.setattr(memory, "select_kernel", lambda *args: _KnownKernel())
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    q_b, kv_b, lse_b = 64 * 4 * 8 * 4, 64 * 2 * 8 * 4, 4 * 64 * 4         # 8192, 4096, 1024 B
    got = single_device_bytes(shape, Kernel.AUTO, backward)
    if backward:      # out, lse, then dq, dk, dv alive together; dk and dv are copies
        assert got == CallBytes(allocated=q_b + lse_b + q_b + 2 * kv_b, copied=q_b + lse_b + 2 * kv_b,
                                peak=q_b + lse_b + q_b + 2 * kv_b)
    else:
        assert got == CallBytes(allocated=q_b + lse_b, copied=q_b + lse_b, peak=q_b + lse_b)


def test_rank_bytes_measures_one_call_after_the_warm_up():
    """Each rank's numbers are those of one call of its own step (grads of the warm-up dropped first): the same
    as measuring that step by hand. The backward leaves q/k/v.grad alive, so they are in the peak."""
    shape = Shape(seq_len=64, heads=4, kv_heads=2, head_dim=8, dtype=torch.float32)
    cfg = ctx_plugin.CPConfig(backend="zigzag", kernel="torch")
    got = rank_bytes(shape, cfg, 2, True)
    assert len(got) == 2
    for rank, measured in enumerate(got):
        groups = simulated_groups(cfg, rank, 2, SILENT, "cpu")
        q, k, v, dout = shape.tensors(32, torch.Generator().manual_seed(rank), grad=True)
        step = attention_step(shape, cfg, groups, q, k, v, dout, True)
        step()
        for t in (q, k, v):
            t.grad = None
        assert call_bytes(step, CPU) == measured
        grads = 32 * 4 * 8 * 4 + 2 * 32 * 2 * 8 * 4          # q.grad, k.grad, v.grad (fp32): 4096 + 4096 B
        assert measured.peak >= grads and measured.allocated >= measured.peak and measured.copied > 0


def _qkv(batch, sq, sk, heads, kv_heads, dim, dtype):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, sq, heads, dim, generator=g).to(dtype),
            torch.randn(batch, sk, kv_heads, dim, generator=g).to(dtype),
            torch.randn(batch, sk, kv_heads, dim, generator=g).to(dtype),
            torch.randn(batch, sq, heads, dim, generator=g).to(dtype))


def test_sdpa_cpu_takes_gqa_kv_without_copying_them():
    """torch's CPU flash kernel takes K/V with fewer heads: no repeat_interleave (it copied 2·B·S·H·D elements per
    block, forward and again in backward), and the result is the expanded call's."""
    kernel = CpuFlashKernel()
    q, k, v, dout = _qkv(2, 32, 32, 8, 2, 16, torch.float32)
    kw = {"causal": True, "scale": 0.25}
    assert call_bytes(lambda: kernel.forward(q, k, v, **kw), CPU).copied == 0
    out, lse = kernel.forward(q, k, v, **kw)
    assert not lse.is_contiguous()      # the CPU op's LSE: the backward makes it contiguous (B·H·Sq fp32) ...
    assert call_bytes(lambda: kernel.backward(dout, q, k, v, out, lse, **kw), CPU).copied == 2 * 8 * 32 * 4
    lse = lse.contiguous()              # ... and copies nothing else
    assert call_bytes(lambda: kernel.backward(dout, q, k, v, out, lse, **kw), CPU).copied == 0
    want_out, want_lse = kernel.forward(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), **kw)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, **kw)
    wq, wk, wv = kernel.backward(dout, q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), out, lse, **kw)
    assert dk.shape == k.shape and dv.shape == v.shape
    torch.testing.assert_close(dq, wq)
    torch.testing.assert_close(dk, wk.unflatten(2, (2, 4)).sum(3))
    torch.testing.assert_close(dv, wv.unflatten(2, (2, 4)).sum(3))


def test_a_query_chunk_against_its_prefix_merges_without_fp32_copies():
    """The all-gather backend's call (causal, more keys than queries: a full block plus a square causal one).
    Forward, bf16: the only copy is the merge weight in bf16, B·H·Sq elements (it was out to fp32 and back, the
    block output to fp32, the LSE, and the GQA K/V: 1 171 456 B here). Backward: dq of the two parts summed in fp32
    (one fp32 copy, B·Sq·H·D) and the two parts of dK and dV concatenated (B·Sk·Hkv·D each)."""
    kernel = CpuFlashKernel()
    b, sq, sk, h, hkv, d = 2, 32, 96, 8, 2, 16
    q, k, v, dout = _qkv(b, sq, sk, h, hkv, d, torch.bfloat16)
    kw = {"causal": True, "scale": 0.25}
    assert call_bytes(lambda: kernel.forward(q, k, v, **kw), CPU).copied == b * h * sq * 2
    out, lse = kernel.forward(q, k, v, **kw)
    lse_c = lse.contiguous()            # (a non-contiguous LSE is also made contiguous, once per part)
    assert call_bytes(lambda: kernel.backward(dout, q, k, v, out, lse_c, **kw), CPU).copied == \
        b * sq * h * d * 4 + 2 * b * sk * hkv * d * 2
    ref = ctx_plugin.core.kernels.torch_math.TorchKernel()
    want_out, want_lse = ref.forward(*(t.double() for t in (q, k, v)), **kw)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert ((out.double() - want_out).norm() / want_out.norm()).item() < 4e-3    # bf16 rounding: ~2.7e-3
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-4, rtol=0)


def test_quiet_kineto_passes_on_every_other_line(capfd):
    with memory._quiet_kineto():
        os.write(2, b"USDT:2026-12-02 04:38:13 4930:4930 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"ERROR:2026-12-02 04:38:13 4930:4930 DeviceProperties.cpp:50] gpuGetDeviceCount failed "
                    b"with code 35\n")
        os.write(2, b"a real warning\n")
    assert capfd.readouterr().err == "a real warning\n"


def test_cli_memory_columns(tmp_path, capsys, monkeypatch):
    """``--memory`` adds the columns; with the known-size kernel the one-device peak (and so the bound) is exact."""
    monkeypatch.setattr(memory, "select_kernel", lambda *args: _KnownKernel())
    monkeypatch.setattr(ctx_plugin.core.api, "select_kernel", lambda *args: _KnownKernel())
    out = tmp_path / "m.json"
    assert main(["bench", "--smoke", "--memory", "--passes", "fwd", "--backends", "ring", "allgather",
                 "--kernel", "torch", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "peak/bound" in printed and "bound = one-device peak ÷ N + 2 K/V blocks" in printed
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["ranks"]) for r in rows} == {("ring", 2), ("ring", 4), ("allgather", 2),
                                                          ("allgather", 4)}
    mib = 2 ** 20
    for r in rows:   # smoke: S = 256, 4 heads (2 K/V) × 16, fp32; the kernel: out and lse of the whole sequence
        n = 256 // r["ranks"]
        assert r["single_peak_mib"] == (256 * 4 * 16 * 4 + 4 * 256 * 4) / mib
        assert r["kv_block_mib"] == 2 * n * 2 * 16 * 4 / mib
        assert r["bound_mib"] == r["single_peak_mib"] / r["ranks"] + 2 * r["kv_block_mib"]
        assert r["peak_vs_bound"] == pytest.approx(r["peak_mib"] / r["bound_mib"])
        assert len(r["rank_peak_mib"]) == r["ranks"] and r["peak_mib"] == max(r["rank_peak_mib"])
        assert r["alloc_mib"] == max(r["rank_alloc_mib"]) and r["copied_mib"] == max(r["rank_copied_mib"])
        assert 0 < r["peak_mib"] <= r["alloc_mib"]
    line = next(x for x in printed.splitlines() if x.startswith("ring ") and " 2 fwd" in x).split()
    assert float(line[-1]) == pytest.approx(rows[0]["peak_vs_bound"], abs=0.005)


def test_memory_is_for_simulated_ranks_only(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--smoke", "--distributed", "--memory"])
    assert "--memory does not apply to --distributed (it measures simulated ranks)" in capsys.readouterr().err


@pytest.mark.parametrize("block_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_merge_makes_no_out_sized_temporaries_of_its_own(block_dtype):
    """merge_into_torch (the ring's merge off CUDA): the [B, H, S] weights only (25·B·H·S bytes: logaddexp, isneginf,
    masked_fill, two differences, two exps), and the LSE written back (B·H·S fp32). It used to add an fp32 copy of
    the block output and their product (2·B·S·H·D·4 bytes); a bf16 block is still widened inside addcmul_."""
    from ctx_plugin.core.merge import merge_into_torch
    b, s, h, d = 2, 16, 4, 32
    g = torch.Generator().manual_seed(0)
    out, block = torch.randn(b, s, h, d, generator=g), torch.randn(b, s, h, d, generator=g).to(block_dtype)
    lse, block_lse = torch.randn(b, h, s, generator=g), torch.randn(b, h, s, generator=g)
    widened = b * s * h * d * 4 if block_dtype != torch.float32 else 0
    got = call_bytes(lambda: merge_into_torch(out, lse, block, block_lse), CPU)
    assert (got.allocated, got.copied) == (25 * b * h * s + widened, 4 * b * h * s)
