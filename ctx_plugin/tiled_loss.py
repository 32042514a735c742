"""Tiled logits and loss (``+tile_loss[:<tokens>]``): the LM head and cross-entropy over chunks of tokens, never
holding the whole ``[tokens, vocab]`` logits.

Each chunk runs as a non-reentrant :func:`torch.utils.checkpoint.checkpoint` of ``loss(head(hidden_chunk),
labels_chunk)``: forward keeps only the chunk's input (a view of the hidden states, which the model holds anyway)
and its loss; backward recomputes one chunk's logits at a time and autograd accumulates the head's weight (and
bias) gradient chunk by chunk. The result is the untiled loss and its gradients, up to the order of floating-point
sums. ``head`` is whatever produces the logits — an ``nn.Linear``, Hugging Face's ``lm_head`` (called as a module,
so ZeRO-3's parameter hooks run), Megatron's output layer with its vocab-parallel cross-entropy (:func:`map_chunks`
with the model's own loss function).

Chunk size: ``tokens`` when given, else :func:`auto_tokens`: as many tokens as keep one chunk's fp32 logits within
:data:`CHUNK_LOGITS_MIB` MiB (at least one token). A chunk's backward holds a few logits-sized tensors (the logits in
the model's dtype, their fp32 copy, the softmax gradient), so the loss's peak is a small multiple of that target
instead of the same multiple of the whole sequence's logits.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_LOGITS_MIB = 256
"""Memory target of the automatic chunk size: the fp32 logits of one chunk (``tokens × vocab × 4`` bytes)."""


def auto_tokens(vocab: int, *, target_mib: float = CHUNK_LOGITS_MIB) -> int:
    """Tokens per chunk whose fp32 logits (``vocab`` wide: the logits this rank computes, e.g. one tensor-parallel
    shard of the vocabulary) fit in ``target_mib`` MiB; at least 1."""
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be a positive int, got {vocab!r}")
    if isinstance(target_mib, bool) or not isinstance(target_mib, (int, float)) or not target_mib > 0:
        raise ValueError(f"target_mib must be a positive number, got {target_mib!r}")
    return max(1, int(target_mib * 2**20) // (4 * vocab))


def _check_tokens(tokens) -> None:
    if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
        raise ValueError(f"loss chunk size (+tile_loss:<tokens>) must be a positive int or None (automatic), "
                         f"got {tokens!r}")


def head_vocab(head) -> int:
    """The logits width of ``head``: ``head.weight.shape[0]`` (``nn.Linear``, Hugging Face's ``lm_head``, Megatron's
    ColumnParallelLinear shard; under DeepSpeed ZeRO-3, whose partitioned weight is empty between its gathers, the
    whole weight's ``ds_shape``). TypeError for a head without a 2-D weight: give ``tokens`` explicitly then."""
    weight = getattr(head, "weight", None)
    shape = getattr(weight, "ds_shape", None) or getattr(weight, "shape", ())
    if not isinstance(weight, torch.Tensor) or len(shape) != 2:
        raise TypeError(f"cannot tell the vocabulary of the LM head {type(head).__name__} (no 2-D .weight) to size "
                        f"the loss chunks: give the chunk size explicitly (+tile_loss:<tokens>)")
    return shape[0]


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """Logits in at least fp32 (bf16/fp16 are upcast as the untiled losses do; float64 stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _run(fn, *args):
    """One chunk: checkpointed when autograd records (the head's parameters need gradients even when the hidden
    states do not), else computed directly."""
    return checkpoint(fn, *args, use_reentrant=False) if torch.is_grad_enabled() else fn(*args)


def map_chunks(fn: Callable, hidden: torch.Tensor, labels: torch.Tensor, *, tokens: int, hidden_dim: int = 0,
               labels_dim: int = 0, out_dim: int = 0) -> torch.Tensor:
    """``fn(hidden_chunk, labels_chunk)`` over chunks of ``tokens`` positions along ``hidden_dim`` / ``labels_dim``
    (the last chunk may be shorter), each chunk checkpointed (recomputed in backward), the results concatenated
    along ``out_dim`` (``fn`` returns per-position values, e.g. Megatron's per-token losses) or, for scalar results,
    stacked into a vector of chunk values."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(hidden, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("hidden and labels must be tensors")
    _check_tokens(tokens)
    if tokens is None:
        raise ValueError("map_chunks needs the chunk size: tokens=")
    n = hidden.shape[hidden_dim]
    if labels.shape[labels_dim] != n:
        raise ValueError(f"hidden has {n} positions along dim {hidden_dim} but labels have {labels.shape[labels_dim]} "
                         f"along dim {labels_dim}")
    if n == 0:
        raise ValueError("the tiled loss got no tokens")
    # split, not narrow: one backward node concatenates the chunks' gradients; a narrow per chunk would write a
    # zero-filled gradient of the whole input for each chunk (O(n²/tokens) traffic, one more input-sized tensor)
    outs = [_run(fn, h, y) for h, y in zip(hidden.split(tokens, hidden_dim), labels.split(tokens, labels_dim))]
    return torch.stack(outs) if outs[0].dim() == 0 else torch.cat(outs, dim=out_dim)


def lm_loss_sum(hidden: torch.Tensor, labels: torch.Tensor, head: Callable, *, tokens: int | None = None,
                ignore_index: int = -100) -> torch.Tensor:
    """The token sum of ``cross_entropy(head(hidden), labels)`` (targets equal to ``ignore_index`` count nothing),
    in at least fp32, computed over chunks of ``tokens`` tokens (``None``: :func:`auto_tokens` of the head's
    vocabulary). ``hidden`` is ``[..., H]`` and ``labels`` the matching ``[...]`` integer targets (pre-shifted);
    the caller divides by its token count (e.g. the global count of targets that are not ``ignore_index``)."""
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2:
        raise TypeError(f"hidden must be a floating-point tensor [..., hidden], got "
                        f"{getattr(hidden, 'dtype', type(hidden).__name__)} {tuple(getattr(hidden, 'shape', ()))}")
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.is_complex() \
            or labels.dtype == torch.bool:
        raise TypeError(f"labels must be an integer tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels {tuple(labels.shape)} must match hidden {tuple(hidden.shape)} without its last "
                         f"dimension")
    if not callable(head):
        raise TypeError(f"head must be callable (the LM head), got {type(head).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    _check_tokens(tokens)
    if tokens is None:
        tokens = auto_tokens(head_vocab(head))

    def chunk_loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(upcast(head(h)), y, ignore_index=ignore_index, reduction="sum")

    return map_chunks(chunk_loss, hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), tokens=tokens).sum()
