"""flash-attn's varlen entry points behind the varlen kernel interface
(``ctx_plugin/core/kernels/flash_attn_varlen.py``), run on CPU against the stand-ins of
``test_flash_attn_adapter.py``: FlashAttention-2's ``_flash_attn_varlen_*`` (2.6.0, 2.7/2.8 custom ops) and FA3's functions with cu_seqlens (c082294, 01afd16d custom ops), each with the real
signature and the real contract (fp16/bf16 only, rows without keys +inf (FA2) / −inf (FA3), rows past
max_seqlen_q and memory outside every sequence left unwritten, the lse read as raw fp32 ``[H, Tq]`` memory).
Checked against ``test_varlen.reference`` (float64, dense masked formulas), per-sequence ``tests.reference`` for
softcap, and whole simulated runs with packed documents against ``tests.reference.documents_with_grads``."""
from __future__ import annotations

import sys

import pytest
import torch

import ctx_plugin
from ctx_plugin.core.block_calls import plan_calls
from ctx_plugin.core.blocks import Block
from ctx_plugin.core.documents import Documents
from ctx_plugin.core.kernels import flash_attn as fa
from ctx_plugin.core.kernels.varlen import has_varlen, pack
from ctx_plugin.core.mask import Mask
from ctx_plugin.names import Backend, Kernel
from tests.reference import dense_scores, dense_with_grads, rel_err
from tests.unit.test_flash_attn_adapter import FA22, VERSIONS, _fresh_probe, _hide_all, _install  # noqa: F401
from tests.unit.test_varlen import _call, _tensors, check_packed_run, reference

BY_LABEL = {v.label: v for v in VERSIONS}
VARLEN = ["2.6.0", "2.7-custom-op", "fa3-c082294", "fa3-custom-op"]
NO_VARLEN = {"2.2": "2.6.0", "2.5": "2.6.0", "fa3-beta": "2024", "fa3-2024": "2024"}
MASKS = pytest.mark.parametrize("causal,window", [(True, (None, None)), (False, (None, None)), (True, (2, None))],
                                ids=["causal", "full", "causal-window"])
HEADS = pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
SCALE = 0.3


@pytest.fixture(params=VARLEN)
def build(request, monkeypatch):
    _hide_all(monkeypatch)
    _install(monkeypatch, BY_LABEL[request.param])
    return BY_LABEL[request.param]


def _kernel():
    return fa.FlashAttnKernel(torch.device("cpu"))


def _check_call(kern, call, tq, h, want, tol=1e-2, grad_tol=2e-2):
    out, lse = kern.forward_varlen(*h[:3], call, scale=SCALE)
    assert out.dtype == h[0].dtype and out.shape == h[0].shape
    assert lse.dtype == torch.float32 and lse.shape == (h[0].shape[1], tq)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want[1])) and not torch.isposinf(lse).any()
    assert torch.isneginf(lse).any() and not out[torch.isneginf(lse[0])].any()          # fillers: 0 / −inf
    assert rel_err(out, want[0]) < tol and (lse - want[1]).nan_to_num(0).abs().max() < 1e-5
    final_lse = want[1].float().T.contiguous().T               # a strided [H, Tq]: must reach the kernel contiguous
    grads = kern.backward_varlen(h[3], *h[:3], want[0].to(h[0].dtype), final_lse, call, scale=SCALE)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert got.shape == ref.shape and rel_err(got, ref) < grad_tol, f"{name}: {rel_err(got, ref):.2e}"


@MASKS
@HEADS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_varlen_call_matches_the_float64_reference(build, causal, window, kv_heads, dtype):
    """Two samples, three blocks each, fillers of both kinds (rows without keys, keys without rows)."""
    call, tq, tk = _call(causal, window)
    h = _tensors(tq, tk, 4, kv_heads, dtype, seed=kv_heads + 3 * causal)
    kern = _kernel()
    assert has_varlen(kern) and kern.varlen_unavailable is None
    _check_call(kern, call, tq, h, reference(*h, call, SCALE), tol=2e-3 if dtype == torch.float16 else 1e-2,
                grad_tol=3e-3 if dtype == torch.float16 else 2e-2)


