"""What torch's cuDNN and flash kernels receive at P >= 2: the strided sequence slices of the ring and all-gather
loops (zigzag halves, striped ``q[1:]``/``k[:-1]``, K/V views into the packed buffer) must reach the aten ops in
the layouts they accept.

No GPU here: the aten ops are replaced by recording stand-ins that check each argument's layout and dtype the
way the real op needs them (cuDNN: q/k/v/out/grad_out as the [B, H, S, D] transpose of a freshly allocated
[B, S, H, D] tensor; flash: a unit last stride, the LSE read as raw fp32 [B, H, S] memory, as FlashAttention-2
reads it), compute attention in float32 from the values (the LSE and out they are given, in backward), and
return outputs laid out as the real ops allocate them. The whole context-parallel attention then runs through
simulated ranks (threads exchanging real data) and is compared with a float64 dense reference.
"""
from __future__ import annotations

import pytest
import torch

import ctx_plugin
import ctx_plugin.core.api
from ctx_plugin.bench.harness import simulated_outputs
from ctx_plugin.core.kernels import sdpa
from ctx_plugin.core.kernels.torch_math import TorchKernel
from ctx_plugin.names import Backend, Kernel
from tests.reference import dense_with_grads, fa2_window_reading, rel_err

HALF = (torch.float16, torch.bfloat16)


def _canonical(t: torch.Tensor) -> bool:
    """The [B, H, S, D] transpose of a freshly allocated [B, S, H, D] tensor (check_cudnn_layout's layout)."""
    b, h, s, d = t.shape
    return t.stride() == (s * h * d, d, h * d, 1)


