"""A tiny Llama (transformers, built from a config: no download) on spawned gloo ranks (see test_hf.py)."""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, VOCAB = 32, 2, 128


def _model(attn_implementation: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.0, use_cache=False)
    torch.manual_seed(1234)
    return LlamaForCausalLM(config).float().train() if attn_implementation is None else \
        LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).float().train()


def _data():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[:, :3] = -100                                                  # some ignored targets
    return tokens[:, :-1], labels, torch.arange(SEQ).expand(BATCH, SEQ)


def llama_step(rank: int, world: int, payload: dict) -> dict:
    """Loss and CP-summed gradients of one forward/backward, per backend (reference: HF's own sdpa, 1 rank)."""
    warnings.filterwarnings("ignore")
    import ctx_plugin
    import ctx_plugin.hf

    input_ids, labels, positions = _data()
    out = {}
    for backend, u in payload["cases"]:
        if backend == "reference":
            model = _model("sdpa")
            logits = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            count = (labels != -100).sum()
            (loss / count).backward()
            out["reference"] = {"loss": (loss / count).item(),
                                "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()}}
            continue
        cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
        groups = ctx_plugin.build_cp_groups(cfg)
        model = _model(None)
        ctx_plugin.hf.enable(model, cfg, groups)
        shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
        logits = model(input_ids=shard(input_ids), position_ids=shard(positions), use_cache=False).logits
        local_labels = shard(labels)                                       # pre-shifted, then sharded
        loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten(), ignore_index=-100, reduction="sum")
        stats = torch.stack([loss.detach(), (local_labels != -100).sum().float()])
        dist.all_reduce(stats)
        (loss / stats[1]).backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad.detach().clone()
            dist.all_reduce(g)
            grads[name] = g.flatten().tolist()
        full_logits = ctx_plugin.gather_sequence(logits.detach(), config=cfg, groups=groups, dim=1)
        ref_logits = _model("sdpa")(input_ids=input_ids, position_ids=positions, use_cache=False).logits.detach()
        out[f"{backend}-u{u}"] = {"loss": (stats[0] / stats[1]).item(), "grads": grads if rank == 0 else None,
                                  "logits_err": ((full_logits - ref_logits).abs().max()
                                                 / ref_logits.abs().max()).item()}
    return out


def rejected_masks(rank: int, world: int, payload) -> dict:
    import ctx_plugin
    import ctx_plugin.hf

    cfg = ctx_plugin.CPConfig(kernel="torch")
    groups = ctx_plugin.build_cp_groups(cfg)
    model = _model(None)
    ctx_plugin.hf.enable(model, cfg, groups)
    input_ids, _, positions = _data()
    shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
    mask = torch.ones(BATCH, SEQ // world, dtype=torch.long)
    mask[0, :2] = 0
    errors = {}
    for name, kwargs in {"padding": dict(attention_mask=mask), "cache": dict(use_cache=True)}.items():
        try:
            model(input_ids=shard(input_ids), position_ids=shard(positions), **kwargs)
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)
    model(input_ids=shard(input_ids), position_ids=shard(positions), attention_mask=torch.ones_like(mask),
          use_cache=False)                                                # an all-ones mask is fine
    errors["default_cache_off"] = model.config.use_cache is False
    return errors
