"""Megatron's ``--reset-attention-mask`` / ``--reset-position-ids`` batches on spawned gloo ranks (see
test_megatron_reset.py).

Every sample is built by megatron-core's own ``_get_ltor_masks_and_position_ids`` (what its GPT dataset calls) from
tokens with end-of-document tokens at chosen positions. Every rank first computes the reference — Megatron's own
GPTModel (local spec: DotProductAttention, its RoPE or YaRN) at CP 1 on that batch as it is, its block-diagonal mask and
position ids included — then ctx_plugin's model at CP = world on the batch its sharder makes of it (``shard_batch``:
packed into THD when the mask holds documents), with ``PackedSeqParams`` built from the sharded batch as Megatron-LM
0.19's ``forward_step`` does. Float64, biases, GQA, init std 0.1 (tests/integration/megatron_ranks.py).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from tests.integration.megatron_ranks import (BATCH, SEQ, VOCAB, _cpu_shims, _model, cp_model, loss_and_grads,
                                              model_parallel, relative_errors, whole_gradients)

EOD = VOCAB - 1
MIXES = {   # name: end-of-document positions of each sample (BATCH = 2 samples of SEQ = 32 tokens)
    "fit": ((11, 19), (3, 27)),          # documents 12, 8, 12 and 4, 24, 4: multiples of 2·CP (zigzag at CP 2)
    "uneven": ((9, 20), (4,)),           # documents 10, 11, 11 and 5, 27
    "odd": ((4, 15), (9,)),              # documents 5, 11, 16 and 10, 22
}


def batch(mix: str, reset_mask: bool, reset_pos: bool, eod_mask_loss: bool = True) -> dict:
    """A micro-batch as Megatron's GPTDataset builds it (mask, loss mask and position ids by its own function)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, EOD, (BATCH, SEQ + 1), generator=g)
    for row, ends in enumerate(MIXES[mix]):
        tokens[row, list(ends)] = EOD
    samples = [_get_ltor_masks_and_position_ids(row[:-1], EOD, reset_pos, reset_mask, eod_mask_loss, True)
               for row in tokens]
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "attention_mask": torch.stack([m for m, _, _ in samples]),
            "loss_mask": torch.stack([lm for _, lm, _ in samples]).double(),
            "position_ids": torch.stack([p for _, _, p in samples]), "cu_seqlens": None, "cu_seqlens_padded": None,
            "max_seqlen": None, "local_cp_size": None, "hybrid_cp_group": None}


def packed_seq_params(sharded: dict):
    """Megatron-LM 0.19's forward_step: THD PackedSeqParams from the batch's cu_seqlens (None without them)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if sharded["cu_seqlens"] is None:
        return None
    cu, padded = sharded["cu_seqlens"].squeeze(0), sharded["cu_seqlens_padded"]
    padded = padded.squeeze(0) if padded is not None else None
    bounds = padded if padded is not None else cu
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=int(sharded["max_seqlen"].item()),
                           max_seqlen_kv=int(sharded["max_seqlen"].item()), tokens_per_sample=SEQ)


def _full_batch(mix: str, reset_mask: bool, reset_pos: bool, mask: str) -> dict:
    full = batch(mix, reset_mask, reset_pos)
    if mask == "padding":         # a padding mask on top of the documents: not one ctx_plugin's attention applies
        full["attention_mask"][1, 0, :, SEQ - 1] = True
    return full


def reset_step(rank: int, world: int, payload: dict) -> dict:
    """For each (backend, position embedding, mix, reset_mask, reset_pos, mask, pad[, model variant]): the relative
    errors of ctx_plugin's loss and gradients at CP = world ÷ TP against Megatron's own model at CP 1 on the same
    batch, or the error raised; ``pad``: the sharder pads the documents (``--cp-pad-documents``); the variant
    (default ``base``) is one of tests/integration/megatron_ranks.py's VARIANTS. ``payload["tp"]`` (default 1):
    both models at that tensor-parallel size with Megatron's sequence parallelism (whole gradients compared)."""
    warnings.filterwarnings("ignore")
    import ctx_plugin
    from ctx_plugin.megatron.mask_documents import document_padding
    from ctx_plugin.megatron.spec import shard_batch

    tp = payload.get("tp", 1)
    sp, cp = tp > 1, world // tp
    cases = [(*c, "base") if len(c) == 7 else tuple(c) for c in payload["cases"]]
    want = {}
    with model_parallel(tensor_model_parallel_size=tp) as parallel_state, _cpu_shims():
        tp_group = parallel_state.get_tensor_model_parallel_group() if sp else None
        for _, position, mix, reset_mask, reset_pos, mask, _, variant in cases:
            if mask == "dataset" and (position, mix, reset_mask, reset_pos, variant) not in want:
                model = _model(1, position, variant, lambda spec: spec, tp=tp, sp=sp)
                loss, grads = loss_and_grads(model, batch(mix, reset_mask, reset_pos), None, tp_group=tp_group)
                want[position, mix, reset_mask, reset_pos, variant] = loss, whole_gradients(model, grads, tp_group)
    out = {}
    with model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp) as parallel_state:
        cp_group = parallel_state.get_context_parallel_group()
        tp_group = parallel_state.get_tensor_model_parallel_group() if sp else None
        for backend, position, mix, reset_mask, reset_pos, mask, pad, variant in cases:
            key = case_key(backend, position, mix, reset_mask, reset_pos, mask, pad, variant)
            cp_config = ctx_plugin.CPConfig(backend=backend, kernel="torch")
            model, groups = cp_model(cp, cp_config, position, variant, tp=tp, sp=sp)
            try:
                sharded = shard_batch(_full_batch(mix, reset_mask, reset_pos, mask), config=cp_config, groups=groups,
                                      pad_documents=document_padding(cp_config, cp, tp=tp, sequence_parallel=sp)
                                      if pad else None)
                with _cpu_shims() if position == "yarn" or variant == "moe" or sp else contextlib.nullcontext():
                    loss, grads = loss_and_grads(model, sharded, cp_group, tp_group=tp_group,
                                                 packed_seq_params=packed_seq_params(sharded))
            except ValueError as e:
                out[key] = {"error": str(e)}
                continue
            out[key] = {**relative_errors(loss, whole_gradients(model, grads, tp_group),
                                          *want[position, mix, reset_mask, reset_pos, variant]),
                        "packed": sharded["cu_seqlens"] is not None, "local_tokens": sharded["tokens"].shape[1],
                        "cu_seqlens": None if sharded["cu_seqlens"] is None else sharded["cu_seqlens"].tolist(),
                        "cu_seqlens_padded": None if sharded["cu_seqlens_padded"] is None
                        else sharded["cu_seqlens_padded"].tolist()}
    return out


def case_key(backend, position, mix, reset_mask, reset_pos, mask, pad, variant="base") -> str:
    flags = "+".join(f for f, on in (("mask", reset_mask), ("pos", reset_pos), ("pad", pad)) if on)
    return f"{backend}-{position}-{mix}-{flags}-{mask}" + ("" if variant == "base" else f"-{variant}")
