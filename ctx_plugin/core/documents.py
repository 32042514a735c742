"""Packed documents: several documents in one sequence, attention only inside each one.

A packed sequence is described by :class:`Documents`: the cumulative boundaries of the *global* sequence
(flash-attn's ``cu_seqlens``: ``bounds[0] == 0``, strictly increasing, ``bounds[-1] ==`` the sequence length) and,
optionally, how many leading tokens of each document are real (``valid``); the rest of a document is padding. Global
query ``i`` sees key ``j`` iff both lie in one document, both are real, and the causal/window rule holds
(:meth:`ctx_plugin.core.mask.Mask.allows`). A padding token sees no key and no token sees it: its output is 0 and it
gets no gradient.

Layouts that split every document over the ranks (zigzag, striped, the all-gather backend, the hybrid) need each
document to be a multiple of a unit (:func:`ctx_plugin.core.rules.document_unit`); nothing is ever padded silently.
:func:`pad_documents` pads each document at its end to a multiple of a unit (and the sequence to the layout's
unit) and says which tokens are real;
:func:`pad_tokens` builds the padded inputs and labels (``-100`` on padding, so the loss ignores it) and
:meth:`Documents.positions` the per-document position ids (restarting at 0 in each document).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100
"""The label of a padding token (PyTorch's ``cross_entropy`` default ``ignore_index``)."""


def _int_tuple(values, what: str) -> tuple[int, ...]:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"{what} must be a 1-D tensor, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer tensor (cu_seqlens, e.g. torch.int32), got {values.dtype}")
        if values.is_meta:
            raise TypeError(f"{what} is a meta tensor, which holds no values: give the boundaries on a real device")
        return tuple(int(x) for x in values.tolist())          # one read (a device tensor syncs once)
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"{what} must be a ctx_plugin.Documents, a 1-D integer tensor or a list of ints "
                        f"(cumulative lengths, flash-attn's cu_seqlens), got {type(values).__name__}")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, int):
            raise TypeError(f"{what} must hold ints, got {type(x).__name__} {x!r}")
    return tuple(values)


@dataclass(frozen=True)
class Documents:
    """The documents of one packed global sequence (checked in ``__post_init__``; hashable)."""

    bounds: tuple[int, ...]
    """Cumulative boundaries: document ``d`` holds global positions ``bounds[d] .. bounds[d + 1] − 1``."""
    valid: tuple[int, ...] | None = None
    """Per document, how many of its leading tokens are real (1 .. its length); ``None``: all of them."""

    def __post_init__(self) -> None:
        bounds = _int_tuple(self.bounds, "documents")
        if len(bounds) < 2:
            raise ValueError(f"documents must hold at least two boundaries (0 and the sequence length), got {bounds}")
        if bounds[0] != 0:
            raise ValueError(f"documents must start at 0 (cumulative lengths, like cu_seqlens), got {bounds[0]}")
        for d in range(len(bounds) - 1):
            if bounds[d + 1] <= bounds[d]:
                raise ValueError(f"documents must be strictly increasing (every document holds a token): document "
                                 f"{d} runs from {bounds[d]} to {bounds[d + 1]}")
        object.__setattr__(self, "bounds", bounds)
        if self.valid is None:
            return
        valid = _int_tuple(self.valid, "valid")
        if len(valid) != len(bounds) - 1:
            raise ValueError(f"valid must hold one count per document ({len(bounds) - 1}), got {len(valid)}")
        for d, (n, length) in enumerate(zip(valid, self.lengths)):
            if not 1 <= n <= length:
                raise ValueError(f"valid[{d}] must be between 1 and the document's length {length}, got {n}")
        object.__setattr__(self, "valid", None if valid == self.lengths else valid)

    @property
    def seq_len(self) -> int:
        return self.bounds[-1]

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    def real(self, d: int) -> int:
        """How many leading tokens of document ``d`` are real."""
        return self.bounds[d + 1] - self.bounds[d] if self.valid is None else self.valid[d]

    def document_of(self, position: int) -> int:
        """The document holding global ``position``."""
        lo, hi = 0, self.count
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.bounds[mid] <= position else (lo, mid)
        return lo

    def is_real(self, position: int) -> bool:
        d = self.document_of(position)
        return position - self.bounds[d] < self.real(d)

    def positions(self) -> torch.Tensor:
        """Per-document position ids (int64) of the global sequence: 0, 1, ... restarting in each document."""
        starts = torch.tensor(self.bounds[:-1], dtype=torch.int64)
        lengths = torch.tensor(self.lengths, dtype=torch.int64)
        return torch.arange(self.seq_len) - torch.repeat_interleave(starts, lengths)

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        """Computed once per object: plans are cached under keys that hold the documents (thousands of boundaries),
        looked up by every layer's attention call, forward and backward. Of ints only, so the same in every process
        (a pickled copy carries it)."""
        return hash((self.bounds, () if self.valid is None else self.valid))

    def signature(self) -> str:
        """16 hex digits naming ``bounds`` and ``valid`` (for the ranks' agreement; computed once per object, which
        every layer's attention call of a step shares)."""
        return self._signature

    @functools.cached_property
    def _signature(self) -> str:
        raw = repr((self.bounds, self.valid)).encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()


