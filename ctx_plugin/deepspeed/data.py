"""Batches and losses of a DeepSpeed engine made by :func:`ctx_plugin.deepspeed.initialize`: each rank's shard of a
causal-LM batch, the loader that gives them, and the global token-mean loss (whole logits, or tiled with
``+tile_loss``)."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..core.api import shard_sequence
from ..core.groups import CPGroups
from ..core.rules import SettingNames, check_documents_fit, padding_units
from ..hf import loss as hf_loss
from ..packing import (DOCUMENTS_KEYWORD, HF_DOCUMENT_KEYWORDS, SEQ_IDX, documents_of_batch, pad_packed_batch,
                       shift_labels)
from ..recompute import RecomputeConfig
from ..tiled_loss import lm_loss_sum, upcast
from .config import SECTION

def shard_batch(batch: dict, groups: CPGroups, *, pad_documents: bool = False) -> dict:
    """This rank's part of a causal-LM batch: ``input_ids``, ``position_ids`` (made when absent), ``labels``
    shifted one token left (the last target ignored) *before* sharding, every other per-token tensor (e.g. a
    loss mask, ``[batch, seq, ...]``) sharded as it is, and an all-ones ``attention_mask`` dropped (padding is
    refused). Per-sample values pass through.

    A packed batch — several documents in one sequence: ``position_ids`` that restart at 0 in each (Hugging Face's
    ``DataCollatorWithFlattening``), ``cu_seq_lens_q``/``cu_seq_lens_k`` of the whole sequence, its ``seq_idx``, or a
    ``documents`` entry (:class:`ctx_plugin.Documents`) — is sharded per document (:func:`ctx_plugin.packing.documents_of_batch`),
    its labels stop at every document's end, and the result carries ``documents`` (the model gets them as
    ``ctx_plugin_documents``). Documents the layout cannot split are an error unless ``pad_documents``: then each one
    is padded at its end to the layout's unit (:func:`ctx_plugin.packing.pad_packed_batch`; padding is masked out of
    attention and loss)."""
    cfg = groups.config
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError("padded batches are not supported under context parallelism: pack or trim sequences and "
                         "give padding labels -100 instead of an attention_mask")
    documents = documents_of_batch(batch)
    if documents is not None and pad_documents and documents.valid is None:
        batch, documents = pad_packed_batch(batch, documents, *padding_units(cfg, groups.size))
    elif documents is not None:
        try:
            check_documents_fit(cfg, documents, groups.size, SettingNames(documents="the packed batch's documents",
                                                                         cp=f'"{SECTION}.size"'))
        except ValueError as e:
            raise ValueError(f'{e}; or set "{SECTION}": {{"pad_documents": true}} so the loader pads them') from None
    input_ids = batch["input_ids"]
    seq = input_ids.shape[1]
    shard = functools.partial(shard_sequence, config=cfg, groups=groups, dim=1, documents=documents)
    out = {}
    for key, value in batch.items():
        if key in ("input_ids", "labels", "position_ids", "attention_mask", "documents", SEQ_IDX, *HF_DOCUMENT_KEYWORDS):
            continue
        per_token = isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq
        out[key] = shard(value) if per_token else value
    positions = batch.get("position_ids")
    if positions is None:
        positions = (torch.arange(seq) if documents is None else documents.positions()).to(input_ids.device)
        positions = positions.expand_as(input_ids)
    out["input_ids"] = shard(input_ids)
    out["position_ids"] = shard(positions)
    if "labels" in batch:
        out["labels"] = shard(shift_labels(batch["labels"], documents))
    if documents is not None:
        out["documents"] = documents
    return out


class ShardedLoader:
    """Batches of ``dataset`` for this data-parallel replica (every rank of a context-parallel group gets the
    same samples), sharded with :func:`shard_batch`. ``drop_last``: drop the last, incomplete batch (DeepSpeed's
    ``"dataloader_drop_last"``); ``shuffle``: ``DistributedSampler``'s (seed 0, the same order on every rank of a
    group), as DeepSpeed's training loader; ``pin_memory`` and ``num_workers``: ``DataLoader``'s.

    ``replica_group``: a process group of every replica's ranks that moves CPU tensors (gloo; what
    :func:`ctx_plugin.deepspeed.initialize` passes when there are several replicas). A batch :func:`shard_batch`
    refuses on some replicas is then the same ValueError on every rank (one all-reduce of a flag per replica and
    batch), not an error on those replicas while the others wait in the step's collectives. None: each replica
    raises its own refusals."""

    def __init__(self, dataset, batch_size: int, groups: CPGroups, *, replicas: int, replica: int,
                 collate_fn=None, pad_documents: bool = False, drop_last: bool = False, shuffle: bool = False,
                 pin_memory: bool = False, num_workers: int = 0, replica_group: dist.ProcessGroup | None = None
                 ) -> None:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=replicas, rank=replica, shuffle=shuffle)
        # its own generator: iterating draws the workers' base seed from it, not from the global RNG, which the
        # model's dropout reads (a resumed run restores that state, and a new iterator would shift it)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                                                  collate_fn=collate_fn, drop_last=drop_last, pin_memory=pin_memory,
                                                  num_workers=num_workers, generator=torch.Generator().manual_seed(0))
        self.groups, self.pad_documents = groups, pad_documents
        self.replicas, self.replica, self.replica_group = replicas, replica, replica_group

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            try:
                sharded, problem = shard_batch(batch, self.groups, pad_documents=self.pad_documents), None
            except (TypeError, ValueError) as e:
                sharded, problem = None, e
            if self.replica_group is not None:
                problem = _shared_refusal(problem, self.replica, self.replicas, self.replica_group)
            if problem is not None:
                raise problem
            yield sharded


def _shared_refusal(problem: Exception | None, replica: int, replicas: int, group) -> ValueError | None:
    """The same error on every rank of ``group`` when some replica's batch was refused (its first message)."""
    flags = torch.zeros(replicas, dtype=torch.int32)
    flags[replica] = problem is not None
    dist.all_reduce(flags, group=group)
    refused = [r for r, flag in enumerate(flags.tolist()) if flag]
    if not refused:
        return None
    messages = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if problem is None else str(problem), group=group)
    first = next(m for m in messages if m is not None)
    return ValueError(f"the batch of data-parallel replicas {refused} was refused: {first}")


