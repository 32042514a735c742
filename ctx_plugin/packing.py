"""Packed batches for the trainers' data paths: documents found in a packed batch, the labels of a packed
sequence, padding every document to the layout's unit, and the documents transformers' attention keywords describe.

A packed causal-LM batch holds several documents in one sequence; its ``position_ids`` restart at 0 in each one
(Hugging Face's ``DataCollatorWithFlattening``) or it comes with the global cumulative lengths (``cu_seq_lens_q``,
flash-attn's ``cu_seqlens``). :func:`documents_of_batch` reads either into a
:class:`~ctx_plugin.core.documents.Documents` (the same for every row of the batch), :func:`pad_packed_batch` pads each document to the layout's unit (only when
asked: nothing is padded silently) and :func:`shift_labels` makes the next-token targets of a packed sequence (the
last token of every document has none: ``-100``, never the next document's first token).
"""
from __future__ import annotations

import torch

from .core.documents import IGNORE_INDEX, Documents, check_documents, pad_documents, pad_tokens

DOCUMENTS_KEYWORD = "ctx_plugin_documents"
"""The model keyword (passed down to the attention function) that carries a batch's :class:`Documents`."""
HF_DOCUMENT_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""transformers' attention keywords for packed sequences (``FlashAttentionKwargs``)."""
SEQ_IDX = "seq_idx"
"""``DataCollatorWithFlattening(return_seq_idx=True)``'s per-token document index (for state-space layers)."""


