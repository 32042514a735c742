"""megatron-core's MoE router under ctx_plugin's recompute presets, on one spawned gloo rank (its running state does
not depend on the context-parallel size): per (variant, preset), one step's gradients, the router's buffers (its
running counts), the MoE metrics tracker's per-layer losses and which modules' tensor attributes backward replaced."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from tests.integration.megatron_ranks import _batch, _cpu_shims, cp_model, model_parallel


def router_state(rank: int, world: int, payload: dict) -> dict:
    warnings.filterwarnings("ignore")
    import ctx_plugin
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    from megatron.core.transformer.moe.router import TopKRouter

    out = {}
    with model_parallel(), _cpu_shims():
        for variant, preset in payload["cases"]:
            get_moe_metrics_tracker().metrics.clear()
            model, _ = cp_model(1, ctx_plugin.CPConfig(backend="zigzag", kernel="torch"), "rope", variant, preset)
            batch = _batch(False)
            logits = model(batch["tokens"], batch["position_ids"], None)
            kept = _tensor_attributes(model)
            F.cross_entropy(logits.transpose(1, 2), batch["labels"]).backward()
            after = _tensor_attributes(model)
            replaced = sorted(name for name, value in after.items() if kept.get(name) is not value)
            routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
            out[f"{variant}|{preset}"] = {
                "grads": {n: p.grad.flatten().tolist() for n, p in model.named_parameters()},
                "counts": [[b.tolist() for b in m.buffers(recurse=False)] for m in routers],
                "metrics": {n: e.values.tolist() for n, e in get_moe_metrics_tracker().metrics.items()},
                "replaced": replaced}
    return out


def _tensor_attributes(model) -> dict:
    """Every tensor attribute of the model's modules and of the plain objects they hold (the token dispatcher)."""
    out = {}
    for name, m in model.named_modules():
        for key, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
            elif hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type)) and not callable(value):
                out.update({f"{name}.{key}.{k}": v for k, v in vars(value).items() if isinstance(v, torch.Tensor)})
    return out

