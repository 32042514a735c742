"""The attention's work in a packed sequence: the (query, key) pairs its documents hold, padding included.

Every attention FLOP count of the memory model (``recompute_fraction``) and the planner (step time, MFU) comes from
:func:`pack`: one layer's attention forward on one rank is ``4 · pairs · (heads/tp) · head_dim · t / seq_len``
FLOPs (2 for the scores, 2 for the values; ``t = micro_batch · seq_len / cp`` tokens per rank), backward 2.5× that.

Pairs, counted exactly (the diagonal included). A document of ``n`` real tokens holds ``n(n+1)/2`` causal pairs
(``n²`` without the causal mask); with a causal sliding window of ``w`` tokens back (``window=(w, 0)``) it holds
``n(w+1) − w(w+1)/2`` when ``w < n``. Attention never crosses documents, so a sequence holds the sum over its
documents: a sequence of one document is the plain causal ``S(S+1)/2``. These are the pairs the ring's plans
compute (:func:`ctx_plugin.core.layouts.rank_work` summed over ranks, ``tests/unit/test_plan_documents.py``).

**Which documents.** The planner does not know a batch's documents, only their lengths:

* ``None``: one document, the whole sequence (no packing).
* a mean length ``m`` (an int): documents of ``m`` tokens each fill the sequence one after another and the last one
  is cut at its end. *Assumption: equal lengths.* For a mix with the same mean the pairs are at least as many
  (Σ n² is smallest when the lengths are equal), so a mean length predicts a lower bound of the attention's work;
  give the lengths for a skewed mix.
* lengths ``(n₁, …, n_k)``: the documents in this order, repeated until the sequence is full, the last one cut.

**Padding.** A layout that splits every document over the ranks (zigzag, striped, the hybrid, the all-gather
backend) needs each document to be a multiple of its document unit ``u`` (:func:`ctx_plugin.core.rules.padding_units`),
so each document is padded at its end to a multiple of ``u`` — up to ``u − 1`` tokens, as
:func:`ctx_plugin.core.documents.pad_documents` does — and the padded documents fill the sequence. A document cut at the
sequence's end is cut to the room left (a multiple of ``u`` when the sequence is: it needs no padding). Padding
tokens hold no pairs (the plans trim every block to real tokens) but run through the layer's projections and MLP,
and they take activation memory like any token: the memory model's bytes do not change with documents (every
saved tensor, LSE included, is per token), ``seq_len`` counts the padding.
"""
from __future__ import annotations

import functools
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

BACKWARD = 2.5
"""Backward attention FLOPs relative to forward (flash-style: the kernel recomputes the scores); the memory model's
step and the planner's times."""


def check_documents(documents) -> tuple[int, ...] | None:
    """``documents`` (None, a mean length, or a list/tuple of lengths) as a tuple of lengths (a mean length ``m``
    is ``(m,)``) or None; TypeError/ValueError naming the problem otherwise."""
    if documents is None:
        return None
    if isinstance(documents, int) and not isinstance(documents, bool):
        documents = (documents,)
    if not isinstance(documents, (list, tuple)):
        raise TypeError(f"documents must be None, a mean document length (int) or a list of lengths, got "
                        f"{type(documents).__name__}")
    if not documents:
        raise ValueError("documents must hold at least one length")
    for n in documents:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"document lengths must be ints, got {type(n).__name__} {n!r}")
        if n < 1:
            raise ValueError(f"document lengths must be >= 1 token, got {n}")
    return tuple(documents)


def document_pairs(n: int, *, causal: bool = True, window: int | None = None) -> int:
    """(query, key) pairs of one document of ``n`` real tokens: ``n(n+1)/2`` causal, ``n²`` not; a causal window of
    ``window`` tokens back keeps ``n(w+1) − w(w+1)/2`` of them when ``w < n``."""
    if not causal:
        if window is not None:
            raise ValueError("a window without the causal mask is not modelled; give causal=True")
        return n * n
    if window is not None and window < n:
        return n * (window + 1) - window * (window + 1) // 2
    return n * (n + 1) // 2


@dataclass(frozen=True)
class Packing:
    """What fills one sequence (or its first ``seq_len`` positions) under the rule of the module docstring."""

    seq_len: int
    """Positions covered (real and padding tokens)."""
    pairs: int
    """(query, key) pairs the attention computes: the sum over documents."""
    real_tokens: int
    """Positions that hold real tokens (the rest is padding)."""
    documents: int
    """Documents that start in the positions covered."""

    @property
    def padding(self) -> int:
        return self.seq_len - self.real_tokens


@functools.lru_cache(maxsize=64)
def _cycle(lengths: tuple[int, ...], unit: int, causal: bool, window: int | None):
    """Prefix sums over one round of ``lengths``: padded positions, real tokens, pairs."""
    padded = [-(-n // unit) * unit for n in lengths]
    return (list(accumulate(padded, initial=0)), list(accumulate(lengths, initial=0)),
            list(accumulate((document_pairs(n, causal=causal, window=window) for n in lengths), initial=0)))


def pack(seq_len: int, documents=None, *, unit: int = 1, causal: bool = True, window: int | None = None) -> Packing:
    """The documents ``documents`` (see the module docstring) fill the first ``seq_len`` positions of a sequence,
    each padded to a multiple of ``unit``: their pairs, real tokens and count. A document that the end cuts keeps
    its first tokens and counts as a document of that many (causal: its queries see only keys before ``seq_len``
    anyway, so ``pack(b).pairs − pack(a).pairs`` are the pairs of the queries at positions ``a .. b − 1``)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0, got {seq_len!r}")
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
        raise ValueError(f"unit must be an int >= 1, got {unit!r}")
    lengths = check_documents(documents)
    if lengths is None:
        return Packing(seq_len, document_pairs(seq_len, causal=causal, window=window), seq_len, int(seq_len > 0))
    starts, reals, pairs = _cycle(lengths, unit, causal, window)
    rounds, rest = divmod(seq_len, starts[-1])
    i = bisect_right(starts, rest) - 1              # whole documents of the last round
    cut = min(rest - starts[i], lengths[i]) if i < len(lengths) else 0
    return Packing(seq_len=seq_len,
                   pairs=rounds * pairs[-1] + pairs[i] + document_pairs(cut, causal=causal, window=window),
                   real_tokens=rounds * reals[-1] + reals[i] + cut,
                   documents=rounds * len(lengths) + i + (rest > starts[i]))


def contiguous_rank_pairs(seq_len: int, cp: int, documents=None, *, window: int | None = None) -> list[int]:
    """Per rank of a contiguous split over ``cp`` ranks (rank ``r`` holds positions ``r·S/cp .. (r+1)·S/cp − 1``,
    the documents cut at the rank boundaries), the causal pairs of its queries: the work of ``ring``'s ranks
    (causal only: a causal query sees no key after it, so the pairs before a position are a prefix's)."""
    n = seq_len // cp
    edges = [pack(r * n, documents, window=window).pairs for r in range(cp + 1)]
    return [b - a for a, b in zip(edges, edges[1:])]


def describe(documents) -> str:
    """``one document per sequence``, ``documents of 4,096 tokens`` or ``3 document lengths (mean 1,365.3), in
    order, repeated``: how the planner fills its sequence."""
    lengths = check_documents(documents)
    if lengths is None:
        return "one document per sequence"
    if len(lengths) == 1:
        return f"documents of {lengths[0]:,} tokens filling the sequence (equal lengths assumed)"
    return (f"{len(lengths):,} document lengths (mean {sum(lengths) / len(lengths):,.1f} tokens) filling the sequence "
            f"in order, repeated")
