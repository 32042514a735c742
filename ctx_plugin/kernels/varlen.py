"""Many attention blocks in one kernel call: variable-length ("varlen") batches, flash-attn's ``cu_seqlens`` form.

With packed documents one ring step (or the all-gather backend's one pass) holds a block per document — thousands
for a million-token sequence of short documents — and one kernel launch per block would cost more than the blocks'
work. Kernels with a varlen entry point (flash-attn's ``_flash_attn_varlen_forward``, torch's
``aten::_flash_attention_forward`` with ``cum_seq_q/k``) run many of them in one call: the query rows of the whole
``[B, Sq]`` input, flattened to ``B·Sq`` rows, are cut into consecutive *sequences* ``cu_q[i] : cu_q[i + 1]``, each
attending to its own consecutive key rows ``cu_k[i] : cu_k[i + 1]`` of the flattened ``B·Sk`` keys, every sequence
under the same mask (causal or not, the same window) aligned bottom-right within the sequence, as a block is.

**Chains.** Blocks can share one call when they have the same causal flag and window, their query rows are
disjoint and their key rows are disjoint and in the same order (:func:`chains`; a block whose window bounds its
right side stays a call of its own: FlashAttention-2 reads a right side past the block as unbounded). The rows and
keys between a chain's blocks become *filler* sequences: rows with no keys, and keys with no rows (:func:`pack`).
The contract every varlen kernel keeps, so callers never clean up after it: a row of a sequence without keys gets
output 0 and LSE −inf (FlashAttention-2 writes +inf there; its adapters turn that into −inf) and gradient 0; a key
of a sequence without rows gets gradient 0.

**The kernel interface** (``AttentionKernel``'s optional pair, :func:`has_varlen`)::

    forward_varlen(q [Tq, H, D], k [Tk, Hkv, D], v, batch: Varlen, *, scale, softcap)
        -> out [Tq, H, D] (q's dtype), lse [H, Tq] (accum_dtype)
    backward_varlen(dout, q, k, v, out, lse [H, Tq], batch, *, scale, softcap) -> dq, dk, dv (q's/k's shapes)

``lse`` is the *final* (merged) one of each row, as in the block backward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..blocks import Block
from .base import Window, accum_dtype


@dataclass(frozen=True)
class Varlen:
    """One varlen call: its sequences over the flattened rows and keys (fillers included, covering both)."""

    seqs: tuple[tuple[int, int, int, int], ...]
    """Per sequence ``(q_start, q_stop, k_start, k_stop)`` in flattened rows; consecutive, covering ``[0, Tq)`` and
    ``[0, Tk)``."""
    causal: bool
    window: Window
    """Every sequence's window (its right side ``None``, or causal)."""
    blocks: int
    """How many of the sequences are blocks (the others are fillers)."""

    @property
    def max_q(self) -> int:
        return max(q1 - q0 for q0, q1, _, _ in self.seqs)

    @property
    def max_k(self) -> int:
        return max(k1 - k0 for _, _, k0, k1 in self.seqs)

    @functools.cached_property
    def _boundaries(self) -> torch.Tensor:
        """``[2, n + 1]`` int32 on the CPU (built once per call plan: plans are cached, every layer reuses them)."""
        cu_q = [0, *(q1 for _, q1, _, _ in self.seqs)]
        cu_k = [0, *(k1 for _, _, _, k1 in self.seqs)]
        return torch.tensor([cu_q, cu_k], dtype=torch.int32)

    @functools.cached_property
    def _pinned(self) -> torch.Tensor:
        return self._boundaries.pin_memory()     # never written: safe to copy from asynchronously, again and again

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cu_q, cu_k)``: int32 ``[n + 1]`` cumulative boundaries on ``device``, as flash-attn takes them."""
        if device.type == "cuda":
            both = self._pinned.to(device, non_blocking=True)
        else:
            both = self._boundaries.to(device)
        return both[0], both[1]


def has_varlen(kernel) -> bool:
    """Whether ``kernel`` offers ``forward_varlen``/``backward_varlen``."""
    return callable(getattr(kernel, "forward_varlen", None)) and callable(getattr(kernel, "backward_varlen", None))


def _eligible(blk: Block) -> bool:
    return blk.causal or blk.window[1] is None


def chains(blocks) -> tuple[tuple[Block, ...], tuple[tuple[Block, ...], ...]]:
    """``(singles, chains)``: the blocks that run one call each, and groups of at least two blocks that can share a
    varlen call (same causal flag and window; query rows disjoint, key rows disjoint, both increasing). First fit
    over blocks sorted by their first row; every block lands in exactly one of the two."""
    groups: dict[tuple[bool, Window], list[Block]] = {}
    singles = []
    for blk in blocks:
        (groups.setdefault((blk.causal, blk.window), []) if _eligible(blk) else singles).append(blk)
    out = []
    for members in groups.values():
        open_chains: list[list[Block]] = []
        for blk in sorted(members, key=lambda b: (b.q.start, b.k.start)):
            home = next((c for c in open_chains if blk.q.start >= c[-1].q.stop and blk.k.start >= c[-1].k.stop),
                        None)
            if home is None:
                open_chains.append([blk])
            else:
                home.append(blk)
        for c in open_chains:
            (out.append(tuple(c)) if len(c) > 1 else singles.append(c[0]))
    return tuple(singles), tuple(out)


def pack(chain: tuple[Block, ...], sq: int, sk: int, batch: int) -> Varlen:
    """The varlen call of ``chain`` over ``batch`` samples of ``sq`` rows and ``sk`` keys (flattened sample after
    sample), fillers included."""
    first = chain[0]
    seqs = []
    for b in range(batch):
        q_at, k_at = b * sq, b * sk
        for blk in chain:
            q0, k0 = b * sq + blk.q.start, b * sk + blk.k.start
            if q0 > q_at:
                seqs.append((q_at, q0, k_at, k_at))      # rows before the block: no keys
            if k0 > k_at:
                seqs.append((q0, q0, k_at, k0))          # keys before the block: no rows
            q_at, k_at = b * sq + blk.q.stop, b * sk + blk.k.stop
            seqs.append((q0, q_at, k0, k_at))
        if (b + 1) * sq > q_at:
            seqs.append((q_at, (b + 1) * sq, k_at, k_at))
        if (b + 1) * sk > k_at:
            seqs.append(((b + 1) * sq, (b + 1) * sq, k_at, (b + 1) * sk))
    return Varlen(tuple(seqs), first.causal, first.window, len(chain) * batch)


class LoopedVarlen:
    """The varlen pair as one block call per sequence (a kernel's own ``forward``/``backward``): the reference of the
    contract, and what lets CPU runs take the varlen path that GPU kernels run in one launch."""

    def forward_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen, *, scale: float,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
        for q0, q1, k0, k1 in batch.seqs:
            if q1 > q0 and k1 > k0:
                o, l_ = self.forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=batch.causal,
                                     scale=scale, window=batch.window, softcap=softcap)
                out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
        return out, lse

    def backward_varlen(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, batch: Varlen, *, scale: float,
                        softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        acc = accum_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
        for q0, q1, k0, k1 in batch.seqs:
            if q1 > q0 and k1 > k0:
                grads = self.backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                      out[None, q0:q1], lse[None, :, q0:q1], causal=batch.causal, scale=scale,
                                      window=batch.window, softcap=softcap)
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
        return dq, dk, dv