def check_documents(documents, seq_len: int) -> Documents:
    """``documents`` (a :class:`Documents`, a 1-D integer tensor on any device, or a list/tuple of ints: the
    cumulative lengths of the global sequence) as a :class:`Documents` over ``seq_len`` tokens; TypeError/ValueError
    naming the problem otherwise."""
    if not isinstance(documents, Documents):
        documents = Documents(_int_tuple(documents, "documents"))
    if documents.seq_len != seq_len:
        raise ValueError(f"documents must end at the global sequence length {seq_len} (the local length × ranks), "
                         f"but their last boundary is {documents.seq_len}")
    return documents


def pad_documents(lengths, unit: int, *, total_unit: int | None = None) -> tuple[Documents, torch.Tensor]:
    """Pads each document at its end to a multiple of ``unit``, and the last one further (by multiples of ``unit``)
    until the whole sequence is a multiple of ``total_unit`` (default ``unit``, which must divide it): the padded
    :class:`Documents` (``valid`` = the real lengths) and ``index``, a LongTensor mapping each padded position to its
    original token position (−1 for padding).

    ``unit, total_unit = ctx_plugin.core.rules.padding_units(config, cp)`` fit the layout: zigzag and the all-gather
    backend need documents of a multiple of 2·P, striped of P, the hybrid of 2·P/u, contiguous shards and Ulysses
    none (unit 1), and the sequence a multiple of the layout's unit. Build the padded tokens and labels with
    :func:`pad_tokens` and the position ids with :meth:`Documents.positions`."""
    for name, value in (("unit", unit), ("total_unit", unit if total_unit is None else total_unit)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    total_unit = unit if total_unit is None else total_unit
    if total_unit % unit:
        raise ValueError(f"total_unit ({total_unit}) must be a multiple of unit ({unit})")
    lengths = _int_tuple(lengths, "lengths")
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"lengths must be positive document lengths, got {lengths}")
    real = np.array(lengths, dtype=np.int64)
    padded = -(-real // unit) * unit
    padded[-1] += int(-padded.sum()) % total_unit       # a multiple of unit, since unit divides total_unit
    ends = np.cumsum(padded)
    count = int(real.sum())
    # real token t (in order) lands at t + (where its document starts padded − where it starts unpadded)
    index = np.full(int(ends[-1]), -1, dtype=np.int64)
    index[np.arange(count) + np.repeat(ends - padded - (np.cumsum(real) - real), real)] = np.arange(count)
    return Documents((0, *ends.tolist()), lengths), torch.from_numpy(index)


def pad_tokens(x: torch.Tensor, index: torch.Tensor, *, fill=0, dim: int = -1) -> torch.Tensor:
    """``x`` (the unpadded packed sequence along ``dim``) at the padded positions of :func:`pad_documents`'s
    ``index``, ``fill`` on padding: ``pad_tokens(input_ids, index)``, ``pad_tokens(labels, index,
    fill=IGNORE_INDEX)`` (the loss then skips padding). Differentiable in ``x``."""
    dim = dim % x.dim()
    real = index >= 0
    picked = x.index_select(dim, index.clamp_min(0).to(x.device))
    shape = [1] * x.dim()
    shape[dim] = index.numel()
    return torch.where(real.to(x.device).view(shape), picked, torch.as_tensor(fill, dtype=x.dtype, device=x.device))
