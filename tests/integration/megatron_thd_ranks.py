"""Packed documents (megatron-core THD, ``PackedSeqParams``) on spawned gloo ranks (see test_megatron_thd.py).

Every rank first computes the reference — Megatron's own GPTModel (local spec: DotProductAttention, its RoPE or
YaRN) at CP 1 on the unpacked batch with the explicit block-diagonal causal mask of the documents — then ctx_plugin's
model at CP = world on the packed batch (``shard_batch`` with ``cu_seqlens``; ``PackedSeqParams(qkv_format="thd")``
as Megatron-LM's pretrain_gpt.py builds it). Float64, biases, GQA, init std 0.1 (tests/integration/megatron_ranks.py).
The CP 4 cases (:data:`CP4_CASES`) run in test_megatron.py's 4-rank launch (``gpt_step``'s ``payload["thd"]``).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from tests.integration.megatron_ranks import (SEQ, VOCAB, _cpu_shims, _model, cp_model, loss_and_grads,
                                              model_parallel, relative_errors)

MIXES = {   # name: (padded document lengths, real lengths or None); SEQ = 32 tokens
    "docs": ((12, 8, 4, 8), None),
    "padded": ((12, 8, 4, 8), (10, 8, 3, 5)),      # Transformer Engine's cu_seqlens_q / cu_seqlens_q_padded
    "uneven": ((10, 22), None),                     # not a multiple of 2·CP: zigzag refuses, ring takes it
    "docs8": ((8, 16, 8), None),                   # multiples of 2·CP at CP 4
    "padded8": ((8, 16, 8), (5, 13, 8)),
}
# (backend, position embedding, mix) at CP 4, run in test_megatron.py's 4-rank launch (gpt_step's payload["thd"]) and
# checked by test_megatron_thd.py: zigzag with padding, allgather with YaRN, ulysses (K/V heads replicated: 2 groups
# over 4 ranks), striped with a document of one token per rank, and a document zigzag cannot split over 4 ranks
CP4_CASES = [("zigzag", "rope", "padded8"), ("allgather", "yarn", "docs8"), ("ulysses", "learned_absolute", "uneven"),
             ("striped", "learned_absolute", "docs"), ("zigzag", "rope", "docs")]


def _cumulative(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _batch(mix: str) -> dict:
    lengths, real = MIXES[mix]
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    starts = torch.repeat_interleave(_cumulative(lengths)[:-1].long(), torch.tensor(lengths))
    loss_mask = (torch.rand(1, SEQ, generator=g) > 0.2).double()
    for d, n in enumerate(real or ()):             # padding: no loss
        loss_mask[0, int(_cumulative(lengths)[d]) + n:int(_cumulative(lengths)[d + 1])] = 0
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": loss_mask,
            "position_ids": (torch.arange(SEQ) - starts)[None],          # restart in each document
            "cu_seqlens": _cumulative(real if real else lengths)[None],
            "cu_seqlens_padded": _cumulative(lengths)[None] if real else None,
            "max_seqlen": torch.tensor([max(lengths)], dtype=torch.int32)}


def _block_mask(lengths) -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return (torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1) | (doc[:, None] != doc[None, :]))[None, None]


def _packed_params(batch: dict):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, padded = batch["cu_seqlens"][0], batch["cu_seqlens_padded"]      # pretrain_gpt.py's forward_step
    padded = padded[0] if padded is not None else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=int(batch["max_seqlen"].item()),
                           max_seqlen_kv=int(batch["max_seqlen"].item()))


def _step(model, batch, group, **forward) -> dict:
    loss, grads = loss_and_grads(model, batch, group, **forward)
    return {"loss": loss, "grads": grads}


def _reference(position: str, mix: str) -> dict:
    batch = _batch(mix)
    batch["attention_mask"] = _block_mask(MIXES[mix][0])
    with _cpu_shims():
        return _step(_model(1, position, "base", lambda spec: spec), batch, None)


def thd_step(rank: int, world: int, payload: dict) -> dict:
    """For each (backend, position embedding, mix) of ``payload["cases"]``: the relative errors of ctx_plugin's THD
    loss and gradients at CP = world against Megatron's own model at CP 1 with the block-diagonal mask, or the error
    it raised; ``payload["fused"]``: cases run with ``apply_rope_fusion`` (keys ``fused-...``), which must raise."""
    warnings.filterwarnings("ignore")
    import ctx_plugin
    from ctx_plugin.megatron.spec import shard_batch

    with model_parallel():
        want = {(pos, mix): _reference(pos, mix) for _, pos, mix in payload["cases"]}
    out = {}
    with model_parallel(context_parallel_size=world) as parallel_state:
        cp_group = parallel_state.get_context_parallel_group()
        for backend, position, mix, fused in [(*c, False) for c in payload["cases"]] + \
                [(*c, True) for c in payload.get("fused", [])]:
            key = f"{'fused-' if fused else ''}{backend}-{position}-{mix}"
            cp_config = ctx_plugin.CPConfig(backend=backend, kernel="torch")
            model, groups = cp_model(world, cp_config, position)
            model.config.apply_rope_fusion = fused          # set after construction: its check wants TE
            full = _batch(mix)
            # unrefused, the fused RoPE fails on CPU (megatron-core asserts Transformer Engine's kernel is there)
            refusals = (ValueError, AssertionError) if fused else ValueError
            try:
                batch = shard_batch(full, config=cp_config, groups=groups)
                assert batch["cu_seqlens"] is full["cu_seqlens"]            # metadata left global, as Megatron's
                with _cpu_shims() if position == "yarn" else contextlib.nullcontext():
                    got = _step(model, batch, cp_group, packed_seq_params=_packed_params(batch))
            except refusals as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"}
                continue
            ref = want[position, mix]
            out[key] = {**relative_errors(got["loss"], got["grads"], ref["loss"], ref["grads"]),
                        "local_tokens": batch["tokens"].shape[1]}
    return out
