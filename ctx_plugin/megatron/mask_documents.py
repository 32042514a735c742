"""Megatron's ``--reset-attention-mask`` batches as packed documents (megatron-core's THD format).

With ``--reset-attention-mask`` Megatron's GPT dataset (``_get_ltor_masks_and_position_ids``) splits every sample
after each end-of-document token and builds a block-diagonal causal ``attention_mask`` (bool ``[b, 1, s, s]``, True
= masked) that Megatron's local attention applies. ctx_plugin's batch sharder sees that whole mask on every
context-parallel rank and reads the documents from it (:func:`mask_documents`): the mask is exactly what Megatron's
attention would apply, whatever built it, while the end-of-document tokens are not (Megatron's dataset maps padding
to token 0 after building the mask, a custom dataset may split elsewhere, and without the mask Megatron's own
attention attends across documents). Every entry of the mask is checked against the documents read from it.

:func:`packed_batch` then flattens the batch to one packed sequence ``[1, b·s]`` whose documents are every sample's
documents in turn (a sample's end always ends a document), with their global boundaries as ``cu_seqlens``
(``[1, n + 1]``, int32) and ``max_seqlen``: the form ``flatten_batch_for_packed_sequences`` gives Megatron's own
packed batches, from which Megatron-LM's ``forward_step`` builds ``PackedSeqParams(qkv_format="thd")``, which
ctx_plugin's core attention honours (attention inside each document). Position ids are kept as the dataset made
them (restarted with ``--reset-position-ids``, counting over the sample without), which is what learned absolute
position embeddings read; megatron-core's THD RoPE restarts positions in each document, and since attention stays
inside documents and RoPE's scores depend only on the distance between query and key, that is Megatron's RoPE over
the whole sample, with or without ``--reset-position-ids`` (the same scores; cos/sin rounded at other angles).

:class:`PackedHandoff` is the entry point's guard that the packed batch reaches the model as packed: a script that
ignored the returned ``cu_seqlens`` would attend across documents and samples.
"""
from __future__ import annotations

import math

import torch

from ..core.config import CPConfig
from ..core.documents import Documents, pad_documents, pad_tokens
from ..core.layouts import shard_layout
from ..core.rules import document_unit, padding_units

METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")
"""Keys of Megatron's batch that are not along the sequence (megatron-core 0.19's get_batch_on_this_cp_rank)."""


def check_mask_format(mask) -> None:
    """Megatron's convention: bool ``[b|1, 1, s, s]``, True where a query (row) must not see a key (column)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 \
            or mask.shape[2] != mask.shape[3]:
        raise ValueError(f"attention_mask must be Megatron's bool [batch, 1, seq, seq] mask, got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")


def block_causal(bounds: tuple[int, ...], device=None) -> torch.Tensor:
    """The ``[s, s]`` bool mask (True = masked) of causal attention inside the documents ``bounds`` (0 .. s)."""
    lengths = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])])
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(device)
    s = bounds[-1]
    return torch.ones(s, s, dtype=torch.bool, device=device).triu_(1) | (doc[:, None] != doc[None, :])


def mask_documents(mask: torch.Tensor) -> list[tuple[int, ...]]:
    """Per row of Megatron's ``attention_mask`` (``[b|1, 1, s, s]``), the boundaries ``(0, ..., s)`` of the documents
    whose block-diagonal causal mask it is: a document starts at every query that cannot see the key just before it.
    ``(0, s)`` for the plain causal mask. ValueError naming the first entry that no such mask has (padding or
    arbitrary masks, which ctx_plugin's attention does not apply)."""
    check_mask_format(mask)
    s = mask.shape[-1]
    starts = mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)          # [b, s-1]: query i+1 cannot see key i
    found = []
    for row in range(mask.shape[0]):
        bounds = (0, *(starts[row].nonzero().flatten() + 1).tolist(), s)
        expected = block_causal(bounds, mask.device)
        if not torch.equal(mask[row, 0], expected):
            q, k = (int(i) for i in (mask[row, 0] != expected).nonzero()[0])
            raise ValueError(f"attention_mask row {row} is neither Megatron's causal mask nor its block-diagonal "
                             f"causal mask of documents (--reset-attention-mask): query {q} "
                             f"{'may not' if mask[row, 0, q, k] else 'may'} see key {k}; ctx_plugin's attention "
                             f"applies causal masks inside documents only (no padding or arbitrary masks)")
        found.append(bounds)
    return found