@HEADS
def test_one_row_sequences_with_fillers(build, kv_heads):
    """Every sequence has at most one row (max_seqlen_q 1) and a key-only filler has none: FlashAttention-2's
    seqlenq_ngroups_swapped reshape would fail on it with GQA, so the adapter passes max_seqlen_q >= 2."""
    blocks = (Block(slice(1, 2), slice(0, 3), True), Block(slice(3, 4), slice(5, 7), True))
    call = pack(blocks, 5, 8, 2)
    assert call.max_q == 1 and any(s[1] == s[0] for s in call.seqs)
    h = _tensors(10, 16, 4, kv_heads, torch.float16, seed=11)
    _check_call(_kernel(), call, 10, h, reference(*h, call, SCALE), tol=2e-3, grad_tol=3e-3)


def _softcap_reference(q, k, v, dout, call, softcap):
    """out, lse, dq, dk, dv in float64: ``tests.reference`` on every sequence with keys and rows on its own."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
    for q0, q1, k0, k1 in call.seqs.tolist():
        if q1 > q0 and k1 > k0:
            sl = [t[None, a:b] for t, (a, b) in zip((q, k, v, dout), ((q0, q1), (k0, k1), (k0, k1), (q0, q1)))]
            kw = dict(causal=call.causal, scale=SCALE, window=call.window, softcap=softcap)
            o, gq, gk, gv = dense_with_grads(*sl, **kw)
            out[q0:q1], dq[q0:q1], dk[k0:k1], dv[k0:k1] = o[0], gq[0], gk[0], gv[0]
            lse[:, q0:q1] = torch.logsumexp(dense_scores(*sl[:2], **kw), -1)[0]
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("causal,window", [(True, (None, None)), (True, (3, None)), (False, (2, None))],
                         ids=["causal", "causal-window", "full-left-window"])
def test_softcap_and_windows_reach_the_varlen_call(build, causal, window):
    call, tq, tk = _call(causal, window)
    h = _tensors(tq, tk, 4, 2, torch.float16, seed=5)
    kern = _kernel()
    out, lse = kern.forward_varlen(*h[:3], call, scale=SCALE, softcap=2.0)
    want = _softcap_reference(*h, call, 2.0)
    assert rel_err(out, want[0]) < 2e-3 and (lse - want[1]).nan_to_num(0).abs().max() < 1e-5
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want[1]))
    grads = kern.backward_varlen(h[3], *h[:3], want[0].half(), want[1].float(), call, scale=SCALE, softcap=2.0)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert rel_err(got, ref) < 3e-3, f"{name}: {rel_err(got, ref):.2e}"
    plain, _ = kern.forward_varlen(*h[:3], call, scale=SCALE)
    assert rel_err(plain, want[0]) > 1e-2                           # the softcap changed the result


def test_a_left_window_stays_exact_when_a_sequence_has_more_rows_than_keys(build):
    """Not causal, window (2, None), a sequence of 10 rows and 3 keys (the longest key sequence: 5): FlashAttention-2
    sets the unbounded right side to max_seqlen_k (the stand-ins do), which must reach every row's keys."""
    from ctx_plugin.core.kernels.varlen import Varlen

    call = Varlen(((0, 10, 0, 3), (10, 14, 3, 8)), False, (2, None), 2)
    h = _tensors(14, 8, 4, 2, torch.float16, seed=12)
    want = reference(*h, call, SCALE)
    kern = _kernel()
    out, lse = kern.forward_varlen(*h[:3], call, scale=SCALE)
    assert rel_err(out, want[0]) < 1e-2 and (lse - want[1]).abs().max() < 1e-5
    grads = kern.backward_varlen(h[3], *h[:3], want[0].half(), want[1].float(), call, scale=SCALE)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want[2:]):
        assert rel_err(got, ref) < 2e-2, f"{name}: {rel_err(got, ref):.2e}"


