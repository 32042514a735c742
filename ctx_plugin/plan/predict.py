"""The planner's cost model: memory from the memory model, step time from FLOPs, bytes and bandwidths.

Per GPU, per layer and micro-batch, with b the micro-batch, s the sequence length, t = b·s/cp tokens per GPU,
a = heads/tp and g = max(kv_heads/tp, 1) heads per TP rank, d the head size, e / e_acc the bytes of the dtype /
of its accumulation dtype (fp32 for bf16), u the Ulysses size and r the ring size (cp = u·r)::

    attention forward    F = 2·t·s·a·d = 4·b·s²·a·d / (cp·tp) halved (causal LM); backward 2.5·F
                         (flash-style: the kernel recomputes the scores). `ring` (contiguous, causal) runs at the
                         pace of its last rank: × (2r−1)/r. Time F / attention rate.
    dense                6·t·W (2 forward, 4 backward), W = QKV, o_proj and MLP weights per TP rank; plus the LM
                         head 6·t·h·V/tp once per step. Time / matmul rate. (FLOPs from memory.model.layer_flops.)
    recompute            the memory model's recompute_fraction × its step FLOPs 3·L·(W-FLOPs + F): at the attention
                         rate for the attention core_attn re-runs (whose forward communication runs again too), at
                         the matmul rate for the rest; `full`/`sqrt` regions and `mlp` repeat their TP collectives.
                         Selective's elementwise recompute has no FLOPs and counts zero.
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
grows as t², transfer as t, so it is t·max(T/c) (the backward step, T + T' against 2.5·c, binds for bf16).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import check_heads
from ..config import CPConfig
from ..groups import CPGroups, RankGroup
from ..kernels import accum_dtype
from ..memory.model import estimate, layer_flops
from ..memory.specs import ModelSpec, ParallelSpec, ceil_div
from ..names import Backend, Recompute
from ..recompute.presets import RecomputeConfig, regions

BACKWARD = 2.5
"""Backward attention FLOPs relative to forward (flash-style: scores recomputed inside the kernel)."""


def ring_step(compute_s: float, transfer_s: float) -> float:
    """The overlap rule: the time a ring step's transfer adds beyond the compute it runs under."""
    if compute_s < 0 or transfer_s < 0:
        raise ValueError(f"ring_step needs non-negative times, got compute {compute_s!r}, transfer {transfer_s!r}")
    return max(0.0, transfer_s - compute_s)


