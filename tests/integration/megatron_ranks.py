"""A tiny megatron-core GPTModel on spawned gloo ranks, built through ctx_plugin's spec (see test_megatron.py)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

SEQ, BATCH, VOCAB = 32, 2, 128


def _batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],            # labels pre-shifted, then sharded
            "loss_mask": (torch.rand(BATCH, SEQ, generator=g) > 0.2).float(),
            "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous()}


def gpt_step(rank: int, world: int, payload: dict) -> dict:
    """For each (backend, ulysses_size, position embedding, recompute): global loss and CP-summed gradients."""
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ctx_plugin.megatron.args import MegatronCPSettings
    from ctx_plugin.megatron.core_attention import GroupsProvider
    from ctx_plugin.megatron.spec import gpt_layer_spec, prepare_model, shard_batch
    from ctx_plugin.recompute import RecomputeConfig
    import ctx_plugin

    parallel_state.initialize_model_parallel(context_parallel_size=world)
    cp_group = parallel_state.get_context_parallel_group()
    out = {}
    try:
        for backend, u, position, preset in payload["cases"]:
            cp_config = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
            settings = MegatronCPSettings(cp_config=cp_config, recompute=RecomputeConfig.parse(preset),
                                          megatron_recompute=None)
            provider = GroupsProvider(cp_config)
            config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                                       ffn_hidden_size=128, use_cpu_initialization=True, context_parallel_size=world,
                                       attention_dropout=0.0, hidden_dropout=0.0)
            torch.manual_seed(1234)
            model = GPTModel(config=config, transformer_layer_spec=gpt_layer_spec(cp_config, groups_provider=provider),
                             vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type=position)
            groups = prepare_model(model, settings, provider)
            batch = shard_batch(_batch(), config=cp_config, groups=groups)
            per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"]
            stats = torch.stack([(per_token * mask).sum().detach(), mask.sum()])
            dist.all_reduce(stats, group=cp_group)
            ((per_token * mask).sum() / stats[1]).backward()       # each rank: its tokens over the global count
            grads = {}
            for name, p in model.named_parameters():
                g = p.grad.detach().clone()
                dist.all_reduce(g, group=cp_group)                  # what DDP over data×context ranks does
                grads[name] = g.flatten().tolist()
            out[f"{backend}-u{u}-{position}-{preset}"] = {"loss": (stats[0] / stats[1]).item(),
                                                           "grads": grads if rank == 0 else None}
    finally:
        parallel_state.destroy_model_parallel()
    return out
