"""The flash-attn adapter, run on CPU against stand-ins of real flash-attn versions.

Each stand-in module has the exact ``_flash_attn_forward``/``_flash_attn_backward`` signatures and return
arities of a real version (see the adapter's docstring for the sources); the custom-op versions are real
``torch.library.custom_op`` objects, like the ones flash-attn >= 2.7 and recent FA3 register. They compute
attention in float32 torch math and their backward uses only (dout, q, k, v, out, lse), as flash-attn does, and
they keep the real contract: float16/bfloat16 inputs only (anything else raises, as flash_api.cpp does), out and
dout in q's dtype, a float32 lse returned as ``[b, h, s]``, and the lse handed to backward read from its data
pointer as raw contiguous float32 ``[b, h, s]`` memory (FlashAttention checks neither its dtype nor its strides),
so an adapter that passes a half-precision or strided lse gets wrong numbers, as it would on a GPU.

The varlen stand-ins (FlashAttention-2's ``_flash_attn_varlen_*`` of 2.5.9 (never to be bound), 2.6.0 and 2.7.4,
FA3's functions with ``cu_seqlens_q/k``; used by ``test_flash_attn_varlen.py``) keep the varlen contract of the
real kernels (``ctx_plugin/core/kernels/flash_attn_varlen.py`` names the sources): cu_seqlens int32 and in bounds, an
fp32 lse ``[H, total_q]`` with +inf (FA2) / −inf (FA3) for rows of a sequence without keys, dq 0 there and
dk = dv = 0 for keys of a sequence without rows, only the first ``max_seqlen_q`` rows (``max_seqlen_k`` keys in
backward) of each sequence written and everything no sequence covers left as NaN (torch.empty), FA2's
``seqlenq_ngroups_swapped`` reshape failing as the real one does, and the lse read back as raw ``[H, total_q]``.
"""
import functools
import subprocess
from pathlib import Path
import sys
import types
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import pytest
import torch

from ctx_plugin.core.kernels import flash_attn as fa
from tests.reference import fa2_window_reading, rel_err

NAMES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_interface", "flash_attn_3",
         "flash_attn_3.flash_attn_interface")
TOL = 2e-3        # norm-wise, float16 outputs and gradients against the float64 reference of the same inputs
LSE_TOL = 1e-5    # absolute: the lse is float32 throughout
HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- math shared by every stand-in
def _require(*tensors: torch.Tensor) -> None:
    if tensors[0].dtype not in HALF:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    for t in tensors:
        if t.dtype != tensors[0].dtype:
            raise RuntimeError("query and key must have the same dtype")
        if t.stride(-1) != 1:
            raise RuntimeError("Input tensor must have contiguous last dimension")


def _raw_lse(lse: torch.Tensor, shape) -> torch.Tensor:
    """The lse as the CUDA kernels read it: float32 ``[b, h, s]`` from its data pointer, whatever its dtype/strides."""
    raw = torch.empty(0, dtype=torch.float32)
    offset_bytes = lse.storage_offset() * lse.element_size()
    return raw.set_(lse.untyped_storage(), offset_bytes // 4, shape, (shape[1] * shape[2], shape[2], 1))


def _scores(q, k, scale, causal, window=(-1, -1), softcap=0.0):
    """float32 scores, capped (``softcap`` > 0) then masked like flash-attn >= 2.1 and FA3: causal and window
    aligned bottom-right, query row a sees key b iff a + sk − sq − left <= b <= a + sk − sq + right, -1 = unbounded.
    Returns (masked capped scores, tanh(s / softcap) or None)."""
    q, k = q.float(), k.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    sq, sk = q.shape[1], k.shape[1]
    diff = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= diff <= 0
    left, right = window
    if left >= 0:
        keep &= diff >= -left
    if right >= 0:
        keep &= diff <= right
    return s.masked_fill(~keep, float("-inf")), t


def _fa2_reading(window, causal, seqlen_k):
    return fa2_window_reading(*window, causal, seqlen_k)


def _fwd_math(q, k, v, scale, causal, window=(-1, -1), softcap=0.0, dropout_p=0.0):
    _require(q, k, v)
    if dropout_p != 0.0:
        raise AssertionError("the adapter must not ask for dropout")
    s, _ = _scores(q, k, scale, causal, tuple(window), softcap)
    lse = torch.logsumexp(s, dim=-1)
    vx = v.float().repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vx)
    return out.to(q.dtype), lse                                               # lse: float32 [B, H, Sq]


def _grads(dout, q, k, v, out, lse, scale, causal, window, softcap):
    """float32 (dq, dk, dv, softmax_d) from (dout, q, k, v, out) and the float32 lse ``[B, H, Sq]`` handed over,
    as flash-attn computes them (no recomputation of the lse)."""
    g = q.shape[2] // k.shape[2]
    s, t = _scores(q, k, scale, causal, tuple(window), softcap)
    p = torch.exp(s - lse[..., None])
    q, k, v, dout, out = (t_.float() for t_ in (q, k, v, dout, out))
    kx, vx = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    d = (dout * out).sum(-1).transpose(1, 2)                                  # [B, H, Sq]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, vx) - d[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    b, sk, hk, hd = k.shape
    return (torch.einsum("bhqk,bkhd->bqhd", ds, kx) * scale,
            (torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale).reshape(b, sk, hk, g, hd).sum(3),
            torch.einsum("bhqk,bqhd->bkhd", p, dout).reshape(b, sk, hk, g, hd).sum(3), d)


def _check_buffers(q, k, v, dq, dk, dv):
    if dq is None or dk is None or dv is None:
        raise AssertionError("gradient buffers must be preallocated")
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype


def _bwd_math(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window=(-1, -1), softcap=0.0):
    """Writes dq/dk/dv in place from (dout, q, k, v, out, lse) and returns softmax_d, like flash-attn."""
    _require(q, k, v, dout, out)
    _check_buffers(q, k, v, dq, dk, dv)
    raw = _raw_lse(lse, (q.shape[0], q.shape[2], q.shape[1]))
    gq, gk, gv, d = _grads(dout, q, k, v, out, raw, scale, causal, window, softcap)
    dq.copy_(gq)
    dk.copy_(gk)
    dv.copy_(gv)
    return d


