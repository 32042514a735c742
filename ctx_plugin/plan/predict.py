"""The planner's cost model: memory from the memory model, step time from FLOPs, bytes and bandwidths.

Per GPU, per layer and micro-batch, with b the micro-batch, s the sequence length, t = b·s/cp tokens per GPU,
a = heads/tp and g = max(kv_heads/tp, 1) heads per TP rank, d the head size, e / e_acc the bytes of the dtype /
of its accumulation dtype (fp32 for bf16), u the Ulysses size and r the ring size (cp = u·r)::

    attention forward    F = 4·b·pairs·a·d / cp per TP rank, pairs the causal (query, key) pairs of the sequence:
                         s(s+1)/2 for one document, the sum of n(n+1)/2 over packed documents (``documents``: a
                         mean length or lengths, each document padded to the layout's document unit:
                         :mod:`ctx_plugin.memory.flops`; padding holds no pair); backward 2.5·F (flash-style: the
                         kernel recomputes the scores). `ring` (contiguous, causal) runs at the pace of its busiest
                         rank: × max/mean of its ranks' pairs (≈ (2r−1)/r for one document, → 1 for documents much
                         shorter than a rank's shard). Time F / attention rate.
    dense                6·t·W (2 forward, 4 backward), W = QKV, o_proj and MLP weights per TP rank; plus the LM
                         head 6·t·h·V/tp once per step. Time / matmul rate. (FLOPs from memory.model.layer_flops.)
    recompute            the memory model's recompute_flops (its extra FLOPs per micro batch): at the attention
                         rate for the attention that core_attn and +recompute_attn re-run (whose forward
                         communication, 4 all-to-alls included, runs again too), at the matmul rate for the rest;
                         `full`/`sqrt` regions and `mlp` repeat their TP collectives. Selective's elementwise
                         recompute has no FLOPs and counts zero. +tile_loss, +tile_mlp, activation and optimizer
                         offload: see :mod:`ctx_plugin.plan.costs`.
    MFU                  model FLOPs without any recompute, 3·L·(W-FLOPs + F) + 6·t·h·V/tp per GPU, over the step
                         time × the GPU's peak (Cluster.peak_tflops). Only the FLOPs the model needs count: the
                         attention's causal pairs inside each document (not s² nor s²/2 of the whole packed
                         sequence), the dense FLOPs of real tokens only (not of document padding, which the step
                         time does include); tokens/s counts real tokens too.
    ring (r > 1)         K/V step T = 2·t·u·g_u·d·e / bw, g_u = max(g, u)/u (K/V heads after Ulysses); dK/dV hop
                         T' = T·e_acc/e (they travel in fp32). Each step computes c = F/r (forward), 2.5·c
                         (backward). Forward: r−1 steps of ring_step(c, T). Backward, as ring.py schedules it:
                         ring_step(2.5c, T), r−2 × ring_step(2.5c, T + T') (a K/V step and the previous dK/dV hop
                         share the link), ring_step(2.5c, T'), and the last dK/dV hop home, never hidden.
    Ulysses (u > 1)      4 all-to-alls forward (q, k, v, out) and 4 backward: (u−1)/u · t·(2a + 2·max(g, u))·d·e
                         bytes per direction per GPU / bw, exposed.
    allgather            forward all-gather of K/V (cp−1)·2·t·g·d·e; backward gathers again and reduce-scatters
                         dK/dV in fp32 (cp−1)·2·t·g·d·e_acc; / bw, exposed.
    TP (tp > 1)          Megatron sequence parallelism: 4 all-gathers/reduce-scatters forward, 4 backward, each
                         t·h·e·(tp−1)/tp bytes over NVLink, exposed (no --tp-comm-overlap); without sequence
                         parallelism the all-reduces move the same volume. TP stays inside a node.

Ranks are ordered TP innermost, then CP, then DP (Megatron's order); a group whose consecutive ranks span two
nodes uses the inter-node bandwidth (the ring is as slow as its slowest hop), else the intra-node one. The DP
gradient reduction is ignored (Megatron and DeepSpeed overlap it with backward), as are pipeline parallelism,
norms, elementwise ops and kernel launch overheads. Ring steps assume ring.py's overlap (send posted before the
block's kernel, waited after) and balanced layouts' per-step work F/r.

The minimum tokens per GPU to hide the ring is where compute equals transfer on every overlapped step; compute
grows as t², transfer as t, so it is t·max(T/c) (the backward step, T + T' against 2.5·c, binds for bf16). With
packed documents the compute grows as the pairs of a longer sequence of the same documents, about linearly once
the sequence holds many documents: the smallest t whose pairs hide the transfer is searched (doubling, then
bisection), and may not exist (``None``: documents this short never give a ring step enough work, whatever the
length). Balanced layouts split every document over the ranks, so every ring step runs, with 1/r of the work.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..core.config import CPConfig
from ..core.kernels import accum_dtype
from ..core.rules import SettingNames, check_heads, check_sequence_parallel, check_tp_heads
from ..memory.flops import BACKWARD, check_documents, contiguous_rank_pairs
from ..memory.model import MemoryEstimate, estimate, layer_flops, layout_packing, param_count
from ..memory.specs import ModelSpec, ParallelSpec, ceil_div
from ..names import Backend, Framework, Recompute
from ..recompute.presets import RecomputeConfig
from .cluster import Cluster
from .costs import (attention_recompute_layers, copy_exposed, mlp_chunks, optimizer_offload, region_layers,
                    tile_mlp_forwards)
from .frameworks import check_runnable
from .prediction import Prediction

NAMES = SettingNames(seq_len="seq_len", cp="cp", tp="tp", heads="query heads", kv_heads="K/V heads")
"""What the planner calls its settings in the split rules' messages."""