def document_padding(config: CPConfig, cp: int, *, tp: int = 1, sequence_parallel: bool = False) -> tuple[int, int]:
    """``(document unit, sequence unit)`` for :func:`packed_batch`'s ``pad``: every document padded to the layout's
    document unit, the packed sequence to the layout's sequence unit and, with sequence parallelism, to a multiple of
    CP × TP (each tensor-parallel rank then holds an equal share of every context-parallel rank's tokens)."""
    unit, total = padding_units(config, cp)
    return unit, math.lcm(total, cp * tp if sequence_parallel else 1)


def packed_batch(batch: dict, rows: list[tuple[int, ...]], pad: tuple[int, int] | None = None) -> dict:
    """The batch (``[b, s]`` tensors along the sequence) as one packed sequence ``[1, b·s]`` with every row's
    documents ``rows`` (one tuple of boundaries per row, or one for all) as global ``cu_seqlens`` and
    ``max_seqlen``, without ``attention_mask`` (the documents replace it).

    ``pad=(unit, total_unit)`` (:func:`document_padding`; ``--cp-pad-documents``) pads every document at its end to a
    multiple of ``unit`` and the last one further until the packed sequence is a multiple of ``total_unit``: padding
    tokens are 0 in every tensor (token 0, label 0, out of the loss, position 0); ``cu_seqlens`` then holds the real
    lengths' cumulative sums and ``cu_seqlens_padded`` the padded boundaries (Transformer Engine's convention, which
    :func:`ctx_plugin.megatron.spec.batch_documents` reads). A real token never sees padding (it follows the real
    tokens of its document), so the real tokens' outputs, and the loss over them, are those without padding."""
    shapes = {key: tuple(v.shape[:2]) for key, v in batch.items()
              if key not in METADATA_KEYS and key != "attention_mask" and isinstance(v, torch.Tensor)}
    if not shapes:
        raise ValueError("the batch holds no tensor along the sequence (tokens, labels, ...) to pack")
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"the batch's tensors along the sequence must share their [batch, seq] shape, got {shapes}")
    b, s = next(iter(shapes.values()))
    if len(rows) not in (1, b) or any(r[-1] != s for r in rows):
        raise ValueError(f"attention_mask describes {len(rows)} rows of {rows[0][-1]} tokens, but the batch holds "
                         f"{b} rows of {s}")
    bounds = [0]
    for row in range(b):
        bounds += [row * s + x for x in (rows[row] if len(rows) > 1 else rows[0])[1:]]
    lengths = [y - x for x, y in zip(bounds, bounds[1:])]
    device = next(v.device for v in batch.values() if isinstance(v, torch.Tensor))
    padded, index = pad_documents(lengths, pad[0], total_unit=pad[1]) if pad is not None else (None, None)
    packed = {}
    for key, value in batch.items():
        if key in METADATA_KEYS:
            if value is not None:
                raise ValueError(f"the batch carries both an attention_mask of documents and {key}; give one")
        elif key == "attention_mask" or value is None:
            packed[key] = None
        elif not isinstance(value, torch.Tensor):
            raise ValueError(f"batch[{key!r}] is a {type(value).__name__}, not a tensor along the sequence")
        else:
            packed[key] = value.reshape(1, b * s, *value.shape[2:])
            if index is not None:
                packed[key] = pad_tokens(packed[key], index, dim=1)
    packed.update(cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device)[None], cu_seqlens_padded=None,
                  max_seqlen=torch.tensor([max(lengths)], dtype=torch.int32, device=device))
    if padded is not None:
        packed.update(cu_seqlens_padded=torch.tensor(padded.bounds, dtype=torch.int32, device=device)[None],
                      max_seqlen=torch.tensor([max(padded.lengths)], dtype=torch.int32, device=device))
    for key in ("local_cp_size", "hybrid_cp_group"):
        packed.setdefault(key, None)
    return packed