# ---------------------------------------------------------------- varlen: many sequences in one call
def _sequences(cu_q, cu_k, tq, tk):
    """The sequences a kernel reads from ``cu_seqlens`` (flash_api.cpp checks int32, contiguous, b + 1 entries
    each; it checks no value: rows or keys outside the tensors would be an illegal memory access)."""
    for cu in (cu_q, cu_k):
        if cu.dtype != torch.int32:
            raise RuntimeError("cu_seqlens_q must have dtype int32")
        if cu.dim() != 1 or not cu.is_contiguous():
            raise RuntimeError("cu_seqlens_q must be contiguous")
    if cu_q.numel() != cu_k.numel() or cu_q.numel() < 2:
        raise RuntimeError("cu_seqlens_k must have shape (batch_size + 1)")
    cq, ck = cu_q.tolist(), cu_k.tolist()
    seqs = list(zip(cq, cq[1:], ck, ck[1:]))
    assert all(0 <= a <= b <= tq and 0 <= c <= d <= tk for a, b, c, d in seqs), f"illegal memory access: {seqs}"
    return seqs


def _raw_varlen_lse(lse: torch.Tensor, heads: int, total: int) -> torch.Tensor:
    """The varlen lse as the kernels read it: float32 ``[H, total_q]`` from its data pointer."""
    raw = torch.empty(0, dtype=torch.float32)
    offset_bytes = lse.storage_offset() * lse.element_size()
    return raw.set_(lse.untyped_storage(), offset_bytes // 4, (heads, total), (total, 1))


def _varlen_fwd_math(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, *, dropout_p=0.0,
                     fa2=True):
    """out ``[Tq, H, D]`` and float32 lse ``[H, Tq]`` as flash-attn's varlen forward writes them: each sequence
    masked bottom-right on its own; rows of a sequence without keys get out 0 and lse +inf (FlashAttention-2's
    early exit) or −inf (FA3's store_zero); only the first ``max_seqlen_q`` rows of each sequence are written
    (the launch grid), the rest of the (torch.empty) outputs stays garbage (NaN here). FlashAttention-2's
    ``seqlenq_ngroups_swapped`` reshape (max_seqlen_q 1, fewer K/V heads, no window) fails unless every sequence
    has exactly one row, as torch's reshape does there."""
    _require(q, k, v)
    if dropout_p != 0.0:
        raise AssertionError("the adapter must not ask for dropout")
    assert all(type(x) is int for x in (max_q, max_k, *window)), "sizes and window sides are ints"
    tq, h, d = q.shape
    seqs = _sequences(cu_q, cu_k, tq, k.shape[0])
    if fa2 and max_q == 1 and h > k.shape[1] and window[0] < 0 and window[1] < 0 and tq != len(seqs):
        raise RuntimeError(f"shape '[{len(seqs)}, {k.shape[1]}, {h // k.shape[1]}, {d}]' is invalid for input of "
                           f"size {q.numel()}")
    window = _fa2_reading(window, causal, max_k) if fa2 else window
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full((h, tq), float("nan"), dtype=torch.float32)
    for q0, q1, k0, k1 in seqs:
        rows = min(q1 - q0, max_q)
        if rows <= 0:
            continue
        if k1 == k0:
            out[q0:q0 + rows], lse[:, q0:q0 + rows] = 0, float("inf") if fa2 else float("-inf")
            continue
        o, l_ = _fwd_math(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, causal, window, softcap)
        out[q0:q0 + rows], lse[:, q0:q0 + rows] = o[0, :rows], l_[0, :, :rows]
    return out, lse


def _varlen_bwd_math(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal, window,
                     softcap, *, dropout_p=0.0, fa2=True):
    """Writes dq/dk/dv like flash-attn's varlen backward, from the lse read as raw float32 ``[H, Tq]`` memory:
    dq 0 for rows of a sequence without keys, dk = dv = 0 for keys of a sequence without rows; rows past
    ``max_seqlen_q`` / keys past ``max_seqlen_k`` of a sequence are not written (garbage, NaN here)."""
    _require(q, k, v, dout, out)
    _check_buffers(q, k, v, dq, dk, dv)
    if dropout_p != 0.0:
        raise AssertionError("the adapter must not ask for dropout")
    assert all(type(x) is int for x in (max_q, max_k, *window)), "sizes and window sides are ints"
    window = _fa2_reading(window, causal, max_k) if fa2 else window
    tq, h, _ = q.shape
    seqs = _sequences(cu_q, cu_k, tq, k.shape[0])
    raw = _raw_varlen_lse(lse, h, tq)
    for buf in (dq, dk, dv):
        buf.fill_(float("nan"))
    for q0, q1, k0, k1 in seqs:
        rows, keys = min(q1 - q0, max_q), min(k1 - k0, max_k)
        if q1 > q0 and k1 == k0:
            dq[q0:q0 + rows] = 0
        elif k1 > k0 and q1 == q0:
            dk[k0:k0 + keys], dv[k0:k0 + keys] = 0, 0
        elif q1 > q0:
            grads = _grads(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                           raw[None, :, q0:q1], scale, causal, window, softcap)
            dq[q0:q0 + rows], dk[k0:k0 + keys], dv[k0:k0 + keys] = (g[0, :n] for g, n in zip(grads, (rows, keys,
                                                                                                    keys)))
    return torch.zeros(h, tq, dtype=torch.float32)


def _empty(like):
    return torch.empty(0, dtype=like.dtype)


def _rng():
    return torch.zeros(2, dtype=torch.int64)


# ---------------------------------------------------------------- FlashAttention 2.0: 7 outputs, no window
def fa20_fwd(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
    out, lse = _fwd_math(q, k, v, softmax_scale, causal, dropout_p=dropout_p)
    return out, q, k, v, out, lse, _empty(q)


def fa20_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal):
    d = _bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return dq, dk, dv, d


# ---------------------------------------------------------------- 2.5: window_size tuple + alibi, 8 outputs
def fa25_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    assert alibi_slopes is None
    out, lse = _fwd_math(q, k, v, softmax_scale, causal, _fa2_reading(window_size, causal, k.shape[1]),
                         dropout_p=dropout_p)
    return out, q, k, v, out, lse, _empty(q), _rng()


def fa25_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
             alibi_slopes, deterministic, rng_state=None):
    d = _bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
                  _fa2_reading(window_size, causal, k.shape[1]))
    return dq, dk, dv, d


# ---------------------------------------------------------------- 2.6.0-2.6.2: + softcap, still 8 outputs
def fa260_fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax):
    out, lse = _fwd_math(q, k, v, softmax_scale, causal, _fa2_reading(window_size, causal, k.shape[1]), softcap,
                         dropout_p)
    return out, q, k, v, out, lse, _empty(q), _rng()


def fa260_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
              softcap, alibi_slopes, deterministic, rng_state=None):
    d = _bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
                  _fa2_reading(window_size, causal, k.shape[1]), softcap)
    return dq, dk, dv, d


