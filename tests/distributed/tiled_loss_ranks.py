"""ctx_plugin's own model (DecoderLM) with ``<preset>+tile_loss`` under context parallelism on spawned gloo ranks
(see test_tiled_loss_ranks.py): each rank's tiled token sum over its shard, summed over the group, and the
gradients summed over the group, against a float64 reference on the whole sequence in one process — the same
weights with dense plain-PyTorch attention and the untiled cross-entropy of the whole logits."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

SEQ, BATCH, VOCAB = 48, 2, 211


def _model(cfg, groups):
    from ctx_plugin.models import DecoderConfig, DecoderLM

    c = DecoderConfig(vocab=VOCAB, hidden=32, heads=4, kv_heads=2, ffn=64, layers=3, gated=False, norm="layer")
    torch.manual_seed(3)
    model = DecoderLM(c, cfg, groups).double()
    with torch.no_grad():      # LayerNorm: float64 throughout (ctx_plugin's RMSNorm reduces its weight grad in fp32)
        for p in model.parameters():        # biases and norm weights away from 0 / 1
            p.normal_(0.0, 0.3)
    return model


def _data():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[:, :5] = -100
    labels[1, 30:40] = -100
    return tokens, labels


def _reference() -> dict:
    import ctx_plugin
    from tests.reference import dense_attention

    cfg = ctx_plugin.CPConfig(kernel="torch")
    model = _model(cfg, ctx_plugin.build_cp_groups(cfg, group=dist.new_group([dist.get_rank()])))
    for block in model.blocks:
        block.attn.core.forward = lambda q, k, v, documents=None: dense_attention(q, k, v, causal=True)
    tokens, labels = _data()
    loss = F.cross_entropy(model(tokens, torch.arange(SEQ)).flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()}}


def run(rank: int, world: int, payload: dict) -> dict:
    """For each (backend, preset): the largest relative error of the loss and of every gradient vs the reference,
    and the token counts the head ran on in forward."""
    import ctx_plugin
    from ctx_plugin import recompute

    want = _reference()
    out = {}
    for backend, preset in payload["cases"]:
        cfg = ctx_plugin.CPConfig(backend=backend, kernel="torch")
        groups = ctx_plugin.build_cp_groups(cfg)
        model = _model(cfg, groups)
        config = recompute.RecomputeConfig.parse(preset)
        recompute.apply(model.blocks, config.for_layers)
        tokens, labels = _data()
        shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
        positions = ctx_plugin.sequence_positions(SEQ, config=cfg, groups=groups)
        calls = []
        model.head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]) if torch.is_grad_enabled()
                                         and len(calls) < 1000 else None)
        loss = model.loss(shard(tokens), positions, shard(labels), tile=config.tile_loss,
                          loss_tokens=config.loss_tokens)
        forward_calls = list(calls)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        errors = {"loss": abs(total.item() - want["loss"]) / abs(want["loss"])}
        for name, p in model.named_parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            w = want["grads"][name]
            errors[name] = ((g - w).abs().max() / w.abs().max()).item()
        out[f"{backend}-{preset}"] = {"errors": errors, "forward_calls": forward_calls, "all_calls": len(calls)}
    return out
