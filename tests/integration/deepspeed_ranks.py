"""DeepSpeed (CPU, gloo) training of a tiny Llama with a "context_parallel" section, on spawned ranks."""
from __future__ import annotations

import os
import warnings

import torch

SEQ, VOCAB, SAMPLES = 32, 128, 8


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.0, use_cache=False)
    torch.manual_seed(1234)
    return LlamaForCausalLM(config).float().train()


def _dataset():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


def ds_train(rank: int, world: int, payload: dict) -> dict:
    """Two optimizer steps per case; rank 0 returns the losses and the full parameters afterwards."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))   # what torchrun would set
    warnings.filterwarnings("ignore")
    import deepspeed

    import ctx_plugin.deepspeed as cpds

    out = {}
    for backend, u, size, zero, micro, *recompute in payload["cases"]:
        recompute = recompute[0] if recompute else "none"
        model = _model()
        config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "eps": 1e-6, "torch_adam": True}},
                  "zero_optimization": {"stage": zero}, "steps_per_print": 1000,
                  "context_parallel": {"backend": backend, "size": size, "ulysses_size": u, "kernel": "torch",
                                       "recompute": recompute}}
        engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=_dataset(), config=config)
        losses = []
        for _, batch in zip(range(2), loader):
            logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            loss, report = cpds.causal_lm_loss(logits, batch["labels"], engine)
            engine.backward(loss)
            engine.step()
            losses.append(report)
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=zero == 3):
            flat = torch.cat([p.detach().flatten().clone() for p in params])
        suffix = "" if recompute == "none" else f"-{recompute}"
        out[f"{backend}-u{u}-cp{size}-z{zero}-mb{micro}{suffix}"] = {"losses": losses,
                                                            "params": flat.tolist() if rank == 0 else None}
        engine.destroy()
    return out


def loader_shards(rank: int, world: int, payload) -> dict:
    """ShardedLoader at dp=2 × cp=2: which samples each rank sees, and its shards gathered back."""
    import torch.distributed as dist

    import ctx_plugin
    from ctx_plugin.deepspeed import ShardedLoader

    cp, _ = dist.new_subgroups(group_size=2)
    cfg = ctx_plugin.CPConfig(backend="zigzag")
    groups = ctx_plugin.build_cp_groups(cfg, group=cp)
    data = [{"input_ids": torch.arange(i * 100, i * 100 + 8), "labels": torch.arange(i * 100, i * 100 + 8),
             "loss_mask": torch.arange(i * 100, i * 100 + 8) % 3} for i in range(4)]
    loader = ShardedLoader(data, 2, groups, replicas=world // 2, replica=rank // 2)
    batch = next(iter(loader))
    full = {k: ctx_plugin.gather_sequence(v, config=cfg, groups=groups, dim=1).tolist() for k, v in batch.items()}
    return {"full": full, "local_len": batch["input_ids"].shape[1], "batches": len(loader)}