# ---------------------------------------------------------------- 2.7-2.8: custom ops, window_size_left/right
@functools.cache
def fa27_ops():
    @torch.library.custom_op("ctx_plugin_test_fa27::fwd", mutates_args=("q", "k", "v"))
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float, softmax_scale: float,
            causal: bool, window_size_left: int, window_size_right: int, softcap: float,
            alibi_slopes: Optional[torch.Tensor], return_softmax: bool
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, lse = _fwd_math(q, k, v, softmax_scale, causal,
                             _fa2_reading((window_size_left, window_size_right), causal, k.shape[1]), softcap,
                             dropout_p)
        return out, lse, _empty(q), _rng()

    @torch.library.custom_op("ctx_plugin_test_fa27::bwd", mutates_args=("dq", "dk", "dv"))
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
            dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
            window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
            deterministic: bool, rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
        return _bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal,
                         _fa2_reading((window_size_left, window_size_right), causal, k.shape[1]), softcap)

    return fwd, bwd


# ---------------------------------------------------------------- FA2 varlen entry points (flash_attn_varlen.py)
def fa259_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, window_size, alibi_slopes, return_softmax, block_table):
    raise AssertionError("2.5's varlen lse is padded [b, h, max_seqlen_q]: the adapter must not bind it")


def fa259_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, alibi_slopes, deterministic,
                     rng_state=None):
    raise AssertionError("2.5's varlen lse is padded [b, h, max_seqlen_q]: the adapter must not bind it")


def fa260_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                     causal, window_size, softcap, alibi_slopes, return_softmax, block_table):
    assert alibi_slopes is None and block_table is None and not return_softmax
    out, lse = _varlen_fwd_math(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                                causal, tuple(window_size), softcap, dropout_p=dropout_p)
    return out, q, k, v, out, lse, _empty(q), _rng()


def fa260_varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                     deterministic, rng_state=None):
    assert alibi_slopes is None and not deterministic
    d = _varlen_bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, softmax_scale, causal, tuple(window_size), softcap, dropout_p=dropout_p)
    return dq, dk, dv, d


@functools.cache
def fa27_varlen_ops():
    """2.7.4-2.8.3 (2.7.0-2.7.3: the same without zero_tensors)."""
    @torch.library.custom_op("ctx_plugin_test_fa27::varlen_fwd", mutates_args=())
    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
            softmax_scale: float, causal: bool, window_size_left: int = -1, window_size_right: int = -1,
            softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None, return_softmax: bool = False,
            block_table: Optional[torch.Tensor] = None, leftpad_k: Optional[torch.Tensor] = None,
            seqused_k: Optional[torch.Tensor] = None, zero_tensors: bool = False
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        assert alibi_slopes is None and block_table is None and leftpad_k is None and seqused_k is None
        out, lse = _varlen_fwd_math(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    softmax_scale, causal, (window_size_left, window_size_right), softcap,
                                    dropout_p=dropout_p)
        return out, lse, _empty(q), _rng()

    @torch.library.custom_op("ctx_plugin_test_fa27::varlen_bwd", mutates_args=("dq", "dk", "dv"))
    def bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
            dv: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
            max_seqlen_k: int, dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
            window_size_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
            rng_state: Optional[torch.Tensor] = None, zero_tensors: bool = False) -> torch.Tensor:
        assert alibi_slopes is None and not deterministic
        return _varlen_bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                (window_size_left, window_size_right), softcap, dropout_p=dropout_p)

    return fwd, bwd


def _fa3_2024_reading(window, causal, seqlen_k):
    """The mask FlashAttention-3's 2024 builds apply (``hopper/flash_api.cpp`` @ dff976a8 … 1feb711f, the last
    ``flashattn_hopper_cuda`` build): ``mha_fwd``/``mha_bwd`` set the right side to 0 under causal, then
    ``set_params_fprop`` clamps each side to seqlen_k and turns -1 into seqlen_k; the kernel masks causally for
    (seqlen_k, 0), locally (bottom-right, ``col_limit_left/right``) when a side is below seqlen_k, not at all
    otherwise. Returned as ``(causal, window)`` for :func:`_scores`. The beta stand-in (a vendored copy whose C++ is
    not known) is given the same reading."""
    left, right = (seqlen_k if side < 0 else min(seqlen_k, side) for side in (window[0], 0 if causal else window[1]))
    if left == seqlen_k and right == 0:
        return True, (-1, -1)                                             # params.is_causal
    return False, ((left, right) if left < seqlen_k or right < seqlen_k else (-1, -1))   # params.is_local, or none


def _fa3_2024_fwd_math(q, k, v, scale, causal, window, softcap=0.0):
    return _fwd_math(q, k, v, scale, *_fa3_2024_reading(tuple(window), causal, k.shape[1]), softcap)


def _fa3_2024_bwd_math(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap=0.0):
    return _bwd_math(dout, q, k, v, out, lse, dq, dk, dv, scale, *_fa3_2024_reading(tuple(window), causal, k.shape[1]),
                     softcap)


# ---------------------------------------------------------------- FA3 beta (flashattn_hopper_cuda): 6 outputs
def fa3beta_fwd(q, k, v, softmax_scale, causal, q_descale=None, k_descale=None, v_descale=None,
                window_size=(-1, -1), sink_token_length=0, softcap=0.0, num_splits=1, pack_gqa=None):
    out, lse = _fa3_2024_fwd_math(q, k, v, softmax_scale, causal, window_size, softcap)
    return out, q, k, v, out, lse


def fa3beta_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                sink_token_length=0, softcap=0.0, deterministic=False):
    d = _fa3_2024_bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size, softcap)
    return dq, dk, dv, d


# ---------------------------------------------------------------- FA3 from 2024 (hopper/ @ 1feb711f): 7 outputs
def fa3_2024_fwd(q, k, v, softmax_scale, causal, window_size, descale_q=None, descale_k=None, descale_v=None,
                 gqa_parallel=False):
    out, lse = _fa3_2024_fwd_math(q, k, v, softmax_scale, causal, window_size)
    return out, q, k, v, out, lse, _empty(q)


def fa3_2024_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size,
                 deterministic=False):
    d = _fa3_2024_bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size)
    return dq, dk, dv, d


# ---------------------------------------------------------------- FA3 @ c082294: many required None arguments
def _fa3_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> bool:
    """Whether the call is varlen; hopper/flash_api.cpp requires max_seqlen_q/k with cu_seqlens_q/k."""
    if cu_seqlens_q is None:
        assert cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None, "dense calls pass None"
        return False
    if cu_seqlens_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise RuntimeError("max_seqlen_q must be provided if cu_seqlens_q is provided")
    return True


def _fa3_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, window, softcap):
    if _fa3_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return _varlen_fwd_math(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                tuple(window), softcap, fa2=False)
    return _fwd_math(q, k, v, scale, causal, window, softcap)