def _recompute(engine) -> RecomputeConfig:
    recompute = getattr(engine, "ctx_plugin_recompute", None)
    if recompute is None:
        raise ValueError("this engine was not made by ctx_plugin.deepspeed.initialize with a \"context_parallel\" "
                         "section")
    return recompute


def step_tokens(engine, batches) -> int:
    """The labels other than -100 in a whole optimizer step: this rank's shards of the step's micro batches
    (``batches``, each with ``labels``, as the loader gives them), summed over every data × context rank (one
    all-reduce, so every rank gets the same count). Pass it to the losses of those micro batches (``step_tokens=``) to
    train on the token mean over the whole step, as Hugging Face's Trainer (``num_items_in_batch``) and Megatron
    (``--calculate-per-token-loss``) do. ValueError, on every rank, when the step holds no such label."""
    local = sum(int((b["labels"] != -100).sum()) for b in batches)
    count = torch.tensor([local], dtype=torch.float64, device=engine.device)
    dist.all_reduce(count)
    if count.item() == 0:
        raise ValueError("the step's micro batches hold no label other than -100: nothing to train on")
    return int(count.item())


def _global_mean(local: torch.Tensor, labels: torch.Tensor, engine, step: int | None) -> tuple[torch.Tensor, float]:
    """DeepSpeed averages gradients over all data × context ranks (and ``engine.backward`` divides by the
    accumulation steps), so each rank backpropagates its token sum over the global token count times that rank count
    (and those steps); the result is the gradient of the global token mean: of the micro batch (``step`` None), or of
    the whole step (``step``: :func:`step_tokens`, compared between the ranks: a disagreement is a ValueError on
    every rank)."""
    valid = step is None or (isinstance(step, int) and not isinstance(step, bool) and step >= 1)
    given = -1.0 if not valid else float(step or 0)             # compared between the ranks before any error
    stats = torch.stack([local.detach().double(), (labels != -100).sum().double(),
                         torch.tensor(given, dtype=torch.float64, device=local.device),
                         torch.tensor(given * given, dtype=torch.float64, device=local.device)])
    dist.all_reduce(stats)
    world = dist.get_world_size()
    total, count, given_sum, given_squares = stats.tolist()
    if given_sum ** 2 != world * given_squares:      # (Σv)² = n·Σv² only when every rank gave the same value
        raise ValueError("the ranks passed different step_tokens (or some none) to the loss: count them with "
                         "ctx_plugin.deepspeed.step_tokens(engine, the step's micro batches) on every rank")
    if not valid:
        raise TypeError(f"step_tokens must be a positive int (ctx_plugin.deepspeed.step_tokens), got {step!r}")
    if step is None:
        if count == 0:
            raise ValueError("this micro batch holds no label other than -100 on any rank, so its token mean is "
                             "undefined: pass step_tokens (ctx_plugin.deepspeed.step_tokens of the whole step)")
        return local * (world / count), total / count
    return local * (world * engine.gradient_accumulation_steps() / step), total / step


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, engine, *,
                   step_tokens: int | None = None) -> tuple[torch.Tensor, float]:
    """(loss to backpropagate, global token-mean loss to report) for pre-shifted, sharded ``labels`` (-100:
    ignored), from the whole logits (at least fp32). A section with ``+tile_loss`` is refused here: use
    :func:`lm_loss` (Hugging Face models) or :func:`tiled_causal_lm_loss`.

    ``step_tokens`` (:func:`step_tokens` of the optimizer step's micro batches): the gradient is the token mean over
    the whole step, not over this micro batch, and the report is this micro batch's part of it (the step's reports
    add up to its loss); for ``engine.backward(loss)`` as DeepSpeed scales it (``scale_wrt_gas``, its default).
    Without it, with gradient accumulation, the step's gradient is the mean of its micro batches' token means."""
    recompute = getattr(engine, "ctx_plugin_recompute", None)      # None: an engine without the section
    if recompute is not None and recompute.tile_loss:
        raise ValueError(f'"{SECTION}.recompute" is "{recompute}": +tile_loss computes the loss from the hidden '
                         "states without whole logits; call ctx_plugin.deepspeed.lm_loss(engine, batch) (Hugging Face "
                         "models) or tiled_causal_lm_loss(hidden, labels, engine, head=...) instead of "
                         "causal_lm_loss(logits, ...)")
    local = F.cross_entropy(upcast(logits).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return _global_mean(local, labels, engine, step_tokens)


def tiled_causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, engine, *, head,
                         step_tokens: int | None = None) -> tuple[torch.Tensor, float]:
    """:func:`causal_lm_loss` (``step_tokens`` too) from the final hidden states ``[batch, seq, hidden]`` and the LM
    head module, over chunks of tokens (the section's ``+tile_loss[:<tokens>]``; :mod:`ctx_plugin.tiled_loss`).
    ``hidden`` must come out of the engine's forward (DeepSpeed prepares backward from hooks on its outputs); call
    ``head`` as a module so ZeRO-3 fetches its parameters."""
    recompute = _recompute(engine)
    if not recompute.tile_loss:
        raise ValueError(f'"{SECTION}.recompute" is "{recompute}", without +tile_loss: use causal_lm_loss(logits, '
                         f'...) or lm_loss(engine, batch), or add +tile_loss to the preset')
    local = lm_loss_sum(hidden, labels, head, tokens=recompute.loss_tokens)
    return _global_mean(local, labels, engine, step_tokens)


