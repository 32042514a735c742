"""Running one step's blocks through the local kernel: one call per block, or one varlen call per chain of blocks.

The ring (every step), the all-gather backend (its one pass) and through them Ulysses and the hybrid hand their
blocks here. With packed documents a step holds a block per document, so blocks that can share a call
(:func:`ctx_plugin.core.kernels.varlen.chains`) run as one varlen call when the kernel has that entry point
(:func:`~ctx_plugin.core.kernels.varlen.has_varlen`: flash-attn, torch's flash kernel, the torch kernel); the rest, and
every block without documents (at most four a step), run one call each. Either way the pairs computed are the
blocks' and the results the same (the varlen contract keeps rows and keys outside the blocks at 0 / −inf).
"""
from __future__ import annotations

import functools

import torch

from ..names import Part
from .blocks import Block, BlockPlan, BlockTable, gc_paused
from .kernels import AttentionKernel
from .kernels.varlen import Varlen, chain_indices, has_varlen, pack_table
from .mask import Mask
from .merge import merge_into
from .profiling import span


class _Same:
    """A key that is equal only to a key of the same object (hashed by identity): a plan's tuple of blocks is
    immutable, and the cache entry holding the key keeps it alive, so its id cannot be reused meanwhile."""

    __slots__ = ("obj",)

    def __init__(self, obj) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


@functools.lru_cache(maxsize=512)
@gc_paused()
def _varlen_plan(blocks: _Same, sq: int, sk: int, batch: int) -> tuple[tuple[Block, ...], tuple[Varlen, ...]]:
    plan = blocks.obj
    table = BlockTable.of(plan)
    singles, found = chain_indices(table)
    picked = plan.pick(singles) if isinstance(plan, BlockPlan) else tuple(plan[i] for i in singles)
    return picked, tuple(pack_table(table, c, sq, sk, batch) for c in found)


def plan_calls(kernel: AttentionKernel, blocks, mask: Mask, sq: int, sk: int,
               batch: int) -> tuple[tuple[Block, ...], tuple[Varlen, ...]]:
    """``(blocks run one call each, varlen calls)`` for ``blocks`` of ``sq`` local rows meeting ``sk`` keys.

    Memoised per plan object: the layouts' plans (and the all-gather's query chunks) are cached, immutable, handed here
    again by every layer, in forward and in backward, so a step's chains and varlen calls (Python work linear in
    its documents) are built once per batch of documents, not once per layer and pass."""
    if mask.documents is None or not has_varlen(kernel):
        return tuple(blocks), ()
    if not isinstance(blocks, (tuple, BlockPlan)):
        blocks = tuple(blocks)
    return _varlen_plan(_Same(blocks), sq, sk, batch)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` as the flattened ``[B·S, H, D]`` rows of a varlen call."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _lse_of(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """A varlen ``[H, B·S]`` LSE as a ``[B, H, S]`` view."""
    h, t = lse.shape
    return lse.view(h, batch, t // batch).transpose(0, 1)


class Accumulator:
    """The merged ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` (``lse_dtype``, the accumulation dtype) of a ring's
    query rows. A row's first partial result is written, not merged into zeros: the buffers start uninitialised and
    the rows written so far are tracked as intervals, so no fill and no merge pass over zeros; :meth:`result` gives
    rows no block reached (padding, or rows of no document in any step) output 0 and lse −inf.

    ``out_dtype`` is the accumulation dtype where rows take several partial results (the ring); the inputs' own
    dtype where each row's attention is one block (the all-gather backend: a later call's rows of a varlen call are
    0 / −inf in every other call, so its "merge" weighs exactly 1 and 0)."""

    def __init__(self, b: int, s: int, h: int, d: int, lse_dtype: torch.dtype, device: torch.device,
                 out_dtype: torch.dtype | None = None) -> None:
        self.out = torch.empty(b, s, h, d, dtype=lse_dtype if out_dtype is None else out_dtype, device=device)
        self.lse = torch.empty(b, h, s, dtype=lse_dtype, device=device)
        self._done: list[tuple[int, int]] = []        # disjoint, sorted row intervals holding a result
        self._rows = s

    def _gaps(self, start: int, stop: int) -> list[tuple[int, int]]:
        gaps, at = [], start
        for a, z in self._done:
            if z <= at or a >= stop:
                continue
            if a > at:
                gaps.append((at, a))
            at = max(at, z)
        if at < stop:
            gaps.append((at, stop))
        return gaps

    def _mark(self, start: int, stop: int) -> None:
        merged = []
        for a, z in sorted([*self._done, (start, stop)]):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], z))
            else:
                merged.append((a, z))
        self._done = merged

    def _clear(self, gaps) -> None:
        for a, z in gaps:
            self.out[:, a:z].zero_()
            self.lse[:, :, a:z].fill_(float("-inf"))

    def add(self, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Folds a partial result of rows ``rows`` (over keys not seen before by these rows) in."""
        gaps = self._gaps(rows.start, rows.stop)
        if gaps == [(rows.start, rows.stop)]:             # rows untouched: the result is theirs
            self.out[:, rows].copy_(out)
            self.lse[:, :, rows].copy_(lse)
        else:
            self._clear(gaps)
            merge_into(self.out[:, rows], self.lse[:, :, rows], out, lse)
        self._mark(rows.start, rows.stop)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._clear(self._gaps(0, self._rows))
        self._done = [(0, self._rows)]
        return self.out, self.lse