def _fa3_bwd(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
             causal, window, softcap):
    if _fa3_lengths(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return _varlen_bwd_math(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, scale, causal, tuple(window), softcap, fa2=False)
    return _bwd_math(dout, q, k, v, out, lse, dq, dk, dv, scale, causal, window, softcap)


def fa3c08_fwd(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
               seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin,
               seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
               attention_chunk=0, softcap=0.0, rotary_interleaved=True, scheduler_metadata=None, num_splits=1,
               pack_gqa=None, sm_margin=0):
    unused = (k_new, v_new, qv, out, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k,
              rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale)
    assert all(x is None for x in unused) and num_splits == 1
    o, lse = _fa3_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                      window_size, softcap)
    return o, lse, _empty(q), _empty(q)


def fa3c08_bwd(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
               max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
               deterministic=False, sm_margin=0):
    assert sequed_q is None and sequed_k is None
    d = _fa3_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, softmax_scale, causal, window_size, softcap)
    return dq, dk, dv, d


# ---------------------------------------------------------------- FA3 @ 01afd16d: custom ops, bwd takes is_causal
@functools.cache
def fa3new_ops():
    T, OT = torch.Tensor, Optional[torch.Tensor]

    @torch.library.custom_op("ctx_plugin_test_fa3new::fwd", mutates_args=())
    def fwd(q: T, k: T, v: T, k_new: OT = None, v_new: OT = None, qv: OT = None, out_: OT = None,
            cu_seqlens_q: OT = None, cu_seqlens_k: OT = None, cu_seqlens_k_new: OT = None, seqused_q: OT = None,
            seqused_k: OT = None, max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
            page_table: OT = None, kv_batch_idx: OT = None, leftpad_k: OT = None, rotary_cos: OT = None,
            rotary_sin: OT = None, seqlens_rotary: OT = None, q_descale: OT = None, k_descale: OT = None,
            v_descale: OT = None, softmax_scale: Optional[float] = None, causal: bool = False,
            window_size_left: int = -1, window_size_right: int = -1, attention_chunk: int = 0,
            softcap: float = 0.0, rotary_interleaved: bool = True, scheduler_metadata: OT = None,
            num_splits: int = 1, pack_gqa: Optional[bool] = None, sm_margin: int = 0
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        unused = (k_new, v_new, qv, out_, cu_seqlens_k_new, seqused_q, seqused_k, page_table, kv_batch_idx,
                  leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale)
        assert all(x is None for x in unused) and num_splits == 1
        out, lse = _fa3_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                            (window_size_left, window_size_right), softcap)
        return out, lse, _empty(q), _empty(q)

    @torch.library.custom_op("ctx_plugin_test_fa3new::bwd", mutates_args=("dq", "dk", "dv"))
    def bwd(dout: T, q: T, k: T, v: T, out: T, softmax_lse: T, cu_seqlens_q: OT = None, cu_seqlens_k: OT = None,
            sequed_q: OT = None, sequed_k: OT = None, max_seqlen_q: Optional[int] = None,
            max_seqlen_k: Optional[int] = None, dq: OT = None, dk: OT = None, dv: OT = None,
            softmax_scale: Optional[float] = None, is_causal: bool = False, window_size_left: int = -1,
            window_size_right: int = -1, softcap: float = 0.0, deterministic: bool = False,
            sm_margin: int = 0) -> torch.Tensor:
        assert sequed_q is None and sequed_k is None
        return _fa3_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, softmax_scale, is_causal, (window_size_left, window_size_right), softcap)

    return fwd, bwd


@dataclass(frozen=True)
class Version:
    label: str
    generation: int
    version: str
    functions: Callable[[], tuple]
    legacy_fa3: bool = False
    """A 2024 FA3 build: its interface module holds the ``flashattn_hopper_cuda`` extension it imported."""
    varlen: Optional[Callable[[], tuple]] = None
    """FlashAttention-2's ``_flash_attn_varlen_forward/_backward`` of that version (FA3 takes cu_seqlens in the
    functions above)."""


FA20 = Version("2.0", 2, "2.0.9", lambda: (fa20_fwd, fa20_bwd))
VERSIONS = [
    Version("2.5", 2, "2.5.9.post1", lambda: (fa25_fwd, fa25_bwd), varlen=lambda: (fa259_varlen_fwd,
                                                                                      fa259_varlen_bwd)),
    Version("2.6.0", 2, "2.6.0", lambda: (fa260_fwd, fa260_bwd), varlen=lambda: (fa260_varlen_fwd,
                                                                               fa260_varlen_bwd)),
    Version("2.7-custom-op", 2, "2.7.4", fa27_ops, varlen=fa27_varlen_ops),
    Version("fa3-beta", 3, "unknown", lambda: (fa3beta_fwd, fa3beta_bwd), legacy_fa3=True),
    Version("fa3-2024", 3, "unknown", lambda: (fa3_2024_fwd, fa3_2024_bwd), legacy_fa3=True),
    Version("fa3-c082294", 3, "unknown", lambda: (fa3c08_fwd, fa3c08_bwd)),
    Version("fa3-custom-op", 3, "unknown", fa3new_ops),
]


@pytest.fixture(autouse=True)
def _fresh_probe():
    """The adapter memoises its import probe; every test here swaps stand-ins, so each starts and ends afresh."""
    fa.forget_probe()
    yield
    fa.forget_probe()


def _hide_all(monkeypatch):
    for name in NAMES:
        monkeypatch.setitem(sys.modules, name, None)


def _install(monkeypatch, version: Version, fwd=None, bwd=None):
    """Puts a stand-in of ``version`` into sys.modules (on top of whatever is installed already)."""
    fwd_default, bwd_default = version.functions()
    if version.generation == 2:
        pkg = types.ModuleType("flash_attn")
        pkg.__path__ = []
        pkg.__version__ = version.version
        module = types.ModuleType("flash_attn.flash_attn_interface")
        pkg.flash_attn_interface = module
        monkeypatch.setitem(sys.modules, "flash_attn", pkg)
        monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", module)
    else:
        module = types.ModuleType("flash_attn_interface")
        monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
        if version.legacy_fa3:
            module.flashattn_hopper_cuda = types.ModuleType("flashattn_hopper_cuda")
    module._flash_attn_forward = fwd or fwd_default
    module._flash_attn_backward = bwd or bwd_default
    if version.varlen is not None:
        module._flash_attn_varlen_forward, module._flash_attn_varlen_backward = version.varlen()


@pytest.fixture(params=VERSIONS, ids=lambda v: v.label)
def version(request, monkeypatch):
    _hide_all(monkeypatch)
    _install(monkeypatch, request.param)
    return request.param


