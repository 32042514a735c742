"""The planner's printed header and table, shared by ``ctx-plugin plan`` and ``ctx-plugin plan --max-seq-len``."""
from __future__ import annotations

from ..memory.specs import ModelSpec
from .cluster import Cluster
from .prediction import Prediction


def _row(rank: int, p: Prediction) -> str:
    axes = "-" if p.backend.value == "allgather" or p.cp == 1 else f"{p.ulysses_size}×{p.ring_size}"
    hidden = "-" if p.ring_hidden is None else ("yes" if p.ring_hidden else "no")
    recompute = str(p.recompute) + (" +optimizer offload" if p.offload_optimizer else "")
    return (f"{rank:>4} {p.backend.value if p.cp > 1 else '-':<13} {p.cp:>3} {axes:>5} {p.tp:>3} {p.dp:>3} "
            f"{p.zero_stage:>1} {p.memory_gib:>8.1f} {p.host_gib:>6.1f} {'yes' if p.fits else 'no':>4} "
            f"{p.step_ms:>12,.1f} {p.compute_ms:>12,.1f} {p.exposed_ms:>10,.1f} {hidden:>6} "
            f"{p.tokens_per_s_per_gpu:>9,.0f} {100 * p.mfu:>4.1f}%  {recompute}")


def print_header(model: ModelSpec, c: Cluster) -> None:
    print(f"{model.name}: {model.layers} layers, hidden {model.hidden}, {model.heads} heads ({model.kv_heads} K/V), "
          f"ffn {model.ffn}, vocab {model.vocab}")
    print(f"cluster: {c.nodes} × {c.gpus_per_node} = {c.gpus} GPUs, {c.gpu_memory_gib:g} GiB each "
          f"({c.gpu_reserve_gib:g} reserved); "
          f"{c.intra_bw_gbs:g} GB/s in a node, {c.inter_bw_gbs:g} GB/s across; attention {c.attention_tflops:g}, "
          f"matmul {c.matmul_tflops:g}, peak {c.peak_tflops:g} TFLOP/s")
    print(f"host: {c.host_memory_gib:g} GiB per node ({c.host_reserve_gib:g} reserved), PCIe {c.host_bw_gbs:g} GB/s "
          f"per link shared by {min(c.gpus_per_host_link, c.gpus_per_node)} GPU(s), CPU Adam "
          f"{c.host_adam_gparams_s:g} G parameters/s per node")


def print_table(rows: list[Prediction], top: int) -> None:
    print(f"{'rank':>4} {'backend':<13} {'cp':>3} {'u×r':>5} {'tp':>3} {'dp':>3} {'Z':>1} {'mem GiB':>8} {'host':>6} "
          f"{'fits':>4} {'step ms':>12} {'compute ms':>12} {'comm ms':>10} {'hidden':>6} {'tok/s/GPU':>9} {'MFU':>5}  "
          f"recompute")
    for i, p in enumerate(rows[:top], 1):
        print(_row(i, p))
