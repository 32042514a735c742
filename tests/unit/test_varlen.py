"""Varlen calls (many blocks in one kernel call, ``ctx_plugin/core/kernels/varlen.py``): which blocks share a call, the
sequences a call is cut into, the varlen contract against an independent float64 reference (rows without keys: 0 and
−inf, keys without rows: no gradient), torch's flash kernel's varlen glue against a stand-in of
``aten::_flash_attention_forward/_backward``'s varlen path, and whole simulated runs on it with packed documents."""
from __future__ import annotations

import itertools

import pytest
import torch

import ctx_plugin
from ctx_plugin.bench.harness import simulated_outputs
from ctx_plugin.core.blocks import Block
from ctx_plugin.core.documents import Documents
from ctx_plugin.core.kernels import sdpa
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.core.kernels.varlen import Varlen, chains, has_varlen, pack
from ctx_plugin.core.layouts import Striped, Zigzag
from ctx_plugin.core.mask import Mask
from ctx_plugin.names import Backend
from tests.reference import documents_with_grads, rel_err
from tests.unit.test_sdpa_layouts import recorder  # noqa: F401  (fixture: the dense CUDA ops' stand-ins)

HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- an independent float64 reference of one call
def _keep(batch: Varlen, tq: int, tk: int) -> torch.Tensor:
    """``[Tq, Tk]``: row a of a sequence sees key b of the same sequence under its bottom-right causal/window."""
    keep = torch.zeros(tq, tk, dtype=torch.bool)
    left, right = batch.window
    for q0, q1, k0, k1 in batch.seqs.tolist():
        sq, sk = q1 - q0, k1 - k0
        for a in range(sq):
            for b in range(sk):
                last = a + sk - sq                           # the diagonal, bottom-right aligned
                ok = (b <= last if batch.causal else right is None or b <= last + right) and (
                    left is None or b >= last - left)
                keep[q0 + a, k0 + b] = ok
    return keep


