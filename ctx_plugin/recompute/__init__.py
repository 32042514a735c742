"""Selective-recompute granularity: named presets, their application to layers, and framework mappings.

    cfg = ctx_plugin.recompute.RecomputeConfig.parse("full:uniform:2")
    ctx_plugin.recompute.apply(model.model.layers, cfg, groups=cp_groups)
    megatron_fields = ctx_plugin.recompute.to_megatron(cfg, num_layers=32)
"""
from .apply import apply, remove
from .mappings import to_deepspeed, to_megatron
from .presets import RecomputeConfig, candidates, regions

__all__ = ["RecomputeConfig", "apply", "candidates", "regions", "remove", "to_deepspeed", "to_megatron"]