def forward_blocks(kernel: AttentionKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks, *,
                   mask: Mask, scale: float, acc: Accumulator) -> None:
    """Folds the attention of ``blocks`` into ``acc``."""
    b, sq = q.shape[:2]
    singles, calls = plan_calls(kernel, blocks, mask, sq, k.shape[1], b)
    for blk in singles:
        with span(Part.KERNEL):
            o_b, lse_b = kernel.forward(q[:, blk.q], k[:, blk.k], v[:, blk.k], causal=blk.causal, scale=scale,
                                        window=blk.window, softcap=mask.softcap)
        acc.add(blk.q, o_b, lse_b)
    if calls:
        rows_q, rows_k, rows_v = _rows(q), _rows(k), _rows(v)
        for call in calls:   # every row: those outside the call's blocks come with output 0 and lse −inf
            with span(Part.KERNEL):
                o_c, lse_c = kernel.forward_varlen(rows_q, rows_k, rows_v, call, scale=scale, softcap=mask.softcap)
            acc.add(slice(0, sq), o_c.view(q.shape), _lse_of(lse_c, b))


def backward_blocks(kernel: AttentionKernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, blocks, *, mask: Mask, scale: float, dq: torch.Tensor,
                    dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Adds the gradients of ``blocks`` (given the final ``out``/``lse`` of their rows) into ``dq``, ``dk``, ``dv``."""
    b, sq = q.shape[:2]
    singles, calls = plan_calls(kernel, blocks, mask, sq, k.shape[1], b)
    for blk in singles:
        with span(Part.KERNEL):
            dq_b, dk_b, dv_b = kernel.backward(dout[:, blk.q], q[:, blk.q], k[:, blk.k], v[:, blk.k], out[:, blk.q],
                                               lse[:, :, blk.q], causal=blk.causal, scale=scale, window=blk.window,
                                               softcap=mask.softcap)
        with span(Part.MERGE):
            dq[:, blk.q] += dq_b
            dk[:, blk.k] += dk_b
            dv[:, blk.k] += dv_b
        del dq_b, dk_b, dv_b        # freed before the next block's kernel allocates its own
    if calls:
        rows = [_rows(t) for t in (dout, q, k, v, out)]
        lse_rows = lse.transpose(0, 1).reshape(lse.shape[1], b * sq).contiguous()     # [H, B·Sq]
        for call in calls:
            with span(Part.KERNEL):
                dq_c, dk_c, dv_c = kernel.backward_varlen(*rows, lse_rows, call, scale=scale, softcap=mask.softcap)
            with span(Part.MERGE):
                dq += dq_c.view(dq.shape)
                dk += dk_c.view(dk.shape)
                dv += dv_c.view(dv.shape)
            del dq_c, dk_c, dv_c