def reference(q, k, v, dout, batch: Varlen, scale: float):
    """out ``[Tq, H, D]``, lse ``[H, Tq]``, dq, dk, dv in float64 from the dense masked formulas."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    g = q.shape[1] // k.shape[1]
    ke, ve = (t.repeat_interleave(g, dim=1) for t in (k, v))
    keep = _keep(batch, q.shape[0], k.shape[0])
    s = torch.einsum("qhd,khd->hqk", q, ke) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)                                          # [H, Tq], −inf for rows without keys
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None]).masked_fill(~keep, 0)
    out = torch.einsum("hqk,khd->qhd", p, ve)
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    dp = torch.einsum("qhd,khd->hqk", dout, ve)
    delta = (dout * out).sum(-1).T                                        # [H, Tq]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, ke) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    return out, lse, dq, _fold(dk, g), _fold(dv, g)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """``[T, H, D]`` per-query-head gradients summed onto the K/V heads (GQA: each K/V head serves ``groups``)."""
    return t.reshape(t.shape[0], -1, groups, t.shape[-1]).sum(2)


# ---------------------------------------------------------------- chains and sequences
def _plans():
    """Blocks of real plans with packed documents: every zigzag/striped step at 2-4 ranks, causal with and without
    a window, plus hand-made blocks that cannot share a call."""
    docs = Documents(tuple(itertools.accumulate([0, 8, 16, 24, 8, 40])))
    for layout, size, window in itertools.product((Zigzag(), Striped()), (2, 4), (None, (5, 0))):
        mask = Mask(True, window, documents=docs).within(96)
        for rank, source in itertools.product(range(size), repeat=2):
            yield layout.plan(rank, source, size, 96 // size, mask), 96 // size
    yield (Block(slice(0, 4), slice(0, 4), True), Block(slice(4, 8), slice(0, 4), True),     # keys shared
           Block(slice(8, 12), slice(8, 12), False, (2, 3)),                                 # right side bounded
           Block(slice(12, 16), slice(8, 12), False), Block(slice(12, 16), slice(12, 16), True)), 16


def test_chains_partition_the_blocks_into_calls_that_can_share_one():
    grouped = 0
    for blocks, n in _plans():
        singles, groups = chains(blocks)
        got = sorted((*singles, *itertools.chain(*groups)), key=repr)
        assert got == sorted(blocks, key=repr)                                # each block exactly once
        for c in groups:
            assert len(c) >= 2 and len({(b.causal, b.window) for b in c}) == 1
            assert all(b.causal or b.window[1] is None for b in c)
            for a, b in zip(c, c[1:]):                                         # disjoint, in order
                assert a.q.stop <= b.q.start and a.k.stop <= b.k.start
        grouped += sum(map(len, groups))
    assert grouped > 100                                                       # the plans do share calls
    singles, groups = chains(list(_plans())[-1][0])
    assert Block(slice(8, 12), slice(8, 12), False, (2, 3)) in singles and len(groups) == 1


@pytest.mark.parametrize("batch", [1, 3])
def test_pack_cuts_every_row_and_key_into_consecutive_sequences(batch):
    for blocks, n in _plans():
        for c in chains(blocks)[1]:
            call = pack(c, n, n, batch)
            seqs = [tuple(s) for s in call.seqs.tolist()]
            assert seqs[0][0] == 0 and seqs[0][2] == 0 and seqs[-1][1] == batch * n and seqs[-1][3] == batch * n
            assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(seqs, seqs[1:]))      # consecutive
            real = [s for s in seqs if s[1] > s[0] and s[3] > s[2]]
            want = [(i * n + b.q.start, i * n + b.q.stop, i * n + b.k.start, i * n + b.k.stop)
                    for i in range(batch) for b in c]
            assert real == want and call.blocks == len(want)                    # fillers have no rows or no keys
            cu_q, cu_k = call.cu_seqlens(torch.device("cpu"))
            assert cu_q.dtype == torch.int32 and cu_q.tolist() == [0, *(s[1] for s in seqs)]
            assert cu_k.tolist() == [0, *(s[3] for s in seqs)]
            assert call.max_q == max(s[1] - s[0] for s in seqs)


# ---------------------------------------------------------------- the contract, on the torch kernel
def _call(causal: bool, window=(None, None), batch: int = 2) -> tuple[Varlen, int, int]:
    """A chain with gaps in rows and keys (so fillers of both kinds) over ``batch`` samples of 20 rows / 24 keys."""
    blocks = (Block(slice(2, 6), slice(1, 7), causal, window), Block(slice(6, 9), slice(9, 12), causal, window),
              Block(slice(13, 18), slice(15, 22), causal, window))
    return pack(blocks, 20, 24, batch), 20 * batch, 24 * batch


def _tensors(tq, tk, heads, kv_heads, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda t, h: (torch.randn(t, h, 16, generator=g, dtype=torch.float64) * 1.5).to(dtype)   # noqa: E731
    return mk(tq, heads), mk(tk, kv_heads), mk(tk, kv_heads), mk(tq, heads)


@pytest.mark.parametrize("causal,window", [(True, (None, None)), (False, (None, None)), (True, (2, None))],
                         ids=["causal", "full", "causal-window"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_torch_kernel_keeps_the_varlen_contract(causal, window, kv_heads):
    call, tq, tk = _call(causal, window)
    q, k, v, dout = _tensors(tq, tk, 4, kv_heads, torch.float64, seed=kv_heads)
    want = reference(q, k, v, dout, call, 0.3)
    kern = TorchKernel()
    assert has_varlen(kern)
    out, lse = kern.forward_varlen(q, k, v, call, scale=0.3)
    assert lse.shape == (4, tq) and torch.equal(torch.isneginf(lse), torch.isneginf(want[1]))
    assert torch.isneginf(lse).any() and not out[torch.isneginf(lse[0])].any()        # fillers: 0 / −inf
    assert rel_err(out, want[0]) < 1e-12 and (lse - want[1]).nan_to_num(0).abs().max() < 1e-12
    grads = kern.backward_varlen(dout, q, k, v, want[0], want[1], call, scale=0.3)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert got.shape == ref.shape and rel_err(got, ref) < 1e-12, name


# ---------------------------------------------------------------- torch's flash kernel: the aten varlen path
def _raw_varlen_lse(lse: torch.Tensor, heads: int, total: int) -> torch.Tensor:
    """The LSE as the CUDA kernel reads it: contiguous float32 ``[H, Tq]`` from its data pointer."""
    raw = torch.empty(0, dtype=torch.float32)
    offset_bytes = lse.storage_offset() * lse.element_size()
    return raw.set_(lse.untyped_storage(), offset_bytes // 4, (heads, total), (total, 1))


class VarlenFlash:
    """Stand-ins for ``aten::_flash_attention_forward/_backward`` on their varlen path, keeping the real contract:
    fp16/bf16 ``[T, H, D]`` tensors with a unit last stride, K/V heads dividing Q's (GQA: query head ``h`` reads K/V
    head ``h // (H / Hkv)``, dK/dV returned with K's heads), but equal head counts when ``max_q == 1`` (the real op
    then swaps query heads into the sequence dimension, assuming one row per sequence), int32 ``cum_seq_q/k`` with
    ``max_q/max_k`` their longest sequences, window sides ints >= -1 (causal: right 0), an fp32 LSE ``[H, Tq]``
    returned with **+inf** for rows without keys and output 0 there (FlashAttention-2's early exit), and the LSE
    handed to backward read as raw contiguous fp32 ``[H, Tq]`` memory. ``max_k`` may exceed the longest key sequence
    (an upper bound); a bounded left side next to the unbounded right one of a non-causal call makes that right side
    ``max_k`` (FlashAttention-2's ``set_params_fprop``), which the stand-ins apply."""

    def __init__(self) -> None:
        self.calls = {"fwd": 0, "bwd": 0}
        self.kv_heads: list[int] = []

    def _batch(self, q, k, v, cum_q, cum_k, max_q, max_k, is_causal, left, right) -> Varlen:
        assert q.dtype in HALF and k.dtype == q.dtype == v.dtype
        assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v)) and k.shape == v.shape
        assert q.shape[1] % k.shape[1] == 0 and (max_q > 1 or q.shape[1] == k.shape[1])
        self.kv_heads.append(k.shape[1])
        assert cum_q.dtype == cum_k.dtype == torch.int32 and cum_q.numel() == cum_k.numel()
        cq, ck = cum_q.tolist(), cum_k.tolist()
        assert cq[0] == ck[0] == 0 and cq[-1] == q.shape[0] and ck[-1] == k.shape[0]
        seqs = tuple(zip(cq, cq[1:], ck, ck[1:]))
        assert max_q == max(b - a for a, b, _, _ in seqs) and max_k >= max(b - a for _, _, a, b in seqs)
        assert type(left) is int and type(right) is int and left >= -1 and right >= -1
        assert right == (0 if is_causal else -1), "chains carry no bounded right side"
        left = -1 if left >= max_k else left                        # mha_varlen_fwd, then set_params_fprop
        implied = max_k if left >= 0 and not is_causal else None
        return Varlen(seqs, is_causal, (None if left < 0 else left, implied), 0)

    def fwd(self, q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
            window_size_left, window_size_right):
        self.calls["fwd"] += 1
        assert dropout_p == 0.0 and not return_debug_mask and isinstance(scale, float)
        batch = self._batch(q, k, v, cum_q, cum_k, max_q, max_k, is_causal, window_size_left, window_size_right)
        out, lse, *_ = reference(q, k, v, torch.zeros_like(q), batch, scale)
        lse = lse.float().masked_fill(torch.isneginf(lse), float("inf"))            # FlashAttention-2's +inf
        return out.to(q.dtype), lse.contiguous(), torch.zeros(2, dtype=torch.uint64), None, None

    def bwd(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
            scale, window_size_left, window_size_right):
        self.calls["bwd"] += 1
        assert dropout_p == 0.0 and dout.dtype == out.dtype == q.dtype
        batch = self._batch(q, k, v, cum_q, cum_k, max_q, max_k, is_causal, window_size_left, window_size_right)
        raw = _raw_varlen_lse(lse, q.shape[1], q.shape[0]).double()
        # gradients from the LSE and out it is handed (as the kernel does), with the reference's mask
        keep = _keep(batch, q.shape[0], k.shape[0])
        g = q.shape[1] // k.shape[1]
        qd, dod, od = (t.double() for t in (q, dout, out))
        kd, vd = (t.double().repeat_interleave(g, dim=1) for t in (k, v))
        s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        p = torch.exp(s - raw.masked_fill(torch.isinf(raw), 0)[..., None]).masked_fill(~keep, 0)
        dv = torch.einsum("hqk,qhd->khd", p, dod)
        ds = p * (torch.einsum("qhd,khd->hqk", dod, vd) - (dod * od).sum(-1).T[..., None])
        return (torch.einsum("hqk,khd->qhd", ds, kd) * scale).to(q.dtype), \
            _fold(torch.einsum("hqk,qhd->khd", ds, qd) * scale, g).to(q.dtype), _fold(dv, g).to(q.dtype)