# ---------------------------------------------------------------- dense float64 reference
def _inputs(hk, *, sq=6, sk=6, seed=0, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(2, sq, 4, 8), mk(2, sk, hk, 8), mk(2, sk, hk, 8), mk(2, sq, 4, 8)


def _close(got, want, tol=TOL):
    assert rel_err(got, want) < tol, f"{rel_err(got, want):.2e}"


def _reference(q, k, v, dout, causal, scale):
    """float64 attention of the same (half-precision) values: out, lse, dq, dk, dv."""
    dout = dout.double()
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, dim=2)) * scale
    if causal:   # bottom-right aligned, like ctx_plugin's kernel interface
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v.repeat_interleave(g, dim=2))
    out.backward(dout)
    return out.detach(), torch.logsumexp(s, dim=-1).detach(), q.grad, k.grad, v.grad


SCALE = 0.3
HEADS = pytest.mark.parametrize("hk", [4, 2, 1], ids=["mha", "gqa", "mqa"])
CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])


@HEADS
@CAUSAL
def test_forward_matches_dense(version, hk, causal):
    q, k, v, dout = _inputs(hk)
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE)
    ref_out, ref_lse, *_ = _reference(q, k, v, dout, causal, SCALE)
    assert kernel.info.generation == version.generation
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 6)
    _close(out, ref_out)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=LSE_TOL)


def _check_backward(hk, causal, dtype, tol):
    q, k, v, dout = _inputs(hk, seed=1, dtype=dtype)
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE)
    _, _, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, causal, SCALE)
    assert dq.dtype == dtype and dk.shape == k.shape and dv.shape == v.shape
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        _close(got, want, tol)


@HEADS
@CAUSAL
def test_backward_matches_autograd(version, hk, causal):
    _check_backward(hk, causal, torch.float16, TOL)


def test_bfloat16_backward_matches_autograd(version):
    _check_backward(2, True, torch.bfloat16, 1.6e-2)


@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
def test_backward_with_externally_merged_out_and_lse(version, hk):
    """Ring attention's use: two K/V blocks, merged out/lse (fp32), one backward per block with the merged values."""
    q, k, v, dout = _inputs(hk, sk=10, seed=2)
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    blocks = [(k[:, :4], v[:, :4]), (k[:, 4:], v[:, 4:])]
    parts = [kernel.forward(q, kb, vb, causal=False, scale=SCALE) for kb, vb in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(o.float() * torch.exp(l - lse).transpose(1, 2)[..., None] for o, l in parts)
    grads = [kernel.backward(dout, q, kb, vb, out, lse, causal=False, scale=SCALE) for kb, vb in blocks]
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, False, SCALE)
    _close(out, ref_out)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=LSE_TOL)
    _close(grads[0][0].float() + grads[1][0].float(), ref_dq)
    _close(torch.cat([grads[0][1], grads[1][1]], dim=1), ref_dk)
    _close(torch.cat([grads[0][2], grads[1][2]], dim=1), ref_dv)


def test_strided_inputs_and_lse_reach_flash_attn_in_its_layout(version):
    """A last dimension with a non-unit stride is refused by flash-attn, and the lse it is given is read as
    contiguous [b, h, s] memory: the adapter hands over both in that layout (here: transposed copies)."""
    q, k, v, dout = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in _inputs(2, seed=3))
    assert q.stride(-1) != 1
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    out, lse = kernel.forward(q, k, v, causal=True, scale=SCALE)
    strided_lse = lse.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(strided_lse, lse) and not strided_lse.is_contiguous()
    dq, dk, dv = kernel.backward(dout, q, k, v, out.transpose(-1, -2).contiguous().transpose(-1, -2),
                                 strided_lse, causal=True, scale=SCALE)
    ref_out, _, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, True, SCALE)
    _close(out, ref_out)
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        _close(got, want)


def test_ring_slices_of_the_lse_reach_flash_attn_contiguous(version):
    """The ring hands backward lse[:, :, rows] (a strided view of the merged lse) for one half of the queries."""
    q, k, v, dout = _inputs(2, sq=8, sk=8, seed=7)
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    out, lse = kernel.forward(q, k, v, causal=False, scale=SCALE)
    half = slice(4, 8)
    dq, dk, dv = kernel.backward(dout[:, half], q[:, half], k, v, out[:, half], lse[:, :, half], causal=False,
                                 scale=SCALE)
    want = _reference(q[:, half], k, v, dout[:, half], False, SCALE)
    for got, ref in zip((dq, dk, dv), want[2:]):
        _close(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_inputs_are_refused(version, dtype):
    """flash-attn computes in float16/bfloat16 only: unavailable() says so, and the library itself raises."""
    assert "float16 or bfloat16" in fa.unavailable(torch.device("cuda", 0), dtype, 64)
    q, k, v, _ = _inputs(2, dtype=dtype, seed=4)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        fa.FlashAttnKernel(torch.device("cpu")).forward(q, k, v, causal=True, scale=SCALE)


def test_causal_block_needs_as_many_keys_as_queries(version):
    q, k, v, _ = _inputs(2, sq=8, sk=6)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        fa.FlashAttnKernel(torch.device("cpu")).forward(q, k, v, causal=True, scale=SCALE)


def test_causal_prefix_block_is_bottom_right(version):
    """Queries attending to the prefix that ends with them (the all-gather backend's call)."""
    q, k, v, dout = _inputs(2, sq=4, sk=10, seed=6)
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    out, lse = kernel.forward(q, k, v, causal=True, scale=SCALE)
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = _reference(q, k, v, dout, True, SCALE)
    _close(out, ref_out)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=LSE_TOL)
    for got, want in zip(kernel.backward(dout, q, k, v, out, lse, causal=True, scale=SCALE), (ref_dq, ref_dk, ref_dv)):
        _close(got, want)


def test_flash_attn_2_0_is_refused(monkeypatch):
    """2.0 aligns causal masks top-left: unavailable, with the upgrade command."""
    _hide_all(monkeypatch)
    _install(monkeypatch, FA20)
    reason = fa.unavailable(torch.device("cuda", 0), torch.bfloat16, 64)
    assert "top-left" in reason and "pip install -U flash-attn" in reason
    with pytest.raises(RuntimeError, match="top-left"):
        fa.FlashAttnKernel(torch.device("cpu"))


def test_version_info_names_what_was_found(version):
    info = fa.version_info(torch.device("cpu"))
    assert info == fa.FlashAttnInfo(version.generation, "flash_attn.flash_attn_interface"
                                    if version.generation == 2 else "flash_attn_interface", version.version)


