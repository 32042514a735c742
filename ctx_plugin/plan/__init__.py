"""The planner: every backend × (Ulysses, ring) × recompute preset × TP for a model on a cluster, with its memory
(the memory model) and step time (compute at the kernels' rates, communication at the links' bandwidths, ring
steps overlapped by :func:`ring_step`), ranked; ``ctx-plugin plan`` prints it.

    plans = ctx_plugin.plan.enumerate_plans(ModelSpec.preset("llama3-8b"), 131072, Cluster(nodes=2))
    print(ctx_plugin.plan.explain(plans[0], plans))
"""
from .predict import BACKWARD, Cluster, Prediction, check_heads_split, predict, ring_step
from .search import best_per_layout, enumerate_plans, explain, layouts

__all__ = ["BACKWARD", "Cluster", "Prediction", "best_per_layout", "check_heads_split", "enumerate_plans", "explain",
           "layouts", "predict", "ring_step"]