def test_varlen_calls_refuse_what_chains_never_build(build):
    call, tq, tk = _call(False, (None, None))
    h = _tensors(tq, tk, 4, 2, torch.float16, seed=1)
    kern = _kernel()
    right_bounded = type(call)(call.seqs, False, (2, 3), call.blocks)
    with pytest.raises(ValueError, match="unbounded right side"):
        kern.forward_varlen(*h[:3], right_bounded, scale=SCALE)
    with pytest.raises(ValueError, match="covers 40 rows"):
        kern.forward_varlen(h[0][:-1], *h[1:3], call, scale=SCALE)
    with pytest.raises(ValueError, match="softcap must be"):
        kern.forward_varlen(*h[:3], call, scale=SCALE, softcap=-1.0)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):                # the library's own dtype check
        kern.forward_varlen(*(t.float() for t in h[:3]), call, scale=SCALE)


@pytest.mark.parametrize("label", list(NO_VARLEN))
def test_builds_without_a_usable_varlen_entry_point_have_none(monkeypatch, label):
    """2.1-2.5 pad the varlen lse per sequence (2.5's stand-in has the real functions, which raise if called), the
    2024 FA3 builds are not bound: no forward_varlen, so block calls run one call per block."""
    _hide_all(monkeypatch)
    _install(monkeypatch, FA22 if label == "2.2" else BY_LABEL[label])
    kern = _kernel()
    assert not has_varlen(kern) and not hasattr(kern, "forward_varlen")
    assert NO_VARLEN[label] in kern.varlen_unavailable and "one kernel call per block" in kern.varlen_unavailable
    docs = Documents((0, 8, 16))
    blocks = (Block(slice(0, 8), slice(0, 8), True), Block(slice(8, 16), slice(8, 16), True))
    assert plan_calls(kern, blocks, Mask(True, documents=docs), 16, 16, 1) == (blocks, ())
    assert plan_calls(_varlen_kernel(monkeypatch), blocks, Mask(True, documents=docs), 16, 16, 1)[0] == ()


def _varlen_kernel(monkeypatch):
    _install(monkeypatch, BY_LABEL["2.7-custom-op"])
    fa.forget_probe()
    return _kernel()


def test_a_build_whose_varlen_signature_is_unknown_has_none(monkeypatch):
    def odd_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                       causal, window_size, softcap, alibi_slopes, return_softmax, block_table, new_thing):
        raise AssertionError("must not be called")

    _hide_all(monkeypatch)
    _install(monkeypatch, BY_LABEL["2.6.0"])
    monkeypatch.setattr(sys.modules["flash_attn.flash_attn_interface"], "_flash_attn_varlen_forward", odd_varlen_fwd)
    kern = _kernel()
    assert not has_varlen(kern) and "requires 'new_thing'" in kern.varlen_unavailable
    q, k, v, _ = (t[None] for t in _tensors(6, 6, 4, 2, torch.float16, seed=0))
    assert kern.forward(q, k, v, causal=True, scale=SCALE)[0].shape == q.shape     # the dense path still runs


# (build, backend, ranks, window): packed documents through whole simulated runs on the flash_attn kernel behind
# the stand-ins, its dense and varlen functions both.
RUNS = [("2.7-custom-op", Backend.ZIGZAG, 2, None), ("2.6.0", Backend.ALLGATHER, 2, None),
        ("fa3-custom-op", Backend.RING, 3, None), ("fa3-c082294", Backend.ULYSSES, 2, None),
        ("2.7-custom-op", Backend.ZIGZAG, 2, (5, 0))]


@pytest.mark.parametrize("label,backend,size,window", RUNS,
                         ids=[f"{lb}-{b.value}-{n}{'-window' if w else ''}" for lb, b, n, w in RUNS])
