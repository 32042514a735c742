"""What the memory modifiers, activation offload and optimizer offload cost: extra FLOPs, copies, host memory.

Per GPU and step (one micro-batch), t tokens per GPU, h the width, V/tp the vocabulary per TP rank, L layers:

    +tile_loss       the LM head's logits are recomputed chunk by chunk in backward: 2·t·h·V/tp FLOPs (matmul rate).
    +tile_mlp        each chunk's MLP forward runs once more in backward (checkpointed chunks,
                     recompute/tiling.py): one MLP forward per layer, none under ``mlp`` (whose MLP checkpoint the
                     chunks replace). Inside ``full``/``sqrt`` regions the region's recompute re-runs the chunked
                     forward with autograd on, so the chunks' own checkpoints recompute again: (n−1)/n more MLP
                     forwards per region layer with n chunks (torch's non-reentrant checkpoint stops the last chunk's
                     nested recompute early; counted on torch 2.13: 2·n + n−1 MLP calls per region layer). The
                     norms it chunks too run again the same way: elementwise work, counted as free (as ``selective``'s).
    +recompute_attn  (and ``core_attn``) the attention forward again in backward for every recomputed layer, at the
                     attention rate, and its forward communication again (ring steps, the 4 all-to-alls, the K/V
                     all-gather) — see :func:`attention_recompute_layers`.
    offload          the memory model's ``host`` bytes per rank go device→host during forward and host→device during
                     backward, spread evenly over the layers of the checkpoint regions; each layer's copy overlaps
                     that layer's compute (forward, resp. backward with its recompute) and only what it takes beyond
                     that compute is exposed (:func:`copy_exposed`). Copies run at
                     :attr:`Cluster.host_bandwidth` (the node's GPUs share PCIe uplinks).
    optimizer offload (DeepSpeed ZeRO-Offload, ``offload_optimizer: cpu``, ZeRO ≥ 1) the fp32 master weights,
                     both Adam moments and an fp32 gradient copy (16 bytes per parameter of the rank's ZeRO shard)
                     live in host memory instead of the GPU's optimizer state; each step copies the shard's
                     gradients down and its updated weights up (2 × dtype bytes per parameter over PCIe) and the
                     node's CPUs update every rank's shard at :attr:`Cluster.host_adam_gparams_s`; none of it
                     overlaps (no delayed parameter update).

Host memory binds offload: a rank's activation offload + optimizer offload bytes × GPUs per node must stay within
the node's host memory less its reserve (:attr:`Cluster.host_bytes_per_rank` per rank).
"""
from __future__ import annotations

from ..memory.specs import ceil_div
from ..names import Recompute
from ..recompute.presets import RecomputeConfig, regions
from .cluster import Cluster

OPTIMIZER_HOST_BYTES = 16
"""Host bytes per parameter under optimizer offload: fp32 master weight, two fp32 Adam moments, fp32 gradient."""


def _overlap(compute_s: float, transfer_s: float) -> float:
    return max(0.0, transfer_s - compute_s)


def region_layers(recompute: RecomputeConfig, layers: int) -> int:
    """Layers inside whole-layer checkpoint regions (``full``, ``full:<method>:N``, ``sqrt``)."""
    return sum(stop - start for start, stop in regions(recompute, layers))


def tile_loss_flops(tokens: int, hidden: int, vocab: int, tp: int) -> float:
    """Extra FLOPs of ``+tile_loss``: the logits recomputed in backward, 2·t·h·⌈V/tp⌉ (0 without it)."""
    return 2.0 * tokens * hidden * ceil_div(vocab, tp)


def mlp_chunks(tokens: int, mlp_tokens: int | None, hidden: int) -> int:
    """Chunks of a rank's ``tokens`` (one sequence's share) under ``+tile_mlp[:mlp_tokens]`` (default: the width)."""
    return max(1, -(-tokens // (mlp_tokens or hidden)))


def tile_mlp_forwards(recompute: RecomputeConfig, layers: int, chunks: int) -> tuple[float, float]:
    """Extra MLP forwards per step under ``+tile_mlp`` as (outside checkpoint regions, inside them): one per layer
    outside the regions (none under ``mlp``), (chunks−1)/chunks per region layer."""
    if not recompute.tile_mlp or recompute.preset == Recompute.MLP:
        return 0.0, 0.0
    inside = region_layers(recompute, layers)
    return float(layers - inside), inside * (chunks - 1) / chunks


def attention_recompute_layers(recompute: RecomputeConfig, layers: int) -> int:
    """Layers whose attention forward (and its communication) runs again in backward: all under ``core_attn``,
    those of the checkpoint regions under ``+recompute_attn``, none otherwise (``full`` pins the attention)."""
    if recompute.preset == Recompute.CORE_ATTN:
        return layers
    return region_layers(recompute, layers) if recompute.recompute_attention else 0


def copy_exposed(host_bytes: int, layers: int, forward_s: float, backward_s: float, bandwidth: float) -> float:
    """Seconds of activation offload not hidden by compute: ``host_bytes`` spread over ``layers`` layers, each
    layer's device→host copy under its forward (``forward_s``), its host→device prefetch under its backward
    (``backward_s``, recompute included)."""
    if host_bytes <= 0:
        return 0.0
    if layers < 1:
        raise ValueError(f"{host_bytes} offloaded bytes need at least one checkpointed layer to belong to")
    per_layer = host_bytes / layers / bandwidth
    return layers * (_overlap(forward_s, per_layer) + _overlap(backward_s, per_layer))


def optimizer_offload(params: int, shards: int, dtype_bytes: int, cluster: Cluster) -> tuple[int, float]:
    """(host bytes per rank, exposed seconds per step) of ZeRO-Offload for a rank holding a 1/``shards`` share of
    ``params`` parameters: 16 bytes per shard parameter; copies of 2·dtype bytes per shard parameter over PCIe
    plus the CPU Adam update of the whole node's shards (``gpus_per_node`` × shard)."""
    shard = ceil_div(params, shards)
    copies = shard * 2 * dtype_bytes / cluster.host_bandwidth
    adam = shard * cluster.gpus_per_node / (cluster.host_adam_gparams_s * 1e9)
    return shard * OPTIMIZER_HOST_BYTES, copies + adam