_LM_KEYS = frozenset({"input_ids", "position_ids", "labels", "documents"})


def _refuse_router_loss(model) -> None:
    """A mixture-of-experts model with ``output_router_logits`` computes its load-balancing loss (``aux_loss``),
    which transformers adds to the loss only with ``labels=`` (refused under context parallelism); lm_loss takes the
    loss from the logits, so the router loss would be dropped, and each rank's would be its shard's: a ValueError."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(c, "output_router_logits", False) for c in (config, text)):
        raise ValueError(f"{type(model).__name__} has config.output_router_logits=True: its router load-balancing "
                         f"loss (aux_loss) would be dropped by lm_loss, which takes the loss from the logits (labels= "
                         f"is refused under context parallelism), and under context parallelism each rank's would be "
                         f"computed over its own shard, not the sequence; set config.output_router_logits=False "
                         f"(train without the load-balancing loss)")


def lm_loss(engine, batch: dict, *, step_tokens: int | None = None) -> tuple[torch.Tensor, float]:
    """Forward and loss of a Hugging Face causal LM on this rank's ``batch`` (``input_ids``, ``position_ids``,
    pre-shifted ``labels`` and, packed, ``documents``, as :class:`ShardedLoader` gives them): (loss to backpropagate,
    global token-mean loss; ``step_tokens``: as :func:`causal_lm_loss`). With ``+tile_loss`` in the section the
    model's ``lm_head`` runs over chunks of tokens (:func:`ctx_plugin.hf.loss.hidden_states`,
    :func:`tiled_causal_lm_loss`), else on the whole logits."""
    tokens = batch["input_ids"]
    unused = sorted(key for key, value in batch.items() if key not in _LM_KEYS and isinstance(value, torch.Tensor)
                    and value.dim() >= 2 and value.shape[:2] == tokens.shape[:2])
    if unused:
        raise ValueError(f"lm_loss uses the batch's input_ids, position_ids, labels and documents; its per-token "
                         f"{unused} would be ignored: fold a loss mask into the labels before the loader shards the "
                         f"batch (labels = -100 where the mask is 0), or run the model yourself and take the loss "
                         f"with causal_lm_loss(logits, batch['labels'], engine)")
    _refuse_router_loss(engine.module)
    inputs = {"input_ids": tokens, "position_ids": batch["position_ids"]}
    if batch.get("documents") is not None:      # a packed batch (shard_batch)
        inputs[DOCUMENTS_KEYWORD] = batch["documents"]
    recompute = getattr(engine, "ctx_plugin_recompute", None)      # None: an engine without the section
    if recompute is None or not recompute.tile_loss:
        return causal_lm_loss(engine(**inputs).logits, batch["labels"], engine, step_tokens=step_tokens)
    hidden, head = hf_loss.hidden_states(engine, engine.module, **inputs)
    return tiled_causal_lm_loss(hidden, batch["labels"], engine, head=head, step_tokens=step_tokens)
