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

import numpy as np
import torch

from ..blocks import UNBOUNDED, Block, BlockTable
from .base import Window, accum_dtype


@dataclass(frozen=True, eq=False)
class Varlen:
    """One varlen call: its sequences over the flattened rows and keys (fillers included, covering both)."""

    seqs: np.ndarray
    """Per sequence ``(q_start, q_stop, k_start, k_stop)`` in flattened rows: int64 ``[n, 4]`` (read-only; given as
    any array-like of such rows); consecutive, covering ``[0, Tq)`` and ``[0, Tk)``."""
    causal: bool
    window: Window
    """Every sequence's window (its right side ``None``, or causal)."""
    blocks: int
    """How many of the sequences are blocks (the others are fillers)."""

    def __post_init__(self) -> None:
        seqs = np.array(self.seqs, dtype=np.int64).reshape(-1, 4)
        seqs.flags.writeable = False
        object.__setattr__(self, "seqs", seqs)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Varlen):
            return NotImplemented
        return (np.array_equal(self.seqs, other.seqs) and (self.causal, self.window, self.blocks)
                == (other.causal, other.window, other.blocks))

    __hash__ = None

    @functools.cached_property
    def max_q(self) -> int:
        return int((self.seqs[:, 1] - self.seqs[:, 0]).max())

    @functools.cached_property
    def max_k(self) -> int:
        return int((self.seqs[:, 3] - self.seqs[:, 2]).max())

    @functools.cached_property
    def _boundaries(self) -> torch.Tensor:
        """``[2, n + 1]`` int32 on the CPU (built once per call plan: plans are cached, every layer reuses them)."""
        cu = np.zeros((2, len(self.seqs) + 1), dtype=np.int32)
        cu[:, 1:] = self.seqs[:, [1, 3]].T
        return torch.from_numpy(cu)

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


def chain_indices(table: BlockTable) -> tuple[list[int], list[np.ndarray]]:
    """``(singles, chains)`` as indices into the blocks of ``table``: see :func:`chains`."""
    eligible = table.causal | (table.right == UNBOUNDED)  # a bounded right side stays a call of its own (FA2)
    singles = np.flatnonzero(~eligible).tolist()
    members = np.flatnonzero(eligible)
    out: list[np.ndarray] = []
    if members.size == 0:
        return singles, out
    keys = np.stack([table.causal[members].astype(np.int64), table.left[members], table.right[members]], axis=1)
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    for group in np.argsort(first):                       # groups in the order of their first block
        idx = members[inverse == group]
        idx = idx[np.lexsort((table.k0[idx], table.q0[idx]))]      # by first row, then first key (stable)
        q0, q1, k0, k1 = (x[idx] for x in (table.q0, table.q1, table.k0, table.k1))
        if np.all(q0[1:] >= q1[:-1]) and np.all(k0[1:] >= k1[:-1]):
            found = [idx]                                 # each block after the last: first fit makes one chain
        else:
            found = _first_fit(idx.tolist(), q0.tolist(), q1.tolist(), k0.tolist(), k1.tolist())
        for c in found:
            (out.append(c) if c.size > 1 else singles.append(int(c[0])))
    return singles, out


def _first_fit(idx, q0, q1, k0, k1) -> list[np.ndarray]:
    open_chains: list[list[int]] = []          # positions into idx; each chain's last block at [-1]
    for n in range(len(idx)):
        home = next((c for c in open_chains if q0[n] >= q1[c[-1]] and k0[n] >= k1[c[-1]]), None)
        if home is None:
            open_chains.append([n])
        else:
            home.append(n)
    return [np.asarray([idx[n] for n in c], dtype=np.int64) for c in open_chains]


def chains(blocks) -> tuple[tuple[Block, ...], tuple[tuple[Block, ...], ...]]:
    """``(singles, chains)``: the blocks that run one call each, and groups of at least two blocks that can share a
    varlen call (same causal flag and window; query rows disjoint, key rows disjoint, both increasing). First fit
    over blocks sorted by their first row; every block lands in exactly one of the two."""
    blocks = tuple(blocks)
    singles, found = chain_indices(BlockTable.of(blocks))
    return tuple(blocks[i] for i in singles), tuple(tuple(blocks[i] for i in c.tolist()) for c in found)


def pack_table(table: BlockTable, chain: np.ndarray, sq: int, sk: int, batch: int) -> Varlen:
    """The varlen call of the blocks ``chain`` (indices into ``table``, a chain of :func:`chain_indices`) over
    ``batch`` samples of ``sq`` rows and ``sk`` keys (flattened sample after sample), fillers included."""
    q0, q1, k0, k1 = (x[chain] for x in (table.q0, table.q1, table.k0, table.k1))
    q_at, k_at = np.r_[0, q1[:-1]], np.r_[0, k1[:-1]]     # where the previous block (or the sample) ends
    per_block = np.stack([np.stack([q_at, q0, k_at, k_at], 1),   # rows before the block: no keys
                          np.stack([q0, q0, k_at, k0], 1),       # keys before the block: no rows
                          np.stack([q0, q1, k0, k1], 1)], 1)     # the block
    present = np.stack([q0 > q_at, k0 > k_at, np.ones_like(q0, dtype=bool)], 1)
    tail = np.array([[q1[-1], sq, k1[-1], k1[-1]], [sq, sq, k1[-1], sk]], dtype=np.int64)
    seqs = np.concatenate([per_block[present], tail[[sq > q1[-1], sk > k1[-1]]]])
    shift = np.arange(batch, dtype=np.int64)[:, None, None] * np.array([sq, sq, sk, sk], dtype=np.int64)
    c = int(chain[0])
    window = tuple(None if w == UNBOUNDED else w for w in (int(table.left[c]), int(table.right[c])))
    return Varlen((seqs[None] + shift).reshape(-1, 4), bool(table.causal[c]), window, len(chain) * batch)


def pack(chain: tuple[Block, ...], sq: int, sk: int, batch: int) -> Varlen:
    """The varlen call of ``chain`` (blocks of one :func:`chains` chain) over ``batch`` samples of ``sq`` rows and ``sk``
    keys (flattened sample after sample), fillers included."""
    return pack_table(BlockTable.of(chain), np.arange(len(chain)), sq, sk, batch)


class LoopedVarlen:
    """The varlen pair as one block call per sequence (a kernel's own ``forward``/``backward``): the reference of the
    contract, and what lets CPU runs take the varlen path that GPU kernels run in one launch."""

    def forward_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Varlen, *, scale: float,
                       softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=accum_dtype(q.dtype), device=q.device)
        for q0, q1, k0, k1 in batch.seqs.tolist():
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
        for q0, q1, k0, k1 in batch.seqs.tolist():
            if q1 > q0 and k1 > k0:
                grads = self.backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                      out[None, q0:q1], lse[None, :, q0:q1], causal=batch.causal, scale=scale,
                                      window=batch.window, softcap=softcap)
                dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0] for g in grads)
        return dq, dk, dv
