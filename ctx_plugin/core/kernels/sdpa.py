"""torch's fused attention entry points (cuDNN and FlashAttention-2 on CUDA, blockwise flash on CPU), called
through their aten ops
because ring attention needs the log-sum-exp in forward and a backward that takes the merged out/lse.

All ops take ``[B, H, S, D]`` views of our ``[B, S, H, D]`` tensors. **GQA**: every op here takes K/V with fewer
heads than Q (query head ``h`` reads K/V head ``h // (H / Hkv)``, ``repeat_interleave``'s order) and returns dK/dV
with K's heads, so GQA K/V are never copied (``native_gqa``): torch's CPU flash kernel (checked here: identical to
the expanded call, its CPU decomposition sets ``enable_gqa`` from the head counts), its CUDA flash ops
(FlashAttention-2's ``mha_fwd``/``mha_bwd`` take ``num_heads % num_heads_k == 0``; SDPA's ``enable_gqa`` hands them
unexpanded K/V since torch 2.5) and, from torch 2.8 on, cuDNN's (SDPA's ``enable_gqa`` routes to it unexpanded
since pytorch#149976; with older torch the K/V heads of each block are expanded for the call and their gradients
summed back). torch 2.13's meta kernels give all of them dK/dV with K's heads. One exception: a varlen call whose
longest query sequence is 1 row gets expanded K/V, because FlashAttention-2 then swaps query heads into the
sequence dimension, which assumes every sequence has exactly one row (fillers break that). The CUDA behaviour is
checked by ``tests/gpu`` (GQA and MQA shapes, P >= 2 layouts).

Their ``is_causal`` is aligned top-left, so a causal block with more keys than queries (bottom-right, see base.py;
the all-gather backend's query chunks against their prefix) runs as a full block over the leading keys plus a
square causal block, merged in one pass into the first block's output (:func:`_merge_pair`: no fp32 copy of
either output, no copy back).

**Layouts handed to the ops.** The ring and all-gather loops pass sequence slices (zigzag halves, striped
``q[1:]``/``k[:-1]``, K/V views into the packed ``[2, B, S, H, D]`` buffer), whose batch stride is that of the
whole buffer. torch's own ``scaled_dot_product_attention`` hands cuDNN the ``[B, H, S, D]`` transpose of a
freshly allocated ``[B, S, H, D]`` tensor (strides ``(S·H·D, D, H·D, 1)``, the only unpacked layout torch's
``check_cudnn_layout`` accepted), and cuDNN has returned wrong results on other strides before: its graph cache
is keyed by q/k/v strides only, not by those of out and grad_out, and cuDNN < 9.5.1 assumed grad_out has out's
strides. So the cuDNN kernel passes q, k, v, out and grad_out in exactly that layout: a view when the elements
already sit that way (a slice of a batch-1 tensor: only the batch stride is rewritten, no copy), else one copy
of the slice. torch's flash kernel reads batch/sequence/head strides itself (its backward makes out and
grad_out contiguous on its own), so it, like the CPU kernel, only needs a unit stride in the last dimension.

**Varlen** (:class:`FlashKernel` only): many blocks of one step in one call (:mod:`.varlen`), through the same
``aten::_flash_attention_forward/_backward`` with ``cum_seq_q/k`` (int32 cumulative boundaries), ``[T, H, D]``
tensors and an fp32 LSE ``[H, Tq]`` (torch's meta kernel says so).

**Windows** (:class:`FlashKernel` only): a block whose mask has a bounded side runs on the lower-level
``aten::_flash_attention_forward/_backward`` (the ops ``_scaled_dot_product_flash_attention`` wraps: ``[B, S, H,
D]`` tensors, ``cum_seq_q/k`` None and ``max_q/k`` = Sq/Sk for a dense batch, fp32 LSE ``[B, H, Sq]``, outputs
``(out, lse, rng_state, unused, debug_mask)``) with ``window_size_left/right``, FlashAttention-2's bottom-right
local mask (query a sees keys ``a + Sk − Sq − left .. a + Sk − Sq + right``, -1 unbounded), the convention of
base.py. FlashAttention-2 treats a side ``>= Sk`` as unbounded and gives an unbounded right side next to a bounded
left one the value Sk; both are exact whenever ``Sq <= Sk + 1``: the rare non-causal block with more queries than
that whose window bounds its left side, or its right side at ``>= Sk``, runs on the torch kernel
(:func:`.base.fa2_window`); varlen calls get a ``max_seqlen_k`` of at least ``max_q − 1`` there
(:func:`.base.fa2_max_seqlen_k`). No softcap: refused.
The kernels' own masks (FlashAttention-2's, is_causal included) are bottom-right aligned for Sq != Sk (torch's SDPA
refuses non-square causal flash calls for that reason), so a windowed block is one call whatever its shape; the
``prefix`` windowed cases of ``tests/gpu/test_kernels_gpu.py`` check that on a GPU (not run yet).

Checked on torch 2.13 (schemas, meta kernels) and against torch's ``sdp_utils.cpp`` (hardware, dtype and head
size checks: :mod:`.sdpa_support`); the CUDA behaviour is covered by
``tests/gpu``.
"""
from __future__ import annotations