def documents_of_mask(batch: dict, pad: tuple[int, int] | None = None) -> dict | None:
    """``batch`` as a packed batch (:func:`packed_batch`) when its ``attention_mask`` is the block-diagonal causal mask
    of several documents in some row; None when it has no mask, is already packed (``cu_seqlens``), or its mask is
    the plain causal one (which ctx_plugin's attention applies without documents)."""
    mask = batch.get("attention_mask")
    if mask is None or batch.get("cu_seqlens") is not None:
        return None
    rows = mask_documents(mask)
    if all(len(r) == 2 for r in rows):
        return None
    return packed_batch(batch, rows, pad)


def check_mask_documents_fit(config: CPConfig, documents: Documents, cp: int, *, seq_len: int,
                             dataset: bool = False) -> None:
    """ValueError naming the first document of a packed batch (``seq_len`` tokens a sample) whose length the layout
    cannot split over ``cp`` ranks (:func:`ctx_plugin.core.rules.document_unit`), and the fix; before any communication,
    from the batch every context-parallel rank holds, so every rank raises it. The documents come from
    ``--reset-attention-mask``'s mask, or (``dataset``) from the dataset's own ``cu_seqlens``
    (``--dataloader-inter-document-masking``, ``--sft``)."""
    unit = document_unit(config, cp)
    for start, length in zip(documents.bounds, documents.lengths):
        if length % unit:
            if dataset:
                source = ("--dataloader-inter-document-masking/--sft: the dataset's", "Megatron's GPTDataset ends "
                          "documents at any token")
                fix = (f"pad every document to a multiple of {unit} in the data (Megatron's SFT dataset pads to 2 × "
                       f"--context-parallel-size), or use --reset-attention-mask with --cp-pad-documents (ctx_plugin "
                       f"pads each document, out of the loss)")
            else:
                source = ("--reset-attention-mask: the", "end-of-document tokens fall anywhere")
                fix = f"or --cp-pad-documents (pads each document at its end to a multiple of {unit}, out of the loss)"
            raise ValueError(
                f"{source[0]} document at token {start % seq_len} of sample {start // seq_len} holds {length} tokens, "
                f"not a multiple of {unit}: --cp-backend {config.backend} over --context-parallel-size {cp} splits "
                f"every document over the ranks ({shard_layout(config).name} layout), and {source[1]}; use "
                f"--cp-backend ring or ulysses (documents cut anywhere; with --position-embedding-type "
                f"learned_absolute or none), {fix}")


class PackedHandoff:
    """The entry point's check that a batch :func:`packed_batch` made reaches the model with its documents as
    ``PackedSeqParams`` (Megatron-LM's ``forward_step`` builds them from the returned ``cu_seqlens``). The batch
    sharder calls :meth:`expect` with the documents of each packed batch it returns, the model's forward
    :meth:`receive` with its ``packed_seq_params``; one process, one batch at a time."""

    def __init__(self) -> None:
        self._pending: Documents | None = None

    def expect(self, documents: Documents) -> None:
        self._pending = documents

    def receive(self, packed_seq_params) -> None:
        """ValueError when the last packed batch reaches the model without ``packed_seq_params``, or with other
        documents."""
        expected, self._pending = self._pending, None
        if expected is None:
            return
        if packed_seq_params is None:
            raise ValueError("ctx_plugin's batch sharder packed a --reset-attention-mask batch into megatron-core's THD "
                             "form (one sequence [1, batch·seq] with the documents as cu_seqlens and max_seqlen), but "
                             "the model was called without packed_seq_params: it would attend across documents and "
                             "samples. Build PackedSeqParams(qkv_format='thd', cu_seqlens_q=cu_seqlens, ...) from the "
                             "batch as Megatron-LM's pretrain_gpt.py forward_step does, or drop --reset-attention-mask")
        from .core_attention import packed_documents

        got = packed_documents(packed_seq_params)
        if got.bounds != expected.bounds:
            raise ValueError(f"the model got packed_seq_params with documents {got.bounds}, but ctx_plugin's batch "
                             f"sharder packed the batch with documents {expected.bounds}; build PackedSeqParams from "
                             f"the batch's cu_seqlens (as Megatron-LM's pretrain_gpt.py forward_step does)")
