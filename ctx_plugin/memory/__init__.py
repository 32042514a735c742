"""The activation-memory model and the tool that measures what a forward pass keeps for backward.

    est = ctx_plugin.memory.estimate(ModelSpec.preset("llama3-8b"), ParallelSpec(cp=8), "selective",
                                     seq_len=131072)
"""
from .measure import saved_bytes
from .model import GiB, MemoryEstimate, estimate, layer_activations, param_count, resolve
from .specs import MODEL_PRESETS, ModelSpec, ParallelSpec, ZeroSettings

__all__ = ["GiB", "MODEL_PRESETS", "MemoryEstimate", "ModelSpec", "ParallelSpec", "estimate", "layer_activations",
           "param_count", "resolve", "saved_bytes", "ZeroSettings"]