import functools

import torch

from .base import FULL, Window, accum_dtype, check_block, fa2_max_seqlen_k, fa2_window, is_windowed
from .head_chunks import by_head_chunks, fa2_head_chunk
from .torch_math import TorchKernel
from .varlen import Varlen



def _merge_pair(out0: torch.Tensor, lse0: torch.Tensor, out1: torch.Tensor,
                lse1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial results of the same rows over disjoint keys, each row having keys in both (so no −inf LSE),
    merged in place into ``out0``: ``out0 + w·(out1 − out0)`` with ``w = exp(lse1 − lse) = sigmoid(lse1 − lse0)``,
    one elementwise pass (``lerp_``, computed in fp32 for half inputs) that reads both outputs once and writes
    ``out0`` in its own dtype. The weight is rounded to the outputs' dtype (``lerp`` takes no fp32 weight for half
    tensors): a relative change of at most 2^-9 in bf16, the size of the output's own rounding."""
    weight = torch.sigmoid(lse1 - lse0)
    out0.lerp_(out1, weight.transpose(1, 2).unsqueeze(-1).to(out0.dtype))
    return out0, torch.logaddexp(lse0, lse1)


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=2)


def _reduce_kv(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, s, h, d = dx.shape
    return dx.reshape(b, s, h // groups, groups, d).sum(3)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _last_dim_unit(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dense_bshd(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``[B, S, H, D]``) with the strides of a freshly allocated tensor of its shape: a view when its
    elements already sit that way (only the strides of size-1 dimensions differ), else a contiguous copy."""
    if not x.is_contiguous():
        return x.contiguous()
    strides, step = [], 1
    for size in reversed(x.shape):
        strides.insert(0, step)
        step *= size
    return x if x.stride() == tuple(strides) else x.as_strided(x.shape, strides, x.storage_offset())


class _SdpaKernel:
    """Shared GQA handling and layouts; subclasses call the aten forward/backward ops."""

    name = ""
    native_gqa = True
    """Whether the ops take K/V with fewer heads than Q (and return dK/dV with K's heads) themselves; else the
    K/V heads of each block are expanded for the call and their gradients summed back."""
    dense = False
    """Whether the op needs freshly-allocated layouts (:func:`dense_bshd`), not only a unit last stride."""

    def _layout(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``[B, S, H, D]``) as the op needs it, returned as its ``[B, H, S, D]`` view."""
        return _bhsd(dense_bshd(x) if self.dense else _last_dim_unit(x))

    def _plain_only(self, q, k, causal: bool, window: Window, softcap: float | None) -> None:
        """These aten ops take no window or softcap (``select_kernel`` never picks them for such masks)."""
        check_block(q, k, causal, window, softcap)
        if is_windowed(window) or softcap is not None:
            raise ValueError(f"kernel {self.name!r} applies neither sliding windows nor softcap (window={window}, "
                             f"softcap={softcap}): use kernel='auto', 'torch' or 'flash_attn'")

    def forward(self, q, k, v, *, causal: bool, scale: float, window: Window = FULL, softcap: float | None = None):
        self._plain_only(q, k, causal, window, softcap)
        lead = k.shape[1] - q.shape[1]
        if causal and lead:
            return _merge_pair(*self._block_forward(q, k[:, :lead], v[:, :lead], False, scale),
                               *self._block_forward(q, k[:, lead:], v[:, lead:], True, scale))
        return self._block_forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, window: Window = FULL,
                 softcap: float | None = None):
        self._plain_only(q, k, causal, window, softcap)
        lead = k.shape[1] - q.shape[1]
        if causal and lead:
            dq, dk0, dv0 = self._block_backward(dout, q, k[:, :lead], v[:, :lead], out, lse, False, scale)
            dq1, dk1, dv1 = self._block_backward(dout, q, k[:, lead:], v[:, lead:], out, lse, True, scale)
            return dq.to(accum_dtype(q.dtype)).add_(dq1), torch.cat((dk0, dk1), 1), torch.cat((dv0, dv1), 1)
        return self._block_backward(dout, q, k, v, out, lse, causal, scale)

    def _groups(self, q: torch.Tensor, k: torch.Tensor) -> int:
        """How many times each K/V head is expanded for the op: 1 when it takes GQA itself."""
        return 1 if self.native_gqa else q.shape[2] // k.shape[2]

    def _block_forward(self, q, k, v, causal: bool, scale: float):
        g = self._groups(q, k)
        out, lse = self._fwd(*(self._layout(t) for t in (q, _expand_kv(k, g), _expand_kv(v, g))), causal, scale)
        return _bhsd(out), lse.reshape(lse.shape[:3]).to(accum_dtype(q.dtype))

    def _block_backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        g = self._groups(q, k)
        tensors = (dout.to(q.dtype), q, _expand_kv(k, g), _expand_kv(v, g), out.to(q.dtype))
        dq, dk, dv = self._bwd(*(self._layout(t) for t in tensors), lse.to(accum_dtype(q.dtype)).contiguous(),
                               causal, scale)
        return _bhsd(dq), _reduce_kv(_bhsd(dk), g), _reduce_kv(_bhsd(dv), g)


@functools.cache
def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (major, minor)


class CudnnKernel(_SdpaKernel):
    name = "sdpa_cudnn"
    dense = True

    @property
    def native_gqa(self) -> bool:       # torch < 2.8 did not route SDPA's GQA to cuDNN (see the module docstring)
        return _torch_at_least(2, 8)

    def _fwd(self, q, k, v, causal, scale):
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                  scale=scale)
        return res[0], res[1]                                   # lse: [B, H, S, 1]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # unused: no dropout
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), seed, seed, None, None, None, q.shape[2], k.shape[2], 0.0,
            causal, scale=scale)