def ring_step(compute_s: float, transfer_s: float) -> float:
    """The overlap rule: the time a ring step's transfer adds beyond the compute it runs under."""
    if compute_s < 0 or transfer_s < 0:
        raise ValueError(f"ring_step needs non-negative times, got compute {compute_s!r}, transfer {transfer_s!r}")
    return max(0.0, transfer_s - compute_s)


def check_heads_split(model: ModelSpec, parallel: ParallelSpec) -> None:
    """ValueError when the Ulysses axis cannot split this model's heads per TP rank
    (:func:`ctx_plugin.core.rules.check_heads`)."""
    check_heads(CPConfig(backend=parallel.backend, ulysses_size=parallel.ulysses_size),
                model.heads // parallel.tp, max(model.kv_heads // parallel.tp, 1), parallel.cp)


def _ring(t: int, r: int, c_fwd: float, kv_s: float, dkv_s: float) -> tuple[float, bool, int, float]:
    """(exposed seconds per layer, steps hidden, minimum tokens per GPU to hide, the largest transfer/compute
    ratio of a step) of a ring of r > 1 ranks."""
    c_bwd = BACKWARD * c_fwd
    fwd = [(c_fwd, kv_s)] * (r - 1)
    bwd = [(c_bwd, kv_s), *[(c_bwd, kv_s + dkv_s)] * (r - 2), (c_bwd, dkv_s)]
    steps = [ring_step(c, x) for c, x in fwd + bwd]
    need = max(x / c for c, x in fwd + bwd)
    return sum(steps) + dkv_s, not any(steps), math.ceil(round(t * need, 6)), need


def _min_tokens_documents(p: ParallelSpec, seq_len: int, t: int, need: float, pairs: int, documents) -> int | None:
    """The fewest tokens per GPU whose ring steps hide their transfers with these documents: at t' tokens per GPU a
    step's transfer/compute ratio is ``need`` (at t; ≤ 1 hides) × (t'/t) × pairs(s) / pairs(s'), s' = s·t'/t
    (transfer ∝ tokens, compute ∝ the pairs of the longer packed sequence); None when none up to 2³⁴ tokens does."""
    def hides(k: int) -> bool:
        longer = layout_packing(p, max(1, -(-seq_len * k // t)), documents).pairs
        return need * k / t * pairs <= longer
    top = 2**34 // p.cp
    hi = 1
    while not hides(hi):
        if hi >= top:
            return None
        hi = min(2 * hi, top)
    lo = hi // 2                       # hides(lo) is False (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hides(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class Footprint:
    """Where one configuration's state lives: the memory model's estimate, the GPU peak, the host bytes."""

    estimate: MemoryEstimate
    gpu_bytes: int
    """Peak bytes per GPU (the estimate's peak less the optimizer state under optimizer offload)."""
    host_bytes: int
    """Host bytes per rank: activation offload + optimizer offload."""
    optimizer_s: float
    """Exposed seconds per step of optimizer offload (0 without it)."""
    gpu_fits: bool
    host_fits: bool
    """host_bytes × GPUs per node within the node's host memory less its reserve, and the activation offload
    within its ``+offload:<GiB>`` budget (the memory model's ``fits_host``; a run stops otherwise)."""

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.host_fits


def footprint(model: ModelSpec, parallel: ParallelSpec, recompute: RecomputeConfig | str, *, seq_len: int,
              cluster: Cluster, micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16,
              offload_optimizer: bool = False, documents=None) -> Footprint:
    """Memory of one configuration on the GPU and the host, without timing it (what :func:`predict` fits; the
    longest-sequence search checks only this); ValueError (naming the fix) when the configuration cannot run: no
    framework runs it (:func:`ctx_plugin.plan.frameworks.check_runnable`), TP cannot split the heads, the layout
    cannot split the sequence or its heads, or sequence parallelism cannot split each CP rank's tokens.
    ``documents`` change no byte, only the estimate's recompute FLOPs (:func:`ctx_plugin.memory.estimate`)."""
    recompute = RecomputeConfig.parse(recompute)
    if recompute.preset == Recompute.BUDGET:
        raise ValueError("the planner compares concrete presets; give one (none, selective, full, ...) not budget")
    if not isinstance(offload_optimizer, bool):
        raise TypeError(f"offload_optimizer must be True or False, got {offload_optimizer!r}")
    p, c = parallel, cluster
    check_runnable(p.tp, p.zero_stage, offload_optimizer, p.framework)
    check_tp_heads(model.heads, model.kv_heads, p.tp, NAMES, replicate_kv=False)
    if offload_optimizer and p.framework is None:      # optimizer offload is DeepSpeed's: its model state
        p = replace(p, framework=Framework.DEEPSPEED)
    est = estimate(model, p, recompute, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, documents=documents)
    check_heads_split(model, p)
    if p.sequence_parallel:
        check_sequence_parallel(p.cp_config, seq_len, p.cp, p.tp, NAMES)
    if p.tp * p.cp * p.dp != c.gpus:
        raise ValueError(f"tp × cp × dp = {p.tp * p.cp * p.dp} must equal the cluster's {c.gpus} GPUs")
    if c.gpus_per_node % p.tp:
        raise ValueError(f"tp ({p.tp}) must divide gpus_per_node ({c.gpus_per_node}): TP stays inside a node")
    gpu, host, opt_s = est.peak, est.host, 0.0
    if offload_optimizer:
        opt_host, opt_s = optimizer_offload(param_count(model, p.tp), p.shard_degree, dtype.itemsize, c)
        gpu, host = est.offloaded_peak, host + opt_host
    return Footprint(estimate=est, gpu_bytes=gpu, host_bytes=host, optimizer_s=opt_s,
                     gpu_fits=gpu <= c.gpu_bytes,
                     host_fits=host <= c.host_bytes_per_rank and est.fits_host)


def predict(model: ModelSpec, parallel: ParallelSpec, recompute: RecomputeConfig | str, *, seq_len: int,
            cluster: Cluster, micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16,
            offload_optimizer: bool = False, documents=None) -> Prediction:
    """Memory and step time of one configuration; ValueError (naming the fix) when it cannot run. ``documents``:
    the packed documents of each sequence — None (one document), a mean length or a list of lengths
    (:mod:`ctx_plugin.memory.flops` says how they fill the sequence)."""
    recompute = RecomputeConfig.parse(recompute)
    documents = check_documents(documents)
    mem = footprint(model, parallel, recompute, seq_len=seq_len, cluster=cluster, micro_batch=micro_batch,
                    dtype=dtype, offload_optimizer=offload_optimizer, documents=documents)
    est, p, c = mem.estimate, parallel, cluster
    e = dtype.itemsize
    acc = accum_dtype(dtype).itemsize
    t, d, L = micro_batch * seq_len // p.cp, model.head_dim, model.layers
    a, g = model.heads // p.tp, max(model.kv_heads // p.tp, 1)
    rate_a, rate_m = c.attention_tflops * 1e12, c.matmul_tflops * 1e12
    dense, mlp, attn = layer_flops(model, p, t, seq_len, documents)
    packing = layout_packing(p, seq_len, documents)
    real = packing.real_tokens / seq_len
    u = p.ulysses
    r = 1 if p.backend in (Backend.ULYSSES, Backend.ALLGATHER) else p.cp // u
    busiest = 1.0
    if p.backend == Backend.RING and p.cp > 1:          # contiguous shards: the busiest rank's pairs over the mean
        ranks = contiguous_rank_pairs(seq_len, p.cp, documents)
        busiest = max(ranks) * p.cp / sum(ranks)
    attn_s = attn * busiest / rate_a
    cp_inter, a2a_inter = c.crosses_nodes(p.tp * p.cp), c.crosses_nodes(p.tp * u)
    bw = c.bandwidth(cp_inter)

    ring_s = ring_fwd_s = 0.0
    hidden = min_tokens = None
    if r > 1:
        kv_s = 2 * t * max(g, u) * d * e / bw          # t·u tokens × max(g, u)/u heads after the all-to-all
        ring_s, hidden, min_tokens, need = _ring(t, r, attn_s / r, kv_s, kv_s * acc / e)
        if documents is not None:
            min_tokens = _min_tokens_documents(p, seq_len, t, need, packing.pairs, documents)
        ring_fwd_s = (r - 1) * ring_step(attn_s / r, kv_s)
    a2a_s = (u - 1) / u * t * (2 * a + 2 * max(g, u)) * d * e / c.bandwidth(a2a_inter) if u > 1 else 0.0
    ag_fwd = ag_bwd = 0.0
    if p.backend == Backend.ALLGATHER and p.cp > 1:
        kv_bytes = (p.cp - 1) * 2 * t * g * d
        ag_fwd, ag_bwd = kv_bytes * e / bw, kv_bytes * (e + acc) / bw
    tp_s = t * model.hidden * e * (p.tp - 1) / p.tp / c.bandwidth(False)

    # the memory model's recompute FLOPs (regions, mlp, core_attn, +recompute_attn's attention, +tile_loss's head,
    # +tile_mlp's chunks outside regions), the attention at its own rate, plus the nested chunk recompute inside
    # regions that it does not count (costs.tile_mlp_forwards)
    extra = est.recompute_flops
    attn_layers = attention_recompute_layers(recompute, L)         # core_attn, +recompute_attn
    nested = tile_mlp_forwards(recompute, L, mlp_chunks(seq_len // p.cp, recompute.mlp_tokens, model.hidden))[1]
    recompute_s = (max(extra - attn_layers * attn, 0.0) + nested * mlp) / rate_m
    recompute_s += attn_layers * attn_s
    recompute_comm = attn_layers * (ring_fwd_s + 4 * a2a_s + ag_fwd)
    tp_layers = region_layers(recompute, L) * 4
    tp_layers += 2 * L if recompute.preset == Recompute.MLP else 0
    recompute_comm += tp_layers * tp_s

    head_s = 6 * t * model.hidden * ceil_div(model.vocab, p.tp) / rate_m
    compute = L * (1 + BACKWARD) * attn_s + 3 * L * dense / rate_m + head_s + recompute_s
    layer_fwd = dense / rate_m + attn_s                            # a checkpointed layer's forward; its backward
    layer_bwd = 2 * dense / rate_m + BACKWARD * attn_s + dense / rate_m + (attn_s if recompute.recompute_attention
                                                                          else 0.0)      # recomputes the region
    offload_s = copy_exposed(est.host, region_layers(recompute, L), layer_fwd, layer_bwd,
                             c.host_bandwidth)
    exposed = L * (ring_s + 2 * 4 * a2a_s + ag_fwd + ag_bwd + 8 * tp_s) + recompute_comm + offload_s + mem.optimizer_s
    model_flops = 3 * L * (dense * real + attn) + 6 * t * real * model.hidden * ceil_div(model.vocab, p.tp)
    parts = {"ring": L * ring_s, "all-to-all": L * 8 * a2a_s, "all-gather": L * (ag_fwd + ag_bwd),
             "TP collectives": L * 8 * tp_s, "recompute": recompute_s + recompute_comm, "activation offload": offload_s,
             "optimizer offload": mem.optimizer_s}
    worst = max(parts, key=parts.get)
    if not mem.gpu_fits:
        reason = f"needs {mem.gpu_bytes / 2**30:.1f} GiB > {c.gpu_room_gib:g} GiB"
    elif not mem.host_fits and mem.host_bytes <= c.host_bytes_per_rank:    # the budget stated (3 digits) binds
        reason = (f"offloads {est.host / 2**30:.2f} GiB per rank > its {recompute.offload_gib:.2f} GiB offload "
                  "budget (the host memory a rank has left, to 3 significant digits)")
    elif not mem.host_fits:
        reason = (f"needs {mem.host_bytes / 2**30:.1f} GiB of host memory per rank > "
                  f"{c.host_bytes_per_rank / 2**30:.1f} GiB")
    elif parts[worst] <= 0:
        reason = "no overhead"
    else:
        link = {"ring": cp_inter, "all-gather": cp_inter, "all-to-all": a2a_inter}.get(worst)
        where = "" if link is None else (" over InfiniBand" if link else " over NVLink")
        reason = f"largest overhead: {worst}{where} {parts[worst] * 1e3:.1f} ms"
        if hidden is not None:
            reason += (f"; ring exposed ({t:,} tokens/GPU; no length hides it with these documents)"
                       if min_tokens is None else
                       f"; ring {'hidden' if hidden else 'exposed'} ({t:,} vs {min_tokens:,} tokens/GPU)")
    step = compute + exposed
    return Prediction(backend=p.backend, cp=p.cp, ulysses_size=u, ring_size=r, tp=p.tp, dp=p.dp,
                      zero_stage=p.zero_stage, recompute=recompute, offload_optimizer=offload_optimizer,
                      memory_bytes=mem.gpu_bytes, host_bytes=mem.host_bytes, gpu_fits=mem.gpu_fits,
                      host_fits=mem.host_fits, compute_ms=compute * 1e3, recompute_ms=recompute_s * 1e3,
                      exposed_ms=exposed * 1e3, offload_ms=offload_s * 1e3, optimizer_ms=mem.optimizer_s * 1e3,
                      model_flops=model_flops, mfu=model_flops / (step * c.peak_tflops * 1e12),
                      ring_exposed_ms=L * ring_s * 1e3, tokens_per_gpu=t, real_share=real, ring_hidden=hidden,
                      min_tokens_to_hide=min_tokens, cp_inter_node=cp_inter, ulysses_inter_node=a2a_inter,
                      reason=reason, estimate=est)