def _positive_number(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The machines a plan runs on. Rates are per GPU, bandwidths per direction per GPU."""

    nodes: int
    """Number of nodes."""
    gpus_per_node: int = 8
    """GPUs per node (the NVLink domain)."""
    gpu_memory_gib: float = 80.0
    """Memory budget per GPU in GiB that the memory model's peak must fit under (leave headroom for the CUDA
    context and fragmentation by giving less than the card has)."""
    intra_bw_gbs: float = 450.0
    """Intra-node bandwidth per GPU and direction in GB/s (NVLink 4 on H100/H200: 450)."""
    inter_bw_gbs: float = 50.0
    """Inter-node bandwidth per GPU and direction in GB/s (one 400 Gb/s InfiniBand NIC per GPU: 50)."""
    attention_tflops: float = 480.0
    """Attention kernel rate per GPU in TFLOP/s, counting only the FLOPs of unmasked scores (a causal block counts
    half a full one): bf16 flash attention on H200. Measure it with ``ctx-plugin bench``."""
    matmul_tflops: float = 600.0
    """Dense matmul rate per GPU in TFLOP/s (bf16 GEMMs of a transformer layer on H200)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _positive_number(self, "gpu_memory_gib", "intra_bw_gbs", "inter_bw_gbs", "attention_tflops", "matmul_tflops")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def crosses_nodes(self, group: int) -> bool:
        """Whether some group of ``group`` consecutive ranks (groups start at multiples of ``group``) spans two
        nodes; such a group communicates at the inter-node bandwidth."""
        g = self.gpus_per_node
        return any(start // g != (start + group - 1) // g for start in range(0, self.gpus, group))

    def bandwidth(self, inter: bool) -> float:
        """Bytes per second of the link a group uses."""
        return (self.inter_bw_gbs if inter else self.intra_bw_gbs) * 1e9


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """One configuration's predicted memory and step time (one micro-batch, forward and backward)."""

    backend: Backend
    """Context-parallel backend (the CPConfig default when cp = 1: no context parallelism)."""
    cp: int
    """Context-parallel size."""
    ulysses_size: int
    """Ranks of the all-to-all axis (cp for ``ulysses``, 1 for the ring family and ``allgather``)."""
    ring_size: int
    """Ranks of the ring (cp / ulysses_size; 1 for ``ulysses`` and ``allgather``, which have no ring)."""
    tp: int
    """Tensor-parallel size (with Megatron sequence parallelism when > 1)."""
    dp: int
    """Data-parallel size: GPUs / (tp·cp)."""
    recompute: RecomputeConfig
    """Recompute preset."""
    memory_bytes: int
    """Peak bytes per GPU: ``ctx_plugin.memory.estimate(...).peak``."""
    fits: bool
    """memory_bytes ≤ the cluster's GPU memory."""
    compute_ms: float
    """Attention, dense and recompute time of one micro-batch step."""
    recompute_ms: float
    """The part of compute_ms spent recomputing."""
    exposed_ms: float
    """Communication not hidden under compute (ring steps, all-to-alls, all-gathers, TP collectives)."""
    ring_exposed_ms: float
    """The part of exposed_ms from ring steps (including the last dK/dV hop, which nothing hides)."""
    tokens_per_gpu: int
    """micro_batch · seq_len / cp."""
    ring_hidden: bool | None
    """Every overlapped ring step hides its transfer (None: no ring)."""
    min_tokens_to_hide: int | None
    """Tokens per GPU from which every overlapped ring step hides its transfer on this link (None: no ring)."""
    cp_inter_node: bool
    """The context-parallel group spans nodes (its ring or all-gather runs at the inter-node bandwidth)."""
    ulysses_inter_node: bool
    """The Ulysses group spans nodes (its all-to-alls run at the inter-node bandwidth)."""
    reason: str
    """One line: what limits this configuration."""

    def __post_init__(self) -> None:
        for name in ("cp", "ulysses_size", "ring_size", "tp", "dp", "tokens_per_gpu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if min(self.compute_ms, self.recompute_ms, self.exposed_ms, self.ring_exposed_ms) < 0:
            raise ValueError("times must be non-negative")
        if self.cp % (self.ulysses_size * self.ring_size):
            raise ValueError(f"ulysses_size × ring_size must divide cp ({self.cp})")

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.exposed_ms

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Training throughput: the tokens of a step (b·s·dp) over the step time and all GPUs (tp·cp·dp)."""
        return self.tokens_per_gpu / self.tp / (self.step_ms / 1e3)

    @property
    def layout(self) -> str:
        """``zigzag cp=8 tp=1 dp=2`` (with ``u×r`` for the hybrid; ``no CP`` when cp = 1)."""
        axes = f" {self.ulysses_size}×{self.ring_size}" if self.backend == Backend.ULYSSES_RING else ""
        name = f"{self.backend.value}{axes} cp={self.cp}" if self.cp > 1 else "no CP"
        return f"{name} tp={self.tp} dp={self.dp}"


def check_heads_split(model: ModelSpec, parallel: ParallelSpec) -> None:
    """ValueError when the Ulysses axis cannot split this model's heads per TP rank (``attention.check_heads``)."""
    u = parallel.ulysses
    if u > 1:
        groups = CPGroups(config=CPConfig(backend=parallel.backend, ulysses_size=parallel.ulysses_size),
                          cp=RankGroup(None, 0, parallel.cp), ulysses=RankGroup(None, 0, u),
                          ring=RankGroup(None, 0, parallel.cp // u), device_types=frozenset())
        check_heads(model.heads // parallel.tp, max(model.kv_heads // parallel.tp, 1), groups)


def _ring(t: int, r: int, c_fwd: float, kv_s: float, dkv_s: float) -> tuple[float, bool, int]:
    """(exposed seconds per layer, steps hidden, minimum tokens per GPU to hide) of a ring of r > 1 ranks."""
    c_bwd = BACKWARD * c_fwd
    fwd = [(c_fwd, kv_s)] * (r - 1)
    bwd = [(c_bwd, kv_s), *[(c_bwd, kv_s + dkv_s)] * (r - 2), (c_bwd, dkv_s)]
    steps = [ring_step(c, x) for c, x in fwd + bwd]
    need = max(x / c for c, x in fwd + bwd)
    return sum(steps) + dkv_s, not any(steps), math.ceil(round(t * need, 6))


def predict(model: ModelSpec, parallel: ParallelSpec, recompute: RecomputeConfig | str, *, seq_len: int,
            cluster: Cluster, micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> Prediction:
    """Memory and step time of one configuration; ValueError (naming the fix) when it cannot run."""
    recompute = RecomputeConfig.parse(recompute)
    if recompute.preset == Recompute.BUDGET:
        raise ValueError("the planner compares concrete presets; give one (none, selective, full, ...) not budget")
    est = estimate(model, parallel, recompute, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype)
    check_heads_split(model, parallel)
    p, c = parallel, cluster
    if p.tp * p.cp * p.dp != c.gpus:
        raise ValueError(f"tp × cp × dp = {p.tp * p.cp * p.dp} must equal the cluster's {c.gpus} GPUs")
    if c.gpus_per_node % p.tp:
        raise ValueError(f"tp ({p.tp}) must divide gpus_per_node ({c.gpus_per_node}): TP stays inside a node")
    e = dtype.itemsize
    acc = accum_dtype(dtype).itemsize
    t, d, L = micro_batch * seq_len // p.cp, model.head_dim, model.layers
    a, g = model.heads // p.tp, max(model.kv_heads // p.tp, 1)
    rate_a, rate_m = c.attention_tflops * 1e12, c.matmul_tflops * 1e12
    dense, _, attn = layer_flops(model, p, t, seq_len)
    u = p.ulysses
    r = 1 if p.backend in (Backend.ULYSSES, Backend.ALLGATHER) else p.cp // u
    attn_s = attn * ((2 * r - 1) / r if p.backend == Backend.RING else 1.0) / rate_a
    cp_inter, a2a_inter = c.crosses_nodes(p.tp * p.cp), c.crosses_nodes(p.tp * u)
    bw = c.bandwidth(cp_inter)

    ring_s = ring_fwd_s = 0.0
    hidden = min_tokens = None
    if r > 1:
        kv_s = 2 * t * max(g, u) * d * e / bw          # t·u tokens × max(g, u)/u heads after the all-to-all
        ring_s, hidden, min_tokens = _ring(t, r, attn_s / r, kv_s, kv_s * acc / e)
        ring_fwd_s = (r - 1) * ring_step(attn_s / r, kv_s)
    a2a_s = (u - 1) / u * t * (2 * a + 2 * max(g, u)) * d * e / c.bandwidth(a2a_inter) if u > 1 else 0.0
    ag_fwd = ag_bwd = 0.0
    if p.backend == Backend.ALLGATHER and p.cp > 1:
        kv_bytes = (p.cp - 1) * 2 * t * g * d
        ag_fwd, ag_bwd = kv_bytes * e / bw, kv_bytes * (e + acc) / bw
    tp_s = t * model.hidden * e * (p.tp - 1) / p.tp / c.bandwidth(False)

    extra = est.recompute_fraction * 3 * L * (dense + attn)      # the memory model's convention, back to FLOPs
    core_attn = recompute.preset == Recompute.CORE_ATTN
    extra_attn = L * attn if core_attn else 0.0
    recompute_s = max(extra - extra_attn, 0.0) / rate_m + (L * attn_s if core_attn else 0.0)
    recompute_comm = L * (ring_fwd_s + a2a_s + ag_fwd) if core_attn else 0.0
    tp_layers = sum(stop - start for start, stop in regions(recompute, L)) * 4
    tp_layers += 2 * L if recompute.preset == Recompute.MLP else 0
    recompute_comm += tp_layers * tp_s

    head_s = 6 * t * model.hidden * ceil_div(model.vocab, p.tp) / rate_m
    compute = L * (1 + BACKWARD) * attn_s + 3 * L * dense / rate_m + head_s + recompute_s
    exposed = L * (ring_s + 2 * 4 * a2a_s + ag_fwd + ag_bwd + 8 * tp_s) + recompute_comm
    fits = est.peak <= c.gpu_memory_gib * 2**30
    parts = {"ring": L * ring_s, "all-to-all": L * 8 * a2a_s, "all-gather": L * (ag_fwd + ag_bwd),
             "TP collectives": L * 8 * tp_s, "recompute": recompute_s + recompute_comm}
    worst = max(parts, key=parts.get)
    if not fits:
        reason = f"needs {est.peak / 2**30:.1f} GiB > {c.gpu_memory_gib:g} GiB"
    elif parts[worst] <= 0:
        reason = "no overhead"
    else:
        link = {"ring": cp_inter, "all-gather": cp_inter, "all-to-all": a2a_inter}.get(worst)
        where = "" if link is None else (" over InfiniBand" if link else " over NVLink")
        reason = f"largest overhead: {worst}{where} {parts[worst] * 1e3:.1f} ms"
        if hidden is not None:
            reason += f"; ring {'hidden' if hidden else 'exposed'} ({t:,} vs {min_tokens:,} tokens/GPU)"
    return Prediction(backend=p.backend, cp=p.cp, ulysses_size=u, ring_size=r, tp=p.tp, dp=p.dp, recompute=recompute,
                      memory_bytes=est.peak, fits=fits, compute_ms=compute * 1e3, recompute_ms=recompute_s * 1e3,
                      exposed_ms=exposed * 1e3, ring_exposed_ms=L * ring_s * 1e3, tokens_per_gpu=t,
                      ring_hidden=hidden, min_tokens_to_hide=min_tokens, cp_inter_node=cp_inter,
                      ulysses_inter_node=a2a_inter, reason=reason)
