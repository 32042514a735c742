"""flash-attn's variable-length entry points behind the varlen kernel interface (:mod:`.varlen`): every sequence of
a :class:`~.varlen.Varlen` call (a ring step's blocks of packed documents and the fillers between them) in one
launch, for :class:`~.flash_attn.FlashAttnKernel` (which binds these at construction; this module holds the varlen
shims, :mod:`.flash_attn` the dense ones and the import probe).

Bound by name like the dense path (:func:`~.flash_attn._plan`); outputs picked by position 0 (``out``) and by
shape (``lse`` is the only ``[H, Tq]`` tensor). Verified from Dao-AILab/flash-attention sources (a git mirror of
the repository, read at the tags and commits named):

* **FlashAttention-2 >= 2.6.0**, ``flash_attn/flash_attn_interface.py``:
  ``_flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
  softmax_scale, causal, …)`` and ``_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv,
  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, …)`` (writes
  dq/dk/dv). v2.6.0–v2.6.3: ``…, window_size, softcap, alibi_slopes, return_softmax, block_table`` (2.6.0:
  ``block_table`` required, passed None; 2.6.3 adds ``leftpad_k=None, seqused_k=None``) -> ``(out, q, k, v,
  out_padded, softmax_lse, S_dmask, rng_state)``; bwd ``…, window_size, softcap, alibi_slopes, deterministic,
  rng_state=None`` -> ``(dq, dk, dv, softmax_d)``. v2.7.0–v2.8.3: custom ops ``flash_attn::_flash_attn_varlen_*``,
  ``window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False,
  block_table=None, leftpad_k=None, seqused_k=None`` (+ ``zero_tensors=False`` from 2.7.4) -> ``(out,
  softmax_lse, S_dmask, rng_state)``; bwd ``…, window_size_left, window_size_right, softcap, alibi_slopes,
  deterministic, rng_state=None`` (+ ``zero_tensors=False``) -> ``softmax_d``.
  **LSE**: ``csrc/flash_attn/flash_api.cpp`` ``mha_varlen_fwd`` allocates ``softmax_lse`` fp32 ``{num_heads,
  total_q}`` from v2.6.0 (commit f816dee63c90e51c739baf0a27a450ee897632a8, "Support unpadded LSE layout") through
  v2.8.3, and ``mha_varlen_bwd`` reads it as ``h x total_q``; 2.1–2.5.9.post1 pad it to ``{batch_size,
  num_heads, max_seqlen_q}``, so those builds get no varlen binding (block calls then run one call per block).
  **Empty sequences**: ``flash_fwd_kernel.h``'s early exit writes out 0 and LSE **+INFINITY** for rows of a
  sequence without keys (turned into −inf here); ``flash_bwd_kernel.h`` writes dk = dv = 0 for keys of a sequence
  without rows ("This also covers the case where actual_seqlen_q == 0"), and dq of rows without keys is the
  dq_accum that ``flash_bwd_dot_do_o_kernel<Clear_dQaccum=true>`` zeroed (deterministic=False, as passed).
  **max_seqlen_q**: passed as at least 2. At 1 with fewer K/V heads than Q heads and no window, ``mha_varlen_fwd``
  (from v2.4.3) takes its decoding shortcut ``seqlenq_ngroups_swapped``, reshaping q to ``{batch_size,
  num_heads_k, ngroups, head_size}``: only valid when every sequence has exactly one row, and fillers have none.
  A larger bound only sizes the launch grid (the kernels read each sequence's length from cu_seqlens).
* **FlashAttention-3** (hopper) from the 2025-01-07 refactor (7a802796e12ab36fc9830089c418497c1552bd53) on: the
  dense ``_flash_attn_forward``/``_flash_attn_backward`` take ``cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k`` themselves (plain functions @ c082294e0f6c01d46318694a6f3e0274225a9683, custom ops @
  01afd16d248c4c7d0f9aed1914084f16c490eaed; the bwd spells the unused ones ``sequed_q/sequed_k``).
  **LSE**: ``hopper/flash_api.cpp`` ``mha_fwd`` allocates ``{num_heads, total_q}`` fp32 when cu_seqlens_q is given
  (every version of the file from 7a802796 to the mirror's head, 2026), the backward's preprocess reads it with
  strides ``(1, total_q)`` (``hopper/flash_bwd_launch_template.h``). **Empty sequences**: ``epilogue_fwd.hpp``
  ``store_zero`` writes out 0 and LSE −inf, the backward's ``store_zero`` dk = dv = 0. The 2024 builds (separate
  ``_flash_attn_varlen_*`` functions, ``flashattn_hopper_cuda``) get no varlen binding.

Windows and softcap as for the dense path (the kernel's ``features``); the right side of a varlen call's window is
unbounded or causal (:func:`.varlen.chains`), so it is passed as -1 or 0. FlashAttention-2's backward runs over head
chunks where its 32-bit dQ offsets (``total_q + 128 * sequences`` accumulator rows) would wrap
(:mod:`.head_chunks`). Not run on a GPU here: tested against stand-ins of these signatures and behaviours
(``tests/unit/test_flash_attn_varlen.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from . import flash_attn_support as support
from .base import accum_dtype, check_block, fa2_max_seqlen_k, is_windowed
from .flash_attn import (_BWD_TENSORS, _FA3_UNUSED, _FWD_TENSORS, FlashAttnInfo, _lacks, _last_dim_contiguous,
                         _pick, _plan, _settings)
from .head_chunks import by_head_chunks, fa2_head_chunk
from .varlen import Varlen

_LENGTHS = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
_FA2_FUNCTIONS = ("_flash_attn_varlen_forward", "_flash_attn_varlen_backward")
_FA2_UNUSED = frozenset({"block_table"})      # required (no default) in 2.5.9-2.6.2
_FA2_UNPADDED_LSE = (2, 6, 0)


@dataclass(frozen=True)
class Binding:
    """A build's varlen functions and the parameter names passed to each."""

    fwd: Callable[..., Any]
    fwd_names: tuple[str, ...]
    bwd: Callable[..., Any]
    bwd_names: tuple[str, ...]
    min_max_q: int
    """The smallest ``max_seqlen_q`` passed (2 for FlashAttention-2, see the module docstring)."""