def _raw_lse(lse: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """``lse``'s memory read as a contiguous fp32 [B, H, S] array from its data pointer, as the CUDA kernels do."""
    raw = torch.empty(0, dtype=torch.float32)
    offset_bytes = lse.storage_offset() * lse.element_size()
    return raw.set_(lse.untyped_storage(), offset_bytes // 4, shape, (shape[1] * shape[2], shape[2], 1))


def _heads(q, t):
    """GQA K/V (or their gradients' layout) read per query head: query head h reads K/V head h // (H / Hkv)."""
    assert q.shape[1] % t.shape[1] == 0, f"K/V heads {t.shape[1]} must divide Q's {q.shape[1]}"
    return t.repeat_interleave(q.shape[1] // t.shape[1], dim=1)


def _fold(dt, t):
    """Per-query-head gradients summed back onto ``t``'s (K/V) heads, as the ops return them."""
    b, h, s, d = dt.shape
    return dt.reshape(b, t.shape[1], h // t.shape[1], s, d).sum(2)


def _scores(q, k, causal, scale):
    k = _heads(q, k)
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.float()) * scale
    if causal:      # torch's is_causal is top-left; the kernel only asks for square causal blocks
        assert q.shape[2] == k.shape[2], "a causal call must be square (torch refuses non-square causal)"
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), _heads(q, v).float()), lse


def _backward(do, q, k, v, o, lse, causal, scale):
    """Gradients from the given (merged) out and LSE, as the fused kernels compute them."""
    p = torch.exp(_scores(q, k, causal, scale) - lse[..., None])
    do32 = do.float()
    delta = (do32 * o.float()).sum(-1, keepdim=True)
    ds = p * (torch.einsum("bhqd,bhkd->bhqk", do32, _heads(q, v).float()) - delta)
    return (torch.einsum("bhqk,bhkd->bhqd", ds, _heads(q, k).float()) * scale,
            _fold(torch.einsum("bhqk,bhqd->bhkd", ds, q.float()) * scale, k),
            _fold(torch.einsum("bhqk,bhqd->bhkd", p, do32), v))


def _like(template: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` in a tensor allocated like the real ops allocate outputs (empty_like(q) keeps q's layout)."""
    return torch.empty_like(template).copy_(values)


class Recorder:
    """Stand-ins for the four aten ops; each checks its arguments' contract, then computes."""

    def __init__(self) -> None:
        self.calls = {"cudnn": 0, "cudnn_bwd": 0, "flash": 0, "flash_bwd": 0}
        self.kv_heads: set[int] = set()     # the K/V head counts the ops were handed

    @staticmethod
    def _half(*ts):
        assert all(t.dtype in HALF and t.dtype == ts[0].dtype for t in ts), [t.dtype for t in ts]

    def _kv(self, q, k, v):
        assert k.shape == v.shape and q.shape[1] % k.shape[1] == 0, (q.shape, k.shape, v.shape)
        self.kv_heads.add(k.shape[1])

    def cudnn(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale):
        self.calls["cudnn"] += 1
        self._half(q, k, v)
        self._kv(q, k, v)
        for name, t in zip("qkv", (q, k, v)):
            assert _canonical(t), f"cuDNN got {name} with strides {t.stride()} for shape {tuple(t.shape)}"
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        o, lse = _forward(q, k, v, is_causal, scale)
        seed = torch.zeros((), dtype=torch.int64)
        return _like(q, o), lse[..., None].contiguous(), None, None, q.shape[2], k.shape[2], seed, seed, None

    def cudnn_bwd(self, grad_out, q, k, v, out, logsumexp, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k,
                  dropout_p, is_causal, *, scale):
        self.calls["cudnn_bwd"] += 1
        self._half(grad_out, q, k, v, out)
        self._kv(q, k, v)
        for name, t in zip(("grad_out", "q", "k", "v", "out"), (grad_out, q, k, v, out)):
            assert _canonical(t), f"cuDNN backward got {name} with strides {t.stride()} for {tuple(t.shape)}"
        b, h, s, _ = q.shape
        assert logsumexp.dtype == torch.float32 and logsumexp.shape == (b, h, s, 1) and logsumexp.is_contiguous()
        assert (max_q, max_k, dropout_p) == (s, k.shape[2], 0.0)
        grads = _backward(grad_out, q, k, v, out, logsumexp[..., 0], is_causal, scale)
        return tuple(_like(t, g) for t, g in zip((q, k, v), grads))

    def flash(self, q, k, v, dropout_p, is_causal, return_debug_mask, *, scale):
        self.calls["flash"] += 1
        self._half(q, k, v)
        self._kv(q, k, v)
        assert all(t.stride(-1) == 1 for t in (q, k, v)) and dropout_p == 0.0 and not return_debug_mask
        o, lse = _forward(q, k, v, is_causal, scale)
        seed = torch.zeros((), dtype=torch.int64)
        return _like(q, o), lse.contiguous(), None, None, q.shape[2], k.shape[2], seed, seed, None

    def flash_bwd(self, grad_out, q, k, v, out, logsumexp, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                  seed, offset, *, scale):
        self.calls["flash_bwd"] += 1
        self._half(grad_out, q, k, v, out)
        self._kv(q, k, v)
        assert all(t.stride(-1) == 1 for t in (grad_out, q, k, v, out)) and dropout_p == 0.0
        lse = _raw_lse(logsumexp, tuple(q.shape[:3]))
        grads = _backward(grad_out, q, k, v, out, lse, is_causal, scale)
        return tuple(_like(t, g) for t, g in zip((q, k, v), grads))


KERNELS = {Kernel.SDPA_CUDNN: sdpa.CudnnKernel, Kernel.SDPA_FLASH: sdpa.FlashKernel}


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    for op, fn in (("_scaled_dot_product_cudnn_attention", rec.cudnn),
                   ("_scaled_dot_product_cudnn_attention_backward", rec.cudnn_bwd),
                   ("_scaled_dot_product_flash_attention", rec.flash),
                   ("_scaled_dot_product_flash_attention_backward", rec.flash_bwd)):
        monkeypatch.setattr(torch.ops.aten, op, fn)

    def select(name, device, dtype, head_dim, features):   # the CUDA kernels, on CPU tensors, behind the stand-ins
        assert not features, "these kernels apply no window or softcap"
        return KERNELS[name]()
    monkeypatch.setattr(ctx_plugin.core.api, "select_kernel", select)
    return rec


def _inputs(batch, seq, heads, kv_heads, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: (torch.randn(batch, seq, h, 16, generator=g, dtype=torch.float64) * 1.5).to(dtype)  # noqa: E731
    return mk(heads), mk(kv_heads), mk(kv_heads), mk(heads)


# (batch, kv heads, causal): batch 2 makes every sequence slice non-dense; K/V stay views into the packed buffer
# (GQA K/V too: the ops take them unexpanded); batch 1 slices are dense apart from their batch stride.
SHAPES = [(2, 4, True), (1, 2, True), (2, 2, False)]


@pytest.mark.parametrize("kernel", list(KERNELS), ids=lambda k: k.value)
@pytest.mark.parametrize("backend", [Backend.ZIGZAG, Backend.STRIPED, Backend.ALLGATHER, Backend.RING],
                         ids=lambda b: b.value)
@pytest.mark.parametrize("batch,kv_heads,causal", SHAPES, ids=["b2-mha-causal", "b1-gqa-causal", "b2-gqa-full"])
def test_simulated_ranks_hand_the_ops_their_layouts(recorder, kernel, backend, batch, kv_heads, causal):
    size = 3 if backend == Backend.RING else 2
    q, k, v, dout = _inputs(batch, 24, 4, kv_heads, torch.float16, seed=batch + kv_heads)
    cfg = ctx_plugin.CPConfig(backend=backend, kernel=kernel)
    got = simulated_outputs(cfg, size, q, k, v, dout, causal=causal)
    want = dense_with_grads(*(t.double() for t in (q, k, v, dout)), causal=causal)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float16 and g.shape == w.shape
        assert rel_err(g, w) < 4e-3, f"{name}: {rel_err(g, w):.2e}"
    prefix = "cudnn" if kernel == Kernel.SDPA_CUDNN else "flash"
    assert recorder.calls[prefix] > 0 and recorder.calls[prefix + "_bwd"] > 0
    assert recorder.kv_heads == {kv_heads if KERNELS[kernel]().native_gqa else 4}, "GQA K/V copied for the op"


def test_dense_bshd_copies_only_what_is_not_laid_out_densely():
    base = torch.randn(2, 10, 3, 8)
    assert sdpa.dense_bshd(base) is base
    one = torch.randn(1, 10, 3, 8)[:, 2:6]                # batch 1: a dense block with the whole tensor's strides
    view = sdpa.dense_bshd(one)
    assert view.data_ptr() == one.data_ptr() and view.stride() == (4 * 3 * 8, 24, 8, 1) and torch.equal(view, one)
    two = base[:, 2:6]                                    # batch 2: a gap between the batches
    copy = sdpa.dense_bshd(two)
    assert copy.data_ptr() != two.data_ptr() and copy.is_contiguous() and torch.equal(copy, two)
    assert _canonical(sdpa.dense_bshd(base[:, 1:, :, :]).transpose(1, 2))


# ---------------------------------------------------------------- sliding windows: aten::_flash_attention_*
def _flash_semantics(sq, sk, is_causal, left, right):
    """FlashAttention-2's reading of its window arguments (tests.reference.fa2_window_reading) as the torch kernel's
    (left, right), None for unbounded."""
    left, right = fa2_window_reading(left, right, is_causal, sk)
    return (None if left < 0 else left, None if right < 0 else right)


class WindowedFlash:
    """Stand-ins for ``aten::_flash_attention_forward/_backward`` keeping the real contract: fp16/bf16 ``[B, S, H,
    D]`` tensors with a unit last stride and K/V heads dividing Q's (GQA), no cum_seq (a dense batch) with max_q/max_k the
    sequence lengths, int window sides >= -1, fp32 LSE ``[B, H, S]`` read as raw memory; they compute with the
    torch reference kernel (bottom-right aligned, like FlashAttention-2)."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, int, int, int, bool]] = []
        self.kv_heads: set[int] = set()
        self.calls = {"fwd": 0, "bwd": 0}

    def _check(self, q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale, left, right):
        Recorder._half(q, k, v)
        assert all(t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v))
        assert q.shape[0] == k.shape[0] and q.shape[2] % k.shape[2] == 0 and k.shape == v.shape
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[1], k.shape[1])
        assert dropout_p == 0.0 and isinstance(is_causal, bool) and isinstance(scale, float)
        for side in (left, right):
            assert type(side) is int and side >= -1, f"window sides are ints >= -1 (got {left!r}, {right!r})"
        self.windows.append((q.shape[1], k.shape[1], left, right, is_causal))
        self.kv_heads.add(k.shape[2])
        return _flash_semantics(q.shape[1], k.shape[1], is_causal, left, right)

    def fwd(self, q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
            window_size_left, window_size_right):
        self.calls["fwd"] += 1
        assert not return_debug_mask
        window = self._check(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale,
                             window_size_left, window_size_right)
        out, lse = TorchKernel().forward(q.float(), k.float(), v.float(), causal=is_causal, scale=scale,
                                         window=window)
        rng = torch.zeros(2, dtype=torch.uint64)
        return (_like(q, out.to(q.dtype)), lse.contiguous(), rng, torch.zeros((), dtype=torch.uint64),
                torch.empty(0, dtype=q.dtype))

    def bwd(self, grad_out, q, k, v, out, logsumexp, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, rng_state,
            unused, *, scale, window_size_left, window_size_right):
        self.calls["bwd"] += 1
        Recorder._half(grad_out, out, q)
        assert grad_out.shape == out.shape == q.shape and all(t.stride(-1) == 1 for t in (grad_out, out))
        assert isinstance(rng_state, torch.Tensor) and isinstance(unused, torch.Tensor)
        window = self._check(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale,
                             window_size_left, window_size_right)
        assert logsumexp.dtype == torch.float32
        lse = _raw_lse(logsumexp, (q.shape[0], q.shape[2], q.shape[1]))
        grads = TorchKernel().backward(grad_out.float(), q.float(), k.float(), v.float(), out.float(), lse,
                                       causal=is_causal, scale=scale, window=window)
        return tuple(_like(t, g.to(t.dtype)) for t, g in zip((q, k, v), grads))


@pytest.fixture
def windowed(monkeypatch):
    rec = WindowedFlash()
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", rec.fwd)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", rec.bwd)
    return rec


# (Sq, Sk, causal, window): left-only, left+right, right-only, a diagonal-only window, windows reaching past the
# block, more keys than queries (bottom-right alignment) and fewer.
WINDOW_CASES = [
    (16, 16, True, (3, 0)), (16, 16, True, (0, 0)), (16, 16, False, (2, 5)), (16, 16, False, (None, 1)),
    (16, 16, False, (4, None)), (8, 24, True, (5, None)), (8, 24, False, (9, 3)), (12, 8, False, (3, 6)),
    (16, 16, True, (14, 0)), (12, 12, False, (0, 0)), (10, 16, False, (0, 6)),
]


@pytest.mark.parametrize("sq,sk,causal,window", WINDOW_CASES, ids=str)
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flash_kernel_applies_windows_through_the_flash_ops(windowed, sq, sk, causal, window, kv_heads):
    g = torch.Generator().manual_seed(sq * 31 + sk)
    mk = lambda s, h: (torch.randn(2, s, h, 16, generator=g, dtype=torch.float64) * 1.5)   # noqa: E731
    q, k, v, dout = mk(sq, 4), mk(sk, kv_heads), mk(sk, kv_heads), mk(sq, 4)
    ref = TorchKernel()
    want_out, want_lse = ref.forward(q, k, v, causal=causal, scale=0.25, window=window)
    want = ref.backward(dout, q, k, v, want_out, want_lse, causal=causal, scale=0.25, window=window)
    kern = sdpa.FlashKernel()
    h = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    out, lse = kern.forward(*h[:3], causal=causal, scale=0.25, window=window)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (2, 4, sq)
    assert rel_err(out, want_out) < 2e-2 and (lse - want_lse).abs().max() < 2e-2
    grads = kern.backward(h[3], *h[:3], want_out.to(torch.bfloat16), want_lse.float(), causal=causal, scale=0.25,
                          window=window)
    for name, got, ref_grad, t in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        err = (got.double() - ref_grad).abs().max().item() / max(ref_grad.abs().max().item(), 1.0)  # dq ~ 0 at (0, 0)
        assert got.shape == t.shape and err < 3e-2, f"{name}: {err:.2e}"
    assert windowed.calls == {"fwd": 1, "bwd": 1} and windowed.kv_heads == {kv_heads}, "GQA K/V copied for the op"


def test_flash_kernel_runs_unbounded_windows_on_the_plain_ops_and_refuses_softcap(windowed, recorder):
    q = torch.randn(1, 16, 2, 16, dtype=torch.float16)
    kern = sdpa.FlashKernel()
    for causal, window in ((True, (None, 3)), (True, (15, 0)), (False, (None, None)), (False, (15, 40))):
        out, lse = kern.forward(q, q, q, causal=causal, scale=0.25, window=window)
        want, _ = TorchKernel().forward(q.double(), q.double(), q.double(), causal=causal, scale=0.25)
        assert rel_err(out, want) < 4e-3
    assert windowed.calls["fwd"] == 0 and recorder.calls["flash"] == 4
    with pytest.raises(ValueError, match="applies no softcap"):
        kern.forward(q, q, q, causal=True, scale=0.25, window=(3, 0), softcap=30.0)


def test_flash_kernel_takes_the_torch_kernel_where_flash_would_unbound_the_right_side(windowed):
    """Sq = 24 > Sk + 1 = 9, right = 10 >= Sk: FlashAttention-2 would read the side as unbounded although the first
    rows see only some keys."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, s, 2, 16, generator=g).to(torch.float16) for s in (24, 8))
    out, _ = sdpa.FlashKernel().forward(q, k, k, causal=False, scale=0.25, window=(2, 10))
    want, _ = TorchKernel().forward(q.double(), k.double(), k.double(), causal=False, scale=0.25, window=(2, 10))
    assert rel_err(out, want) < 4e-3 and windowed.calls["fwd"] == 0


@pytest.mark.parametrize("backend,size", [(Backend.RING, 3), (Backend.ZIGZAG, 2), (Backend.ALLGATHER, 2),
                                          (Backend.STRIPED, 2)], ids=lambda x: getattr(x, "value", x))
@pytest.mark.parametrize("causal,window", [(True, (5, 0)), (False, (3, 7))], ids=["causal-5", "both-3-7"])
def test_simulated_ranks_with_windows_on_the_flash_kernel(windowed, recorder, monkeypatch, backend, size, causal,
                                                          window):
    def select(name, device, dtype, head_dim, features):
        assert features == frozenset({"window"})
        return sdpa.FlashKernel()
    monkeypatch.setattr(ctx_plugin.core.api, "select_kernel", select)
    q, k, v, dout = _inputs(2, 24, 4, 2, torch.float16, seed=7)
    cfg = ctx_plugin.CPConfig(backend=backend, kernel=Kernel.SDPA_FLASH)
    got = simulated_outputs(cfg, size, q, k, v, dout, causal=causal, window=window)
    want = dense_with_grads(*(t.double() for t in (q, k, v, dout)), causal=causal, window=window)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float16 and rel_err(g, w) < 5e-3, f"{name}: {rel_err(g, w):.2e}"
    assert windowed.calls["fwd"] > 0 and windowed.calls["bwd"] > 0


def test_fa2_window_is_what_flashattention2_applies_or_a_lookup_error():
    """For every small block shape and window: the sides fa2_window passes, read as FlashAttention-2 reads them
    (_flash_semantics: flash_api.cpp), keep exactly the keys the window keeps; where no sides can, LookupError —
    and then only for non-causal blocks with Sq > Sk + 1."""
    from ctx_plugin.core.kernels.base import fa2_window, keep_mask

    sides = [None, 0, 1, 2, 3, 5, 8]
    refused = 0
    for sq in range(1, 9):
        for sk in range(1, 9):
            for causal in (False, True):
                for window in ((a, b) for a in sides for b in sides):
                    if causal and window[1] is not None:
                        continue
                    want = keep_mask(sq, sk, causal, window, torch.device("cpu"))
                    want = torch.ones(sq, sk, dtype=torch.bool) if want is None else want
                    try:
                        passed = fa2_window(sq, sk, causal, window)
                    except LookupError:
                        refused += 1
                        assert not causal and sq > sk + 1, (sq, sk, causal, window)
                        continue
                    left, right = (-1, 0 if causal else -1) if passed is None else (
                        -1 if passed[0] is None else passed[0], 0 if causal else -1 if passed[1] is None else passed[1])
                    got = keep_mask(sq, sk, causal, _flash_semantics(sq, sk, causal, left, right),
                                    torch.device("cpu"))
                    got = torch.ones(sq, sk, dtype=torch.bool) if got is None else got
                    assert torch.equal(got, want), (sq, sk, causal, window, passed)
    assert refused > 0


def test_flash_kernel_takes_the_torch_kernel_where_flash_would_bound_the_unbounded_right_side(windowed):
    """Sq = 24 > Sk + 1 = 9, window (2, None), not causal: FlashAttention-2 would set the right side to Sk, which
    hides keys from the first rows; the torch kernel runs the block."""
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, s, 2, 16, generator=g).to(torch.float16) for s in (24, 8))
    out, lse = sdpa.FlashKernel().forward(q, k, k, causal=False, scale=0.25, window=(2, None))
    want, _ = TorchKernel().forward(q.double(), k.double(), k.double(), causal=False, scale=0.25, window=(2, None))
    assert rel_err(out, want) < 4e-3 and windowed.calls["fwd"] == 0
    grads = sdpa.FlashKernel().backward(q, q, k, k, out, lse, causal=False, scale=0.25, window=(2, None))
    assert all(g.shape == t.shape for g, t in zip(grads, (q, k, k))) and windowed.calls["bwd"] == 0
