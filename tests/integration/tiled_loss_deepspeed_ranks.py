"""``+tile_loss`` through ctx_plugin.deepspeed on spawned gloo ranks (see test_tiled_loss_deepspeed.py): two Adam
steps of the tiny Qwen2 of deepspeed_ranks.py with ``lm_loss`` (the model's lm_head and loss over chunks of tokens),
whose reference is deepspeed_ranks.plain_train (plain PyTorch, whole logits, one process)."""
from __future__ import annotations

import torch

from tests.integration.deepspeed_ranks import _config, _dataset, _restore_linear, _start, qwen2


def _two_steps(engine, loader, zero: int, rank: int) -> dict:
    import deepspeed

    import ctx_plugin.deepspeed as cpds

    losses, norms, calls = [], [], []
    hook = engine.module.lm_head.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    for _, batch in zip(range(2), loader):
        loss, report = cpds.lm_loss(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(report)
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    hook.remove()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=zero == 3):
        flat = torch.cat([p.detach().flatten().clone() for p in params])
    return {"losses": losses, "norms": norms, "params": flat.tolist() if rank == 0 else None, "calls": calls}


def train(rank: int, world: int, payload: dict) -> dict:
    """Each case (CP size, ZeRO stage, preset, micro batch): two steps through ``ctx_plugin.deepspeed.initialize``;
    then the refusals: ``causal_lm_loss`` under +tile_loss, and a model whose logits the tiled loss cannot
    reproduce."""
    _start(rank, world)
    import ctx_plugin.deepspeed as cpds

    out = {}
    for size, zero, preset, micro in payload["cases"]:
        model = qwen2()
        section = {"backend": "zigzag", "size": size, "recompute": preset}
        engine, _, loader, _ = cpds.initialize(model=model, model_parameters=model.parameters(),
                                               training_data=_dataset(), config=_config(micro, zero, section, {}))
        out[f"cp{size}-z{zero}-{preset}-mb{micro}"] = _two_steps(engine, loader, zero, rank)
        if preset.endswith(":5"):          # the whole-logits loss is refused under +tile_loss
            batch = next(iter(loader))
            try:
                cpds.causal_lm_loss(torch.zeros(1, 1, 1), batch["labels"], engine)
            except ValueError as e:
                out["causal_lm_loss"] = str(e)
        engine.destroy()
        _restore_linear()
    model = qwen2()
    model.config.logit_scale = 0.5
    try:
        cpds.initialize(model=model, model_parameters=model.parameters(),
                        config=_config(2, 1, {"size": 2, "recompute": "full+tile_loss"}, {}))
    except ValueError as e:
        out["initialize"] = str(e)
    return out
