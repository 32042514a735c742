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


# --- Every recompute preset × ZeRO 0-3 on a model with biases, against plain PyTorch --------------------------------

QWEN_LAYERS = 3                     # sqrt and full:uniform:2 make a two-layer region and a one-layer region
OPTIM = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-6, "weight_decay": 0.0}
CLIP = 1.0                          # DeepSpeed's default "gradient_clipping"


def qwen2():
    """A tiny Qwen2 (q/k/v biases, GQA), init std 0.1, biases and norm weights drawn too (HF starts them at 0/1)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=QWEN_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.0, use_cache=False, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(4321)
    model = Qwen2ForCausalLM(config).float().train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def plain_train(batch: int, steps: int = 2) -> dict:
    """The reference: one process, no DeepSpeed, no ctx_plugin: HF sdpa attention, torch.optim.Adam and gradient
    clipping as the DeepSpeed config has them, ``batch`` samples per step."""
    model = qwen2()
    model.set_attn_implementation("sdpa")
    opt = torch.optim.Adam(model.parameters(), lr=OPTIM["lr"], betas=tuple(OPTIM["betas"]), eps=OPTIM["eps"],
                           weight_decay=OPTIM["weight_decay"])
    data = torch.stack([s["input_ids"] for s in _dataset()])
    losses, norms = [], []
    for step in range(steps):
        ids = data[step * batch:(step + 1) * batch]
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"losses": losses, "norms": norms, "params": params.tolist()}


def _restore_linear() -> None:
    """What a fresh process has: ZeRO-3's memory_efficient_linear replaces torch.nn.functional.linear for the whole
    process and DeepSpeed never puts it back (its own compile path does this)."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as init

    if hasattr(init, "linear_bk"):
        torch.nn.functional.linear = init.linear_bk


class Wrapped(torch.nn.Module):
    """A model that is not a Hugging Face model (no ``set_attn_implementation``) around the Qwen2."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, position_ids):
        return self.inner(input_ids=input_ids, position_ids=position_ids)


def presets_train(rank: int, world: int, payload: dict) -> dict:
    """Each case (model, backend, zero, preset, extra config): two steps through ``ctx_plugin.deepspeed.initialize``
    at CP 2 (and DP world/2); the losses and grad norms of every step, and on rank 0 the parameters afterwards.
    Models: ``hf`` (:func:`qwen2`), ``wrapped`` (:class:`Wrapped`, whose ``attention=`` callback switches the inner
    model to ctx_plugin's attention on the engine's groups), ``unwired`` (a callback that does nothing: the error
    of the first forward is returned)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    import deepspeed

    import ctx_plugin.deepspeed as cpds
    from ctx_plugin import hf

    micro, out = payload["micro"], {}
    for kind, backend, zero, preset, extra in payload["cases"]:
        model, attention = qwen2(), None
        if kind != "hf":
            model = Wrapped(model)
            attention = (lambda groups: None) if kind == "unwired" else \
                (lambda groups, inner=model.inner: hf.enable(inner, groups.config, groups))
        config = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 1000,
                  "optimizer": {"type": "Adam", "params": {**OPTIM, "torch_adam": True, "adam_w_mode": False}},
                  "zero_optimization": {"stage": zero},
                  "context_parallel": {"backend": backend, "size": 2, "kernel": "torch", "recompute": preset},
                  **extra}
        engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=_dataset(), config=config, attention=attention)
        key, losses, norms = f"{kind}-{backend}-z{zero}-{preset}", [], []
        try:
            for _, batch in zip(range(2), loader):
                logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                loss, report = cpds.causal_lm_loss(logits, batch["labels"], engine)
                engine.backward(loss)
                engine.step()
                losses.append(report)
                norm = engine.get_global_grad_norm()          # None at ZeRO 0 (it clips without keeping the norm)
                norms.append(None if norm is None else float(norm))
        except RuntimeError as e:
            if kind != "unwired":
                raise
            out[key] = {"error": str(e)}
            engine.destroy()
            continue
        params = list(engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=zero == 3):
            flat = torch.cat([p.detach().flatten().clone() for p in params])
        out[key] = {"losses": losses, "norms": norms, "params": flat.tolist() if rank == 0 else None}
        engine.destroy()
        _restore_linear()
    return out