def documents_from_positions(position_ids: torch.Tensor) -> Documents | None:
    """The documents of a packed sequence from its position ids (``[seq]`` or ``[batch, seq]`` with equal rows):
    each document numbers its tokens 0, 1, ...; ``None`` when the positions are ``0 .. seq - 1`` (one document).
    ValueError when they are neither (rows that differ, or a jump that is not a restart at 0)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2):
        raise ValueError(f"position_ids must be a [seq] or [batch, seq] tensor, got "
                         f"{tuple(getattr(position_ids, 'shape', ())) or type(position_ids).__name__}")
    rows = position_ids.reshape(-1, position_ids.shape[-1]).cpu()
    if not bool((rows == rows[:1]).all()):
        raise ValueError("packed batches must pack their documents identically in every row (one Documents per "
                         "batch, like DataCollatorWithFlattening's single row): give one row per batch or rows with "
                         "the same position_ids")
    pos = rows[0]
    starts = pos == 0
    follows = torch.ones_like(starts)
    follows[1:] = pos[1:] == pos[:-1] + 1
    if pos.numel() == 0 or not bool(starts[0]) or not bool((starts | follows).all()):
        bad = 0 if pos.numel() == 0 or not bool(starts[0]) else int((~(starts | follows)).nonzero()[0])
        raise ValueError(f"position_ids must count 0, 1, ... within each packed document (a document starts at 0), "
                         f"but position {bad} holds {pos[bad].item() if pos.numel() else 'nothing'}")
    bounds = (*starts.nonzero().flatten().tolist(), pos.numel())
    return None if len(bounds) == 2 else Documents(tuple(bounds))


def documents_from_seq_idx(seq_idx: torch.Tensor) -> Documents:
    """The documents of a packed sequence from its per-token document indices (``DataCollatorWithFlattening(
    return_seq_idx=True)``'s ``seq_idx``, ``[seq]`` or ``[batch, seq]`` with equal rows): a document starts where the
    index grows. ValueError for rows that differ or an index that falls back."""
    if not isinstance(seq_idx, torch.Tensor) or seq_idx.dim() not in (1, 2) or seq_idx.shape[-1] == 0:
        raise ValueError(f"seq_idx must be a non-empty [seq] or [batch, seq] tensor, got "
                         f"{tuple(getattr(seq_idx, 'shape', ())) or type(seq_idx).__name__}")
    rows = seq_idx.reshape(-1, seq_idx.shape[-1]).cpu()
    if not bool((rows == rows[:1]).all()):
        raise ValueError("packed batches must pack their documents identically in every row: the rows of seq_idx "
                         "differ")
    idx = rows[0]
    if bool((idx[1:] < idx[:-1]).any()):
        raise ValueError("seq_idx must number the packed documents in order (a document starts where it grows), "
                         f"but it falls back at position {int((idx[1:] < idx[:-1]).nonzero()[0]) + 1}")
    starts = (idx[1:] != idx[:-1]).nonzero().flatten() + 1
    return Documents((0, *starts.tolist(), idx.numel()))


def documents_of_batch(batch: dict) -> Documents | None:
    """The packed documents of a global batch (before sharding): its ``documents`` entry (:class:`Documents` or
    cumulative lengths), else its ``cu_seq_lens_q`` (equal to ``cu_seq_lens_k`` when given), else restarts in its
    ``position_ids``, else its ``seq_idx`` (:func:`documents_from_seq_idx`); ``None`` for an unpacked batch. The
    sources given must agree."""
    seq = batch["input_ids"].shape[1]
    found = []
    if batch.get("documents") is not None:
        found.append(("documents", check_documents(batch["documents"], seq)))
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        found.append(("cu_seq_lens_q", _cu_documents(cu_q, cu_k, seq)))
    if batch.get("position_ids") is not None:
        found.append(("position_ids", documents_from_positions(batch["position_ids"])
                      or Documents((0, seq))))
    if batch.get(SEQ_IDX) is not None:
        found.append((SEQ_IDX, check_documents(documents_from_seq_idx(batch[SEQ_IDX]), seq)))
    if not found:
        return None
    (name, docs), *others = found
    for other, theirs in others:
        if theirs.bounds != docs.bounds:
            raise ValueError(f"the batch's {name} and {other} describe different documents: {docs.bounds} and "
                             f"{theirs.bounds}")
    return None if docs.count == 1 and docs.valid is None else docs


def _cu_documents(cu_q, cu_k, seq_len: int) -> Documents:
    if cu_q is None or cu_k is None:
        raise ValueError("packed self-attention needs cu_seq_lens_q and cu_seq_lens_k together (the same documents "
                         "for queries and keys)")
    docs = check_documents(cu_q, seq_len)
    if check_documents(cu_k, seq_len).bounds != docs.bounds:  # read alike: a tensor and a list of the same ints agree
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: ctx_plugin runs self-attention over packed "
                         "documents, where queries and keys share their documents")
    return docs


def hf_documents(kwargs: dict, seq_len: int) -> Documents | None:
    """The documents transformers' attention keywords describe for a global sequence of ``seq_len`` tokens:
    ``ctx_plugin_documents`` (a :class:`Documents`) and/or the *global* ``cu_seq_lens_q``/``cu_seq_lens_k`` (equal;
    ``max_length_q``/``max_length_k``, when given, the longest document); ``None`` when none is given."""
    docs = kwargs.get(DOCUMENTS_KEYWORD)
    if docs is not None and not isinstance(docs, Documents):
        raise ValueError(f"{DOCUMENTS_KEYWORD} must be a ctx_plugin.Documents, got {type(docs).__name__}")
    if docs is not None:
        docs = check_documents(docs, seq_len)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        cu = _cu_documents(cu_q, cu_k, seq_len)
        if docs is not None and docs.bounds != cu.bounds:
            raise ValueError(f"{DOCUMENTS_KEYWORD} and cu_seq_lens_q describe different documents: {docs.bounds} and "
                             f"{cu.bounds}")
        docs = docs or cu
    for name in ("max_length_q", "max_length_k"):
        given = kwargs.get(name)
        if given is None:
            continue
        if docs is None:
            raise ValueError(f"{name}={given} without cu_seq_lens_q/cu_seq_lens_k: give the packed documents too")
        if int(given) != max(docs.lengths):
            raise ValueError(f"{name}={int(given)} but the longest document of cu_seq_lens_q holds "
                             f"{max(docs.lengths)} tokens: under context parallelism cu_seq_lens_* and max_length_* "
                             f"describe the whole (global) packed sequence, not this rank's shard")
    return docs


def shift_labels(labels: torch.Tensor, documents: Documents | None) -> torch.Tensor:
    """Next-token targets ``[batch, seq]`` of a global batch: ``labels`` one token left, ``-100`` at the end and, with
    packed ``documents``, from every document's last real token on (its next token belongs to another document, and
    padding has no target)."""
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)
    if documents is None:
        return shifted
    target = torch.zeros(documents.seq_len, dtype=torch.bool)
    for d in range(documents.count):
        target[documents.bounds[d]:documents.bounds[d] + documents.real(d) - 1] = True
    return shifted.masked_fill(~target.to(labels.device), IGNORE_INDEX)


def pad_packed_batch(batch: dict, documents: Documents, unit: int, total_unit: int) -> tuple[dict, Documents]:
    """Pads every document of a packed global batch at its end to a multiple of ``unit`` (the sequence to a multiple
    of ``total_unit``; ``ctx_plugin.core.rules.padding_units``): ``input_ids`` with 0, ``labels`` with ``-100``,
    ``position_ids`` counting on inside each document, other per-token tensors with 0 (a loss mask: padding excluded).
    Returns the padded batch and its :class:`Documents` (``valid`` = the real lengths; attention skips padding)."""
    if documents.valid is not None:
        raise ValueError("this batch's documents are padded already")
    padded, index = pad_documents(documents.lengths, unit, total_unit=total_unit)
    seq = batch["input_ids"].shape[1]
    out = {}
    for key, value in batch.items():
        if key in ("documents", *HF_DOCUMENT_KEYWORDS):
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq:
            out[key] = pad_tokens(value, index, fill=IGNORE_INDEX if key == "labels" else 0, dim=1)
        else:
            out[key] = value
    out["position_ids"] = padded.positions().to(batch["input_ids"].device).expand(batch["input_ids"].shape[0], -1)
    return out, padded