def test_simulated_runs_with_documents_on_the_flash_attn_kernel(monkeypatch, label, backend, size, window):
    _hide_all(monkeypatch)
    _install(monkeypatch, BY_LABEL[label])
    calls = []
    built = _kernel()
    varlen_fwd = built.forward_varlen
    built.forward_varlen = lambda *a, **kw: calls.append(a[3].blocks) or varlen_fwd(*a, **kw)

    def select(name, device, dtype, head_dim, features):         # flash_attn on CPU tensors, behind the stand-ins
        assert name == Kernel.FLASH_ATTN and features <= built.features
        return built
    monkeypatch.setattr(ctx_plugin.core.api, "select_kernel", select)
    check_packed_run("flash_attn", backend, size, window)
    assert calls and max(calls) >= 2          # the varlen path ran, with calls of several blocks


@HEADS
@MASKS
def test_flash_attention_2_varlen_backward_past_int32_offsets_runs_over_head_chunks(build, monkeypatch, kv_heads,
                                                                                   causal, window):
    """FlashAttention-2's varlen backward computes dQ offsets in int32 over all rows of the call plus 128 per
    sequence (ctx_plugin.core.kernels.head_chunks): with the limit lowered to fit 2 of 4 heads, it runs as two calls
    on head chunks with their K/V heads and gives the same gradients as one call; FlashAttention-3 runs as one."""
    import dataclasses

    import ctx_plugin.core.kernels.head_chunks as head_chunks

    call, tq, tk = _call(causal, window)
    h = _tensors(tq, tk, 4, kv_heads, torch.float16, seed=kv_heads + 3 * causal)
    kern = _kernel()
    out, lse = kern.forward_varlen(*h[:3], call, scale=SCALE)
    want = kern.backward_varlen(h[3], *h[:3], out, lse, call, scale=SCALE)
    calls = kern.backward_varlen.__self__
    real = calls._b.bwd
    heads = []
    monkeypatch.setattr(calls, "_b", dataclasses.replace(calls._b, bwd=lambda **kw: heads.append(kw["q"].shape[1])
                                                         or real(**kw)))
    monkeypatch.setattr(head_chunks, "INT32_LIMIT", (tq + 128 * len(call.seqs)) * 32 * 3)   # head size 16 → 32
    got = kern.backward_varlen(h[3], *h[:3], out, lse, call, scale=SCALE)
    assert heads == ([2, 2] if build.generation == 2 else [4])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_flash_attention_2_varlen_backward_at_scale_keeps_every_dq_offset_in_int32(monkeypatch):
    """528,384 rows in 64 sequences, 32 heads of 128 (the offsets of one call wrap), on meta tensors (shapes only):
    FlashAttention-2's varlen backward is called on head chunks whose offsets all fit, checked with the kernel's
    arithmetic emulated by tests/unit/test_head_chunks.py."""
    import dataclasses

    from tests.unit.test_head_chunks import AT_SCALE, _varlen_call, dq_offsets_wrap, meta_tensors

    _, seq_rows, heads, kv_heads, head_dim, _ = next(c for c in AT_SCALE if c[0] == "varlen-528384-rows")
    _hide_all(monkeypatch)
    _install(monkeypatch, BY_LABEL["2.7-custom-op"])
    kern = _kernel()
    calls = kern.backward_varlen.__self__
    per_call = []
    monkeypatch.setattr(calls, "_b", dataclasses.replace(calls._b, bwd=lambda **kw: per_call.append(kw["q"].shape[1])))
    tensors = meta_tensors(seq_rows, heads, kv_heads, head_dim, varlen=True)
    grads = kern.backward_varlen(*tensors, _varlen_call(seq_rows), scale=SCALE)
    assert [g.shape for g in grads] == [t.shape for t in tensors[1:4]]
    assert sum(per_call) == heads and len(per_call) > 1
    for size in set(per_call):
        assert not dq_offsets_wrap(seq_rows, size, head_dim, varlen=True), size