def bind(module: ModuleType, info: FlashAttnInfo, legacy_fa3: bool) -> Binding | str:
    """The varlen functions of this build, or a sentence saying why it has none."""
    what = f"flash-attn {info.version} ({info.module})"
    if info.generation == 2:
        v = support.version_tuple(info.version)
        if v is None or v < _FA2_UNPADDED_LSE:
            return (f"{what} has no varlen entry point with the [heads, total_q] LSE (flash-attn >= 2.6.0; older "
                    f"versions pad it per sequence): packed documents run one kernel call per block; "
                    f"pip install -U flash-attn --no-build-isolation for one call per step")
        fwd, bwd = (getattr(module, name, None) for name in _FA2_FUNCTIONS)
        if fwd is None or bwd is None:
            return f"{what} has no {'/'.join(_FA2_FUNCTIONS)}: packed documents run one kernel call per block"
        unused, min_max_q = _FA2_UNUSED, 2
    else:
        if legacy_fa3:
            return (f"{what} is a FlashAttention-3 build from 2024, whose varlen functions this adapter does not "
                    f"bind: packed documents run one kernel call per block; rebuild FlashAttention-3 from a 2025 "
                    f"or later hopper/ for one call per step")
        fwd, bwd, unused, min_max_q = module._flash_attn_forward, module._flash_attn_backward, _FA3_UNUSED, 1
    try:
        return Binding(fwd, _plan(fwd, _FWD_TENSORS + _LENGTHS, unused), bwd,
                       _plan(bwd, _BWD_TENSORS + _LENGTHS, unused), min_max_q)
    except TypeError as e:
        return f"{what}'s varlen functions are not supported by this adapter ({e}): one kernel call per block"