@pytest.mark.parametrize("capability,generation", [((9, 0), 3), ((8, 0), 2), ((10, 0), 2)])
def test_fa3_preferred_on_hopper_only(monkeypatch, capability, generation):
    _hide_all(monkeypatch)
    by_label = {v.label: v for v in VERSIONS}
    _install(monkeypatch, by_label["2.7-custom-op"])
    _install(monkeypatch, by_label["fa3-custom-op"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert fa.version_info(torch.device("cuda", 0)).generation == generation
    assert fa.version_info(torch.device("cpu")).generation == 2
    assert fa.unavailable(torch.device("cuda", 0), torch.bfloat16, 128) is None


def test_unavailable_without_flash_attn_gives_install_hint(monkeypatch):
    _hide_all(monkeypatch)
    reason = fa.unavailable(torch.device("cuda", 0), torch.bfloat16, 128)
    assert "not installed" in reason and "pip install" in reason and "flash-attn" in reason
    assert fa.version_info(torch.device("cpu")) is None
    with pytest.raises(RuntimeError, match="not installed"):
        fa.FlashAttnKernel(torch.device("cpu"))


@pytest.mark.parametrize("body,detail", [("import flash_attn_2_cuda\n", "flash_attn_2_cuda"),
                                         ("raise ImportError('undefined symbol: _ZN3c10')\n", "undefined symbol")])
def test_unavailable_reports_a_broken_install(monkeypatch, tmp_path, body, detail):
    _hide_all(monkeypatch)
    (tmp_path / "flash_attn_interface.py").write_text(body)
    pkg = types.ModuleType("flash_attn")
    pkg.__path__ = [str(tmp_path)]
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.delitem(sys.modules, "flash_attn.flash_attn_interface")
    monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", None)
    reason = fa.unavailable(torch.device("cuda", 0), torch.bfloat16, 128)
    assert "does not import" in reason and detail in reason and "reinstall" in reason


def test_unavailable_on_cpu_asks_for_cuda(version):
    reason = fa.unavailable(torch.device("cpu"), torch.float16, 128)
    assert reason is not None and "CUDA" in reason


@pytest.mark.parametrize("dtype,head_dim,words", [(torch.float32, 128, "float16 or bfloat16"),
                                                  (torch.float64, 64, "float16 or bfloat16"),
                                                  (torch.bfloat16, 264, "head_dim"),
                                                  (torch.float16, 36, "head_dim")])
def test_unavailable_names_dtype_and_head_dim_limits(version, dtype, head_dim, words):
    reason = fa.unavailable(torch.device("cuda", 0), dtype, head_dim)
    assert reason is not None and words in reason and str(head_dim if words == "head_dim" else dtype) in reason


def test_unavailable_rejects_pre_ampere_and_missing_cuda(version, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "is_available" in fa.unavailable(torch.device("cuda", 0), torch.float16, 128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    reason = fa.unavailable(torch.device("cuda", 0), torch.float16, 128)
    assert ("Hopper" if version.generation == 3 else "Ampere") in reason and "sm75" in reason


def test_flash_attn_1_signature_is_rejected(monkeypatch):
    def v1_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
               softmax_scale, causal, return_softmax, num_splits=0, generator=None):
        raise AssertionError("must not be called")

    _hide_all(monkeypatch)
    _install(monkeypatch, Version("1.0", 2, "1.0.9", lambda: (fa20_fwd, fa20_bwd)), fwd=v1_fwd)
    reason = fa.unavailable(torch.device("cuda", 0), torch.float16, 128)
    assert "1.0.9" in reason and "not supported" in reason and "requires 'out'" in reason
    with pytest.raises(TypeError, match="requires 'out'"):
        fa.FlashAttnKernel(torch.device("cpu"))


def test_missing_causal_parameter_is_an_error_not_a_silent_full_mask(monkeypatch):
    def no_causal_fwd(q, k, v, dropout_p, softmax_scale, return_softmax):
        raise AssertionError("must not be called")

    _hide_all(monkeypatch)
    _install(monkeypatch, VERSIONS[0], fwd=no_causal_fwd)
    with pytest.raises(TypeError, match="causal"):
        fa.FlashAttnKernel(torch.device("cpu"))


def test_module_imports_nothing_from_flash_attn():
    code = ("import sys, ctx_plugin.core.kernels.flash_attn\n"
            f"hit = [n for n in {NAMES!r} if n in sys.modules]\n"
            "assert not hit, hit\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- which builds run where (flash_attn_support)
CUDA0 = torch.device("cuda", 0)


def _gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _fa2(version: str) -> Version:
    """A FlashAttention-2 stand-in with the interface ``version`` really has."""
    v = tuple(int(x) for x in version.split(".")[:3])
    functions = (fa27_ops if v >= (2, 7) else (lambda: (fa260_fwd, fa260_bwd)) if v >= (2, 6)
                 else (lambda: (fa25_fwd, fa25_bwd)))
    return Version(version, 2, version, functions)


@pytest.mark.parametrize("version,capability,head_dim,words", [
    ("2.5.4", (8, 6), 256, "no backward for head_dim 256"),   # 2.1-2.5.4: head_dim > 192 needs sm80/sm90
    ("2.3.6", (8, 9), 200, "no backward for head_dim 200"),
    ("2.5.4", (8, 0), 256, None), ("2.5.4", (9, 0), 256, None), ("2.5.4", (8, 6), 192, None),
    ("2.5.9", (8, 9), 224, "no backward for head_dim 224"),   # 2.5.5-2.6.1: only 193-224
    ("2.6.1", (8, 6), 200, "no backward for head_dim 200"),
    ("2.5.9", (8, 9), 256, None), ("2.6.2", (8, 6), 200, None), ("2.8.3", (8, 9), 256, None),
    ("2.7.2", (10, 0), 128, "sm8x and sm90 GPUs only"),       # before 2.7.3: is_sm8x || is_sm90
    ("2.6.3", (12, 0), 64, "sm8x and sm90 GPUs only"),
    ("2.7.3", (10, 0), 128, None), ("2.8.3", (12, 0), 256, None), ("2.5.9", (8, 7), 128, None),
    ("2.8.3", (7, 5), 64, "Ampere")])
def test_flash_attn_2_versions_by_gpu_and_head_dim(monkeypatch, version, capability, head_dim, words):
    _hide_all(monkeypatch)
    _install(monkeypatch, _fa2(version))
    _gpu(monkeypatch, capability)
    reason = fa.unavailable(CUDA0, torch.bfloat16, head_dim)
    if words is None:
        assert reason is None, reason
    else:
        assert reason is not None and words in reason, reason
        assert words == "Ampere" or version in reason


@pytest.mark.parametrize("label", ["fa3-beta", "fa3-2024"])
@pytest.mark.parametrize("head_dim,ok", [(64, True), (128, True), (256, False), (96, False), (192, False)])
def test_fa3_builds_from_2024_train_head_dim_64_and_128_only(monkeypatch, label, head_dim, ok):
    """Their forward takes 64/128/256, their backward at most 128 (hopper/flash_api.cpp until 2025-01-07)."""
    _hide_all(monkeypatch)
    _install(monkeypatch, next(v for v in VERSIONS if v.label == label))
    _gpu(monkeypatch, (9, 0))
    reason = fa.unavailable(CUDA0, torch.float16, head_dim)
    assert (reason is None) == ok, reason
    if not ok:
        assert "2024" in reason and str(head_dim) in reason


def test_current_fa3_builds_train_any_head_dim_up_to_256(monkeypatch):
    _hide_all(monkeypatch)
    _install(monkeypatch, next(v for v in VERSIONS if v.label == "fa3-custom-op"))
    _gpu(monkeypatch, (9, 0))
    assert all(fa.unavailable(CUDA0, torch.float16, d) is None for d in (64, 96, 192, 256))


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_fa3_alone_is_refused_off_hopper_and_auto_falls_back(monkeypatch, capability):
    from ctx_plugin.core.kernels import select_kernel
    from ctx_plugin.names import Kernel

    _hide_all(monkeypatch)
    _install(monkeypatch, next(v for v in VERSIONS if v.label == "fa3-custom-op"))
    _gpu(monkeypatch, capability)
    reason = fa.unavailable(CUDA0, torch.bfloat16, 128)
    assert reason is not None and "Hopper (sm90)" in reason and "pip install flash-attn" in reason
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91000)
    assert select_kernel(Kernel.AUTO, CUDA0, torch.bfloat16, 128).name == Kernel.SDPA_CUDNN.value
    _gpu(monkeypatch, (9, 0))
    assert fa.unavailable(CUDA0, torch.bfloat16, 128) is None
    assert select_kernel(Kernel.AUTO, CUDA0, torch.bfloat16, 128).name == Kernel.FLASH_ATTN.value


_REGISTERS = {"fa2-2.8": 'torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=())\n',
              "fa2-2.6": "def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size):\n",
              "fa3-2025-07": '_torch_custom_op_wrapper("flash_attn::_flash_attn_backward", mutates_args=())\n',
              "fa3-2025-09": '@torch.library.custom_op("flash_attn_3::_flash_attn_forward", mutates_args=())\n'}


def _on_disk(tmp_path, monkeypatch, fa2: str, fa3: str, fa3_module: str) -> None:
    """Installs FA2 and FA3 interface files whose import would fail the test: only their text may be read."""
    boom = "raise AssertionError('imported')\n"
    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(boom + "__version__ = '2.8.3'\n")
    (tmp_path / "flash_attn" / "flash_attn_interface.py").write_text(boom + _REGISTERS[fa2])
    if fa3_module == "flash_attn_interface":
        (tmp_path / "flash_attn_interface.py").write_text(boom + _REGISTERS[fa3])
    else:
        (tmp_path / "flash_attn_3").mkdir()
        (tmp_path / "flash_attn_3" / "__init__.py").write_text(boom)
        (tmp_path / "flash_attn_3" / "flash_attn_interface.py").write_text(boom + _REGISTERS[fa3])
    for name in NAMES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize("fa3_module", ["flash_attn_interface", "flash_attn_3.flash_attn_interface"])
def test_fa2_and_a_fa3_with_the_same_op_names_are_refused_without_importing_either(tmp_path, monkeypatch,
                                                                                  fa3_module):
    _on_disk(tmp_path, monkeypatch, "fa2-2.8", "fa3-2025-07", fa3_module)
    reason = fa.unavailable(CUDA0, torch.bfloat16, 128)
    assert "flash_attn::_flash_attn_forward" in reason and "imports neither" in reason
    assert "CUDA device" in fa.unavailable(torch.device("cpu"), torch.bfloat16, 128)   # decided before probing
    for device in (CUDA0, torch.device("cpu")):
        assert fa.version_info(device) is None
    with pytest.raises(RuntimeError, match="imports neither"):
        fa.FlashAttnKernel(CUDA0)
    assert not {n for n in NAMES if sys.modules.get(n) is not None}, "nothing may be imported"


@pytest.mark.parametrize("fa2,fa3", [("fa2-2.6", "fa3-2025-07"), ("fa2-2.8", "fa3-2025-09")])
def test_builds_with_different_op_names_do_not_clash(tmp_path, monkeypatch, fa2, fa3):
    from ctx_plugin.core.kernels import flash_attn_support as support

    _on_disk(tmp_path, monkeypatch, fa2, fa3, "flash_attn_interface")
    assert support.ops_clash(fa._FA2_MODULES, fa._FA3_MODULES) is None


def test_an_already_imported_fa2_is_read_from_its_file(tmp_path, monkeypatch):
    from ctx_plugin.core.kernels import flash_attn_support as support

    _on_disk(tmp_path, monkeypatch, "fa2-2.6", "fa3-2025-07", "flash_attn_interface")
    imported = types.ModuleType("flash_attn.flash_attn_interface")
    imported.__file__ = str(tmp_path / "imported_fa2.py")
    (tmp_path / "imported_fa2.py").write_text(_REGISTERS["fa2-2.8"])
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", imported)
    assert "imports neither" in support.ops_clash(fa._FA2_MODULES, fa._FA3_MODULES)


# ---------------------------------------------------------------- sliding windows and softcap
def fa22_fwd(q, k, v, dropout_p, softmax_scale, causal, return_softmax):
    out, lse = _fwd_math(q, k, v, softmax_scale, causal, dropout_p=dropout_p)
    return out, q, k, v, out, lse, _empty(q), _rng()


def fa22_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, rng_state=None):
    d = _bwd_math(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return dq, dk, dv, d


FA22 = Version("2.2", 2, "2.2.5", lambda: (fa22_fwd, fa22_bwd))
# What each stand-in's real build applies (flash-attn's signatures and release notes: window_size from 2.3,
# softcap from 2.6; FA3's 2024 builds: window only, and the beta's softcap is not trusted, see the adapter).
FEATURES = {"2.2": set(), "2.5": {"window"}, "2.6.0": {"window", "softcap"}, "2.7-custom-op": {"window", "softcap"},
            "fa3-beta": {"window"}, "fa3-2024": {"window"}, "fa3-c082294": {"window", "softcap"},
            "fa3-custom-op": {"window", "softcap"}}
# (label, sq, sk, causal, window) in the kernel convention; every query row keeps a key.
WINDOWS = [("causal-inside", 8, 8, True, (3, 0)), ("causal-left-only", 8, 8, True, (2, None)),
           ("causal-prefix-sk>sq", 4, 10, True, (3, None)), ("full-left-right", 8, 8, False, (2, 3)),
           ("full-right-only", 8, 8, False, (None, 2)), ("full-left-only", 6, 9, False, (1, None)),
           ("full-sq>sk", 8, 5, False, (1, 4)), ("causal-larger-than-block", 8, 8, True, (20, 0)),
           ("plain-causal", 8, 8, True, (None, None)),
           # Sq > Sk + 1, not causal: FlashAttention-2 would bound the right side at Sk / unbound a right side >= Sk,
           # the 2024 FA3 builds bound either at Sk
           ("full-left-only-sq>sk+1", 12, 4, False, (1, None)), ("full-right>=sk-sq>sk+1", 12, 4, False, (None, 9)),
           # what blocks.band_block(Mask(True, (5, None)), 8, 5, 1, slice(0, 8), slice(0, 3)) gives (packed documents)
           ("document-block-5x3", 5, 3, False, (0, None))]
CAP = 1.0


def _window_reference(q, k, v, dout, causal, window, softcap):
    from tests.reference import dense_scores, dense_with_grads
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    out, dq, dk, dv = dense_with_grads(q, k, v, dout, causal=causal, scale=SCALE, window=window, softcap=softcap)
    lse = torch.logsumexp(dense_scores(q, k, causal=causal, scale=SCALE, window=window, softcap=softcap), -1)
    return out, lse, dq, dk, dv


@pytest.mark.parametrize("label,sq,sk,causal,window", WINDOWS, ids=[w[0] for w in WINDOWS])
@pytest.mark.parametrize("softcap", [None, CAP], ids=["nocap", "softcap"])
def test_window_and_softcap_reach_flash_attn_exactly(version, label, sq, sk, causal, window, softcap):
    """Each build that applies a window / softcap gets it translated exactly (-1 = unbounded, right = 0 under
    causal); the stand-ins apply them like flash-attn, so an off-by-one or a dropped side fails here."""
    q, k, v, dout = _inputs(2, sq=sq, sk=sk, seed=len(label))
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    needed = ({"window"} if window != (None, None) else set()) | ({"softcap"} if softcap else set())
    assert kernel.features == FEATURES[version.label]
    if needed - kernel.features:
        with pytest.raises(ValueError, match="applies no"):
            kernel.forward(q, k, v, causal=causal, scale=SCALE, window=window, softcap=softcap)
        return
    out, lse = kernel.forward(q, k, v, causal=causal, scale=SCALE, window=window, softcap=softcap)
    grads = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=SCALE, window=window, softcap=softcap)
    ref_out, ref_lse, *ref_grads = _window_reference(q, k, v, dout, causal, window, softcap)
    _close(out, ref_out)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=0, atol=LSE_TOL)
    for got, want in zip(grads, ref_grads):
        _close(got, want)


@pytest.mark.parametrize("stand_in", [FA22, *VERSIONS], ids=lambda v: v.label)
def test_unavailable_names_the_features_a_build_lacks(monkeypatch, stand_in):
    _hide_all(monkeypatch)
    _install(monkeypatch, stand_in)
    _gpu(monkeypatch, (9, 0) if stand_in.generation == 3 else (8, 0))
    has = FEATURES[stand_in.label]
    assert fa.unavailable(CUDA0, torch.bfloat16, 128) is None
    for feature, words in (("window", "sliding windows"), ("softcap", "softcap")):
        reason = fa.unavailable(CUDA0, torch.bfloat16, 128, frozenset({feature}))
        if feature in has:
            assert reason is None, reason
        else:
            assert reason is not None and f"applies no {words}" in reason and "kernel='torch'" in reason


def test_versions_before_the_feature_are_refused_even_with_the_argument(monkeypatch):
    """A build that reports 2.2 but takes window_size (a patched fork) is still refused a window: version gate."""
    _hide_all(monkeypatch)
    _install(monkeypatch, Version("2.2.0", 2, "2.2.0", lambda: (fa25_fwd, fa25_bwd)))
    _gpu(monkeypatch, (8, 0))
    assert "applies no sliding windows" in fa.unavailable(CUDA0, torch.float16, 64, frozenset({"window"}))
    _install(monkeypatch, Version("2.5.9", 2, "2.5.9", lambda: (fa260_fwd, fa260_bwd)))
    fa.forget_probe()
    assert fa.unavailable(CUDA0, torch.float16, 64, frozenset({"window"})) is None
    assert "applies no softcap" in fa.unavailable(CUDA0, torch.float16, 64, frozenset({"softcap"}))


def test_flash_attention_2_backward_past_int32_offsets_runs_over_head_chunks(version, monkeypatch):
    """FlashAttention-2 builds compute dQ offsets in int32 (ctx_plugin.core.kernels.head_chunks) over the accumulator
    rows of the whole batch (2 sequences of 6 rows, each rounded up to 128): with the limit lowered to fit 2 of 4
    heads, the backward runs as two calls on head chunks with their K/V heads, same gradients; FlashAttention-3 runs
    as one call."""
    import ctx_plugin.core.kernels.head_chunks as head_chunks

    q, k, v, dout = _inputs(2, seed=1)
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    out, lse = kernel.forward(q, k, v, causal=True, scale=SCALE)
    want = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=SCALE)
    calls = []
    real = kernel._bwd
    monkeypatch.setattr(kernel, "_bwd", lambda **kw: calls.append(kw["q"].shape[2]) or real(**kw))
    monkeypatch.setattr(head_chunks, "INT32_LIMIT", 2 * 128 * 32 * 3)     # rows rounded to 128, head size to 32
    got = kernel.backward(dout, q, k, v, out, lse, causal=True, scale=SCALE)
    assert calls == ([2, 2] if version.generation == 2 else [4])
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("label", ["dense-8300x1", "dense-4x131072-gqa", "dense-2x393216-gqa", "dense-1x700000-d200"])
def test_flash_attention_2_backward_at_scale_keeps_every_dq_offset_in_int32(monkeypatch, label):
    """At the sizes where one call's dQ offsets wrap (the batch's rows count, each sequence rounded up to 128), on
    meta tensors (shapes only): FlashAttention-2 is called on head chunks whose offsets all fit, checked with the
    kernel's arithmetic emulated by tests/unit/test_head_chunks.py."""
    from tests.unit.test_head_chunks import AT_SCALE, dq_offsets_wrap, meta_tensors

    _, seq_rows, heads, kv_heads, head_dim, _ = next(c for c in AT_SCALE if c[0] == label)
    _hide_all(monkeypatch)
    _install(monkeypatch, next(v for v in VERSIONS if v.label == "2.7-custom-op"))
    kernel = fa.FlashAttnKernel(torch.device("cpu"))
    calls = []
    monkeypatch.setattr(kernel, "_bwd", lambda **kw: calls.append(kw["q"].shape[2]))
    tensors = meta_tensors(seq_rows, heads, kv_heads, head_dim, varlen=False)
    grads = kernel.backward(*tensors, causal=False, scale=SCALE)
    assert [g.shape for g in grads] == [t.shape for t in tensors[1:4]]
    assert sum(calls) == heads and len(calls) > 1
    for size in set(calls):
        assert not dq_offsets_wrap(seq_rows, size, head_dim, varlen=False), size
