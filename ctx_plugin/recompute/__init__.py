"""Selective-recompute granularity: named presets, their application to layers, and framework mappings.

    cfg = ctx_plugin.recompute.RecomputeConfig.parse("full:uniform:2")
    ctx_plugin.recompute.apply(model.model.layers, cfg)
    megatron_fields = ctx_plugin.recompute.to_megatron(cfg, num_layers=32)
    chosen = ctx_plugin.recompute.resolve("budget:60", model_spec, parallel_spec, seq_len=131072)

``resolve`` is :func:`ctx_plugin.memory.resolve` (it needs the memory model, which itself imports these presets,
so it is imported on first use).
"""
from .apply import apply, remove
from .mappings import to_deepspeed, to_megatron
from .offload import host_offload
from .presets import RecomputeConfig, candidates, regions

__all__ = ["RecomputeConfig", "apply", "candidates", "host_offload", "regions", "remove", "resolve", "to_deepspeed",
           "to_megatron"]


def __getattr__(name: str):
    if name == "resolve":
        from ..memory.model import resolve
        return resolve
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
