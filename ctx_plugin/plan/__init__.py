"""The planner: every backend × (Ulysses, ring) × recompute preset (× memory modifiers, offload, ZeRO stage) × TP for
a model on a cluster, with its memory (the memory model, GPU and host) and step time (compute at the kernels' rates,
communication at the links' bandwidths, ring steps overlapped by :func:`ring_step`), ranked; and the longest
sequence that fits (:func:`longest`). ``ctx-plugin plan`` prints them.

    plans = ctx_plugin.plan.enumerate_plans(ModelSpec.preset("llama3-8b"), 131072, Cluster(nodes=2))
    print(ctx_plugin.plan.explain(plans[0], plans))
    print(ctx_plugin.plan.longest(ModelSpec.preset("llama3-8b"), Cluster(nodes=1)).seq_len)
"""
from .cluster import Cluster
from .longest import Longest, longest
from ..memory.flops import BACKWARD
from .predict import Footprint, check_heads_split, footprint, predict, ring_step
from .prediction import Prediction
from .search import best_per_layout, enumerate_plans, explain, layouts

__all__ = ["BACKWARD", "Cluster", "Footprint", "Longest", "Prediction", "best_per_layout", "check_heads_split",
           "enumerate_plans", "explain", "footprint", "layouts", "longest", "predict", "ring_step"]