@pytest.fixture
def varlen_flash(monkeypatch):
    rec = VarlenFlash()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", rec.fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", rec.bwd)
    return rec


@pytest.mark.parametrize("causal,window", [(True, (None, None)), (False, (None, None)), (True, (2, None))],
                         ids=["causal", "full", "causal-window"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_flash_kernel_runs_a_varlen_call_on_the_flash_op(varlen_flash, causal, window, kv_heads):
    call, tq, tk = _call(causal, window)
    h = _tensors(tq, tk, 4, kv_heads, torch.bfloat16, seed=7 + kv_heads)
    want = reference(*h, call, 0.3)                        # of the same (bf16) inputs, in float64
    kern = sdpa.FlashKernel()
    assert has_varlen(kern)
    out, lse = kern.forward_varlen(*h[:3], call, scale=0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (4, tq)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want[1])) and not torch.isposinf(lse).any()
    assert rel_err(out, want[0]) < 1e-2 and (lse - want[1]).nan_to_num(0).abs().max() < 1e-5
    final_lse = want[1].float().T.contiguous().T                    # a strided [H, Tq]: must reach the op contiguous
    grads = kern.backward_varlen(h[3], *h[:3], want[0].to(torch.bfloat16), final_lse, call, scale=0.3)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert got.shape == ref.shape and rel_err(got, ref) < 2e-2, f"{name}: {rel_err(got, ref):.2e}"
    assert varlen_flash.calls == {"fwd": 1, "bwd": 1}
    assert varlen_flash.kv_heads == [kv_heads, kv_heads], "GQA K/V reach the op unexpanded"
    with pytest.raises(ValueError, match="applies no softcap"):
        kern.forward_varlen(*h[:3], call, scale=0.3, softcap=5.0)


def test_the_flash_kernel_keeps_a_left_window_exact_when_a_sequence_has_more_rows_than_keys(varlen_flash):
    """Not causal, window (2, None), a sequence of 10 rows and 3 keys where the longest key sequence holds 5:
    FlashAttention-2 sets the unbounded right side to max_seqlen_k, which would hide keys from that sequence's first
    rows, so the call passes a max_seqlen_k of at least max_q - 1 (an upper bound, as the op allows)."""
    call = Varlen(((0, 10, 0, 3), (10, 14, 3, 8)), False, (2, None), 2)
    h = _tensors(14, 8, 4, 2, torch.bfloat16, seed=11)
    want = reference(*h, call, 0.3)
    kern = sdpa.FlashKernel()
    out, lse = kern.forward_varlen(*h[:3], call, scale=0.3)
    grads = kern.backward_varlen(h[3], *h[:3], want[0].to(torch.bfloat16), want[1].float(), call, scale=0.3)
    assert rel_err(out, want[0]) < 1e-2 and (lse - want[1]).abs().max() < 1e-5
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert got.shape == ref.shape and rel_err(got, ref) < 2e-2, f"{name}: {rel_err(got, ref):.2e}"


def test_the_flash_kernel_expands_gqa_kv_for_one_row_sequences(varlen_flash):
    """max_seqlen_q == 1 with GQA: FlashAttention-2 would swap query heads into rows, assuming every sequence has
    one (the filler here has none), so the K/V reach the op expanded; the results are the reference's."""
    call = Varlen(((0, 1, 0, 5), (1, 2, 5, 9), (2, 2, 9, 12)), True, (None, None), 2)   # the last one: a filler
    h = _tensors(2, 12, 4, 2, torch.bfloat16, seed=3)
    want = reference(*h, call, 0.3)
    kern = sdpa.FlashKernel()
    out, lse = kern.forward_varlen(*h[:3], call, scale=0.3)
    grads = kern.backward_varlen(h[3], *h[:3], want[0].to(torch.bfloat16), want[1].float(), call, scale=0.3)
    assert varlen_flash.kv_heads == [4, 4]
    assert rel_err(out, want[0]) < 1e-2 and (lse - want[1]).abs().max() < 1e-5
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert got.shape == ref.shape and rel_err(got, ref) < 2e-2, f"{name}: {rel_err(got, ref):.2e}"


# (backend, ranks): packed documents through whole simulated runs on torch's flash kernel, its dense ops and its
# varlen op both behind stand-ins; documents of 4..24 tokens, several per rank.
RUNS = [(Backend.ZIGZAG, 2), (Backend.ALLGATHER, 2), (Backend.RING, 3), (Backend.ULYSSES, 2)]


def check_packed_run(kernel: str, backend: Backend, size: int, window=None) -> None:
    """A whole simulated fp16 run of ``size`` ranks with packed documents (4..24 tokens, several per rank; GQA) on
    ``kernel``, its outputs and gradients against the float64 per-document reference."""
    lengths = [8, 4, 12, 24] if size == 2 else [12, 6, 6, 24]
    docs = Documents(tuple(itertools.accumulate([0, *lengths])))
    g = torch.Generator().manual_seed(size)
    mk = lambda h: (torch.randn(2, 48, h, 16, generator=g, dtype=torch.float64) * 1.5)   # noqa: E731
    q, k, v, dout = mk(4), mk(2), mk(2), mk(4)
    cfg = ctx_plugin.CPConfig(backend=backend, kernel=kernel)
    got = simulated_outputs(cfg, size, *(t.to(torch.float16) for t in (q, k, v, dout)), causal=True, window=window,
                            documents=docs)
    want = documents_with_grads(q, k, v, dout, docs, causal=True, **({"window": window} if window else {}))
    for name, gt, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(gt, w) < 4e-3, f"{name}: {rel_err(gt, w):.2e}"


@pytest.mark.parametrize("backend,size", RUNS, ids=[f"{b.value}-{n}" for b, n in RUNS])
def test_simulated_runs_with_documents_on_the_flash_kernel(varlen_flash, recorder, backend, size):  # noqa: F811
    check_packed_run("sdpa_flash", backend, size)
    assert varlen_flash.calls["fwd"] > 0 and varlen_flash.calls["bwd"] > 0