class VarlenCalls:
    """``forward_varlen``/``backward_varlen`` of one build (the :mod:`.varlen` interface)."""

    def __init__(self, binding: Binding, info: FlashAttnInfo, features: frozenset[str]) -> None:
        self._b, self._info, self._features = binding, info, features

    def _values(self, q: torch.Tensor, k: torch.Tensor, batch: Varlen, scale: float,
                softcap: float | None) -> dict[str, Any]:
        if q.dim() != 3 or k.dim() != 3 or q.shape[1] % k.shape[1] or q.shape[2] != k.shape[2]:
            raise ValueError(f"varlen calls take q [Tq, H, D] and k/v [Tk, Hkv, D] with H a multiple of Hkv, got "
                             f"{tuple(q.shape)} and {tuple(k.shape)}")
        if (batch.seqs[-1][1], batch.seqs[-1][3]) != (q.shape[0], k.shape[0]):
            raise ValueError(f"the varlen call covers {batch.seqs[-1][1]} rows and {batch.seqs[-1][3]} keys, "
                             f"got q/k with {q.shape[0]} and {k.shape[0]}")
        check_block(q[None], k[None], False, batch.window, softcap)      # window sides and softcap
        if batch.window[1] is not None and not batch.causal:
            raise ValueError(f"varlen calls take windows with an unbounded right side, got {batch.window} "
                             f"(ctx_plugin.core.kernels.varlen.chains never builds one)")
        needed = frozenset({"window"} if is_windowed(batch.window) else ()) | frozenset(
            {"softcap"} if softcap is not None else ())
        if needed - self._features:
            raise ValueError(_lacks(self._info, needed - self._features))
        cu_q, cu_k = batch.cu_seqlens(q.device)
        return {**_settings(scale, batch.causal, batch.window, softcap), "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
                "max_seqlen_q": max(batch.max_q, self._b.min_max_q),
                "max_seqlen_k": batch.max_k if self._info.generation != 2 else
                fa2_max_seqlen_k(batch.max_q, batch.max_k, batch.causal, batch.window)}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen, *, scale: float,
                softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """out ``[Tq, H, D]`` (q's dtype), lse ``[H, Tq]`` (fp32): rows of a sequence without keys get 0 and −inf
        (FlashAttention-2 writes +inf there)."""
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        values = {**self._values(q, k, batch, scale, softcap), "q": q, "k": k, "v": v}
        out, lse = _pick(self._b.fwd(**{n: values.get(n) for n in self._b.fwd_names}), q, (q.shape[1], q.shape[0]),
                         "varlen forward")
        lse = lse.masked_fill(torch.isposinf(lse), float("-inf"))
        return out.to(q.dtype), lse.to(accum_dtype(q.dtype))

    def backward(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, batch: Varlen, *, scale: float,
                 softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dq, dk, dv (q's/k's shapes and dtype) given the final ``lse`` ``[H, Tq]`` of every row (handed over as
        contiguous fp32, the memory the kernel reads); 0 for rows without keys and keys without rows."""
        chunk = (fa2_head_chunk(q.shape[0], q.shape[1], k.shape[1], q.shape[2], sequences=len(batch.seqs))
                 if self._info.generation == 2 else None)
        if chunk is not None:       # FlashAttention-2's int32 dQ offsets would wrap (head_chunks)
            return by_head_chunks(lambda *t: self.backward(*t, batch, scale=scale, softcap=softcap), chunk, dout, q,
                                  k, v, out, lse, head_dim=1, lse_head_dim=0)
        dout, q, k, v, out = (_last_dim_contiguous(t) for t in (dout.to(q.dtype), q, k, v, out.to(q.dtype)))
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        values = {**self._values(q, k, batch, scale, softcap), "dout": dout, "q": q, "k": k, "v": v, "out": out,
                  "softmax_lse": lse.to(accum_dtype(q.dtype)).contiguous(), "dq": dq, "dk": dk, "dv": dv}
        self._b.bwd(**{n: values.get(n) for n in self._b.bwd_names})
        return dq, dk, dv
