"""The transient buffers of one context-parallel attention call at its backward's peak, bytes per rank.

Counted as a GPU holds them: every buffer the backward allocates and frees before it returns, at the worst moment
of the call. The gradients it returns (the layer's dq, dk, dv) are the layer's and not counted here. Held to the
byte on CPU with simulated ranks and a stand-in kernel whose backward allocates exactly its gradients
(``tests/unit/test_memory_cp_buffers.py``), leaving out what only a CPU allocates (an in-place add of bf16 into
fp32 converts its operand first; CUDA casts inside the kernel). On CUDA the kernel's own backward workspace is
added, bounded by FlashAttention-2's: an fp32 dQ accumulator and, under GQA, dK/dV for every query head before it
sums them (torch's flash kernel and flash-attn 2; cuDNN's accumulator is no larger).

The moments, per backend (``t`` tokens of this rank, causal attention):

* all-gather: the gathered K/V, their full dK/dV sum (fp32), dq (fp32) and the largest query chunk's kernel
  gradients (half the rows against every key); the gathered K/V and the last chunk's gradients are freed before the
  sum is reordered (sum + its sharded copy, always less).
* ring family (``ring`` ranks, ``rows`` = ``t``·Ulysses ranks): dq and three dK/dV buffers (fp32: this step's sum,
  the one in flight, the incoming; the last hop home reuses the incoming), with one packed K/V receive buffer at the
  first step and its own diagonal block's kernel gradients, then two buffers (one on a ring of two) and a later
  block's (zigzag: half the rows or half the keys); under Ulysses also the head-sharded dout, and at the end the
  ring's head-sharded gradients in the inputs' dtype.
* Ulysses (all-to-all): dout's all-to-all (its send and receive copies, and for a micro batch > 1 the reordered
  copy); the ring's moments with the head-sharded dout; then each gradient's all-to-all back (v, k, q: autograd
  runs the last-created first) next to the head-sharded gradients not yet sent: its send copy (micro batch > 1: a
  contiguous one) and its receive buffer (kept only when more than one head per rank needs a reordered copy, or
  when replicated K/V heads are summed afterwards).

In fp32 (fp64) training the fp32 accumulators are the gradients themselves (``.to`` returns them): where the ring
or the all-gather returns them they are the layer's, not counted; under Ulysses they are the head-sharded gradients.
"""
from __future__ import annotations

from ..names import Backend
from .specs import ModelSpec, ParallelSpec


def cp_buffers(m: ModelSpec, p: ParallelSpec, t: int, seq_len: int, micro_batch: int, e: int, acc: int,
               device: str = "cuda") -> int:
    """Bytes per rank (see the module docstring); ``e``/``acc``: bytes of the inputs' and the accumulators' dtype.
    At CP 1 only the kernel's workspace (its gradients are the layer's)."""
    d, u = m.head_dim, p.ulysses
    heads, kv = m.heads // p.tp, max(m.kv_heads // p.tp, 1)

    def workspace(q_rows: int, k_rows: int, q_heads: int, kv_heads: int) -> int:
        if device != "cuda":
            return 0
        expanded = 2 * k_rows * q_heads * d * e if kv_heads < q_heads else 0
        return q_rows * q_heads * d * acc + expanded

    def kernel(q_rows: int, k_rows: int, q_heads: int, kv_heads: int) -> int:
        """A kernel call's gradients (dq, dk, dv in the inputs' dtype) and its workspace."""
        return (q_rows * q_heads + 2 * k_rows * kv_heads) * d * e + workspace(q_rows, k_rows, q_heads, kv_heads)

    if p.cp == 1:
        return workspace(t, t, heads, kv)
    same = e == acc         # fp32 (fp64) inputs: the accumulators are the gradients (``.to`` returns them)
    if p.backend == Backend.ALLGATHER:
        full_kv = 2 * micro_batch * seq_len * kv * d        # elements of every rank's K and V
        dq = 0 if same else t * heads * d * acc
        return full_kv * e + full_kv * acc + dq + kernel(t // 2, micro_batch * seq_len, heads, kv)
    kv_all = max(kv, u) if u > 1 else kv                    # K/V heads through the all-to-all (replicated to u)
    rows, q_heads, kv_heads = t * u, heads // u, kv_all // u
    dout_h = rows * q_heads * d * e if u > 1 else 0
    grads_h = rows * (q_heads + 2 * kv_heads) * d * e       # the ring's gradients, head-sharded
    ring = p.cp // u
    if ring > 1:
        kv_block = 2 * rows * kv_heads * d
        returned = same and u == 1          # dq's accumulator and the dK/dV buffer that goes home are the result
        fixed = dout_h + (0 if returned else rows * q_heads * d * acc) + (2 if returned else 3) * kv_block * acc
        whole = kernel(rows, rows, q_heads, kv_heads)
        later = whole if p.backend in (Backend.RING, Backend.STRIPED) else \
            max(kernel(rows, rows // 2, q_heads, kv_heads), kernel(rows // 2, rows, q_heads, kv_heads))
        held = (1 if ring == 2 else 2) * kv_block * e
        inner = fixed + max(kv_block * e + whole, held + later, held + (grads_h if u > 1 and not same else 0))
    else:
        inner = dout_h + kernel(rows, rows, q_heads, kv_heads)
    if u == 1:
        return inner
    return max(inner, _all_to_alls(t * d * e, heads, kv, kv_all, u, micro_batch, grads_h))


def _all_to_alls(token_head: int, heads: int, kv: int, kv_all: int, u: int, micro_batch: int, grads_h: int) -> int:
    """The Ulysses all-to-alls' moments: dout's, then the gradients' back (``token_head``: bytes of one head over
    the rank's tokens)."""
    copies = 3 if micro_batch > 1 else 2            # send, receive (and the reordered copy)
    worst, left = copies * heads * token_head, grads_h
    for name, h in (("v", kv_all), ("k", kv_all), ("q", heads)):
        size = h * token_head                        # the sequence-sharded gradient
        send = size if micro_batch > 1 else 0        # a batch of one is sent as it is
        summed = name != "q" and kv_all > kv         # replicated heads: the all-to-all's result is summed after
        recv = size if h // u > 1 or summed else 0
        worst = max(worst, left + send + recv)
        left -= size                                 # its head-sharded gradient, sent
    return worst