class FlashKernel(_SdpaKernel):
    """torch's FlashAttention-2; windowed blocks through ``aten::_flash_attention_forward/_backward``."""

    name = "sdpa_flash"

    def _check(self, q, k, causal: bool, window: Window, softcap: float | None):
        check_block(q, k, causal, window, softcap)
        if softcap is not None:
            raise ValueError(f"kernel {self.name!r} applies no softcap (softcap={softcap}): use kernel='auto', "
                             f"'torch' or 'flash_attn'")
        try:
            sides = fa2_window(q.shape[1], k.shape[1], causal, window)
        except LookupError:
            return "torch"
        if sides is None:
            return None
        return (-1 if sides[0] is None else sides[0]), (0 if causal else -1 if sides[1] is None else sides[1])

    def forward(self, q, k, v, *, causal: bool, scale: float, window: Window = FULL, softcap: float | None = None):
        sides = self._check(q, k, causal, window, softcap)
        if sides is None:
            return super().forward(q, k, v, causal=causal, scale=scale)
        if sides == "torch":
            return TorchKernel().forward(q, k, v, causal=causal, scale=scale, window=window)
        g = self._groups(q, k)
        res = torch.ops.aten._flash_attention_forward(
            *(_last_dim_unit(t) for t in (q, _expand_kv(k, g), _expand_kv(v, g))), None, None, q.shape[1],
            k.shape[1], 0.0, causal, False, scale=scale, window_size_left=sides[0], window_size_right=sides[1])
        return res[0], res[1].to(accum_dtype(q.dtype))            # out [B, S, H, D], lse [B, H, S] fp32

    def backward(self, dout, q, k, v, out, lse, *, causal: bool, scale: float, window: Window = FULL,
                 softcap: float | None = None):
        chunk = fa2_head_chunk(q.shape[1], q.shape[2], k.shape[2], q.shape[3], batch=q.shape[0])
        if chunk is not None:       # int32 offsets of the dQ accumulator would wrap (head_chunks)
            return by_head_chunks(lambda *t: self.backward(*t, causal=causal, scale=scale, window=window,
                                                           softcap=softcap), chunk, dout, q, k, v, out, lse,
                                  head_dim=2, lse_head_dim=1)
        sides = self._check(q, k, causal, window, softcap)
        if sides is None:
            return super().backward(dout, q, k, v, out, lse, causal=causal, scale=scale)
        if sides == "torch":
            return TorchKernel().backward(dout, q, k, v, out, lse, causal=causal, scale=scale, window=window)
        g = self._groups(q, k)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # unused: no dropout
        tensors = (dout.to(q.dtype), q, _expand_kv(k, g), _expand_kv(v, g), out.to(q.dtype))
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            *(_last_dim_unit(t) for t in tensors), lse.to(torch.float32).contiguous(), None, None, q.shape[1],
            k.shape[1], 0.0, causal, seed, seed, scale=scale, window_size_left=sides[0],
            window_size_right=sides[1])
        return dq, _reduce_kv(dk, g), _reduce_kv(dv, g)

    def _varlen_args(self, q, k, v, batch: Varlen, softcap: float | None):
        if softcap is not None:
            raise ValueError(f"kernel {self.name!r} applies no softcap (softcap={softcap}): use kernel='auto', "
                             f"'torch' or 'flash_attn'")
        if batch.window[1] is not None and not batch.causal:
            raise ValueError(f"varlen calls take windows with an unbounded right side, got {batch.window} "
                             f"(ctx_plugin.core.kernels.varlen.chains never builds one)")
        # [T, H, D], GQA K/V as they are, but for max_seqlen_q == 1: equal head counts keep FlashAttention-2's
        # decoding shortcut off there (it assumes one row per sequence, which fillers break).
        g = q.shape[1] // k.shape[1] if batch.max_q == 1 else 1
        k, v = (_expand_kv(t[None], g)[0] for t in (k, v))
        cu_q, cu_k = batch.cu_seqlens(q.device)
        left = -1 if batch.window[0] is None else int(batch.window[0])  # >= Sk reads as unbounded: exact (left)
        sides = {"window_size_left": left, "window_size_right": 0 if batch.causal else -1}
        max_k = fa2_max_seqlen_k(batch.max_q, batch.max_k, batch.causal, batch.window)
        args = (cu_q, cu_k, batch.max_q, max_k, 0.0, batch.causal)
        return g, (_last_dim_unit(k), _last_dim_unit(v)), args, sides

    def forward_varlen(self, q, k, v, batch: Varlen, *, scale: float, softcap: float | None = None):
        """One ``aten::_flash_attention_forward`` call over every sequence of ``batch`` (``cum_seq_q/k``: the
        varlen path, ``[T, H, D]`` tensors, LSE ``[H, Tq]`` fp32). FlashAttention-2 gives rows without keys output
        0 and LSE +inf (its early exit in ``flash_fwd_kernel.h``); the contract wants −inf."""
        _, kv, args, sides = self._varlen_args(q, k, v, batch, softcap)
        res = torch.ops.aten._flash_attention_forward(_last_dim_unit(q), *kv, *args, False, scale=scale, **sides)
        lse = res[1].masked_fill(torch.isposinf(res[1]), float("-inf"))
        return res[0], lse.to(accum_dtype(q.dtype))

    def backward_varlen(self, dout, q, k, v, out, lse, batch: Varlen, *, scale: float,
                        softcap: float | None = None):
        """``aten::_flash_attention_backward`` over ``batch``: dq of rows without keys is 0 (FlashAttention-2
        accumulates dq into zeros), dk/dv of keys without rows 0 (its backward's early exit writes them)."""
        chunk = fa2_head_chunk(q.shape[0], q.shape[1], k.shape[1], q.shape[2], sequences=len(batch.seqs))
        if chunk is not None:       # int32 offsets of the dQ accumulator would wrap (head_chunks)
            return by_head_chunks(lambda *t: self.backward_varlen(*t, batch, scale=scale, softcap=softcap), chunk,
                                  dout, q, k, v, out, lse, head_dim=1, lse_head_dim=0)
        g, kv, args, sides = self._varlen_args(q, k, v, batch, softcap)
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # unused: no dropout
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            _last_dim_unit(dout.to(q.dtype)), _last_dim_unit(q), *kv, _last_dim_unit(out.to(q.dtype)),
            lse.to(torch.float32).contiguous(), *args, seed, seed, scale=scale, **sides)
        return dq, _reduce_kv(dk[None], g)[0], _reduce_kv(dv[None], g)[0]

    def _fwd(self, q, k, v, causal, scale):
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1]                                   # lse: [B, H, S]

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        seed = torch.zeros((), dtype=torch.int64, device=q.device)   # unused: no dropout
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, seed, scale=scale)


class CpuFlashKernel(_SdpaKernel):
    name = "sdpa_cpu"

    def _fwd(self, q, k, v, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)

    def _bwd(self, dout, q, k, v, out, lse, causal, scale):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0,
                                                                                   causal, scale=scale)
