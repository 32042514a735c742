"""The activation-memory model: bytes per GPU for a decoder-only transformer under a recompute preset.

Activations are counted tensor by tensor for the block ctx_plugin trains (``ctx_plugin.models``: pre-norm,
fused QKV projection, RoPE, CP attention, SwiGLU or GELU MLP), so they match what a forward pass really keeps
for backward (the tests measure it on CPU and hold it to the exact byte). Per layer and rank, with t = b·s/cp
local tokens, e bytes per element, q_w = heads·d and kv_w = kv_heads·d per TP rank::

    none / attn_out   x, norm stats, norm out, [attention], RoPE cos/sin, x₂, stats, norm out, MLP (4f | 2f)
    [attention]       ring family: fused QKV output (v is a view of it), q, k after RoPE, out (= o_proj input), LSE
                      Ulysses: head-sharded q, k, v (K/V replicated when kv_heads < u), out, LSE, and the out
                      handed back (o_proj input)
    core_attn         none without LSE (attention re-run in backward: it keeps its inputs, not its results)
    mlp               none without the MLP's intermediates (the MLP input stays, as checkpoint input)
    selective         x, matmul outputs (QKV, o_proj, MLP up, MLP down) and the pinned attention
    full / sqrt       per checkpoint region: its input x, plus the pinned attention of each of its layers

That is Korthikanti et al.'s ``s·b·h·(34 + 5as/h)`` for this block, with flash-style attention (no 5as/h
term) and without dropout; context parallelism divides s by cp, tensor parallelism divides the head and MLP
terms by t (and, with sequence parallelism, the rest too).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import CPConfig
from ..layouts import shard_layout
from ..names import Backend, Recompute
from ..recompute.presets import RecomputeConfig, candidates, regions
from .specs import ModelSpec, ParallelSpec, ceil_div

GiB = 2**30


@dataclass(frozen=True)
class _Terms:
    """Per-layer tensor sizes in bytes on one rank."""

    x: int             # a residual-stream activation (the layer input, or x₂)
    stats: int         # one norm's statistics (fp32)
    norm_out: int      # one norm's output (the next projection's input)
    rope: int          # cos/sin of the two RoPE applications (per position, not per sequence)
    qkv: int           # the fused QKV projection output
    q_k_out: int       # q and k after RoPE, and the attention output, in local layout
    attn: int          # what the attention keeps for backward plus the output it returns
    lse: int
    mlp_inner: int     # MLP intermediates kept under none
    matmul_outs: int   # o_proj, MLP up and down outputs (what selective caches besides QKV)
    qkv_extra: int     # QKV output cached by selective when the attention does not already keep it


def _terms(m: ModelSpec, p: ParallelSpec, seq_len: int, micro_batch: int, dtype: torch.dtype) -> _Terms:
    e = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    n = seq_len // p.cp
    t = micro_batch * n
    d = m.head_dim
    heads, kv = m.heads // p.tp, max(m.kv_heads // p.tp, 1)
    q_w, kv_w, f = heads * d, kv * d, ceil_div(m.ffn, p.tp)
    h_sp = m.hidden // p.tp if p.sequence_parallel else m.hidden
    qkv = t * (q_w + 2 * kv_w) * e
    q_k_out = t * (2 * q_w + kv_w) * e
    lse = t * heads * acc
    u = p.ulysses
    if u > 1:   # head-sharded q, k, v (K/V replicated when there are fewer K/V heads than u), out, and the
        rep = u // kv if kv < u else 1      # out handed back in local layout (o_proj's input)
        attn, qkv_extra = t * (3 * q_w + 2 * kv_w * rep) * e + lse, qkv
    else:       # the fused QKV output (v is a view of it), q and k after RoPE, out (= o_proj's input)
        attn, qkv_extra = qkv + q_k_out + lse, 0
    up = (2 if m.gated else 1) * f
    return _Terms(x=t * h_sp * e, stats=t * (1 if m.norm == "rms" else 2) * acc, norm_out=t * h_sp * e,
                  rope=2 * n * d * e, qkv=qkv, q_k_out=q_k_out, attn=attn, lse=lse,
                  mlp_inner=t * (4 if m.gated else 2) * f * e, matmul_outs=t * (2 * m.hidden + up) * e,
                  qkv_extra=qkv_extra)


def _layer_none(k: _Terms) -> int:
    return 2 * (k.x + k.stats + k.norm_out) + k.attn + k.rope + k.mlp_inner


def layer_activations(m: ModelSpec, p: ParallelSpec, recompute: RecomputeConfig, *, seq_len: int,
                      micro_batch: int, dtype: torch.dtype) -> list[int]:
    """Bytes each layer keeps for backward on one rank (a region's input is charged to its first layer)."""
    k = _terms(m, p, seq_len, micro_batch, dtype)
    none = _layer_none(k)
    preset = recompute.preset
    if preset in (Recompute.NONE, Recompute.ATTN_OUT):
        return [none] * m.layers
    if preset == Recompute.CORE_ATTN:   # attention keeps its local inputs (fused QKV, q, k) and o_proj the out
        return [none - k.attn + k.qkv + k.q_k_out] * m.layers
    if preset == Recompute.MLP:
        return [none - k.mlp_inner] * m.layers
    if preset == Recompute.SELECTIVE:
        return [k.x + k.qkv_extra + k.matmul_outs + k.attn] * m.layers
    if preset == Recompute.BUDGET:
        raise ValueError(f"resolve {recompute} first (ctx_plugin.recompute.resolve)")
    sizes = [none] * m.layers
    for start, stop in regions(recompute, m.layers):
        for i in range(start, stop):
            sizes[i] = k.attn + (k.x if i == start else 0)
    return sizes


def param_count(m: ModelSpec, tp: int = 1) -> int:
    """Parameters held by one tensor-parallel rank (norms replicated)."""
    kv_w = max(m.kv_heads // tp, 1) * m.head_dim
    q_w, f = m.hidden // tp, ceil_div(m.ffn, tp)
    norm = (1 if m.norm == "rms" else 2) * m.hidden
    mlp = 3 * m.hidden * f if m.gated else 2 * m.hidden * f + f + m.hidden
    layer = m.hidden * (q_w + 2 * kv_w) + q_w * m.hidden + mlp + 2 * norm
    embed = ceil_div(m.vocab, tp) * m.hidden
    return m.layers * layer + embed * (1 if m.tied_embeddings else 2) + norm


def _cp_buffers(m: ModelSpec, p: ParallelSpec, t: int, seq_len: int, micro_batch: int, e: int, acc: int) -> int:
    """Transient communication buffers of one attention call (backward, its peak), bytes per rank."""
    if p.cp == 1:
        return 0
    d, u = m.head_dim, p.ulysses
    heads, kv = m.heads // p.tp, max(m.kv_heads // p.tp, 1)
    if p.backend == Backend.ALLGATHER:   # gathered K/V (+ reordered copy), full dK/dV in fp32 (+ sharded copy)
        full_kv = 2 * micro_batch * seq_len * kv * d
        return 2 * full_kv * e + 2 * full_kv * acc
    ring_tokens, kv_heads = t * u, (max(kv, u) if u > 1 else kv) // u
    a2a = 2 * t * (heads + 2 * max(kv, u)) * d * e if u > 1 else 0      # send + receive copies of q, k, v
    if p.backend == Backend.ULYSSES:
        return a2a
    kv_block = 2 * ring_tokens * kv_heads * d
    dq = ring_tokens * heads // u * d * acc
    return a2a + 2 * kv_block * e + 3 * kv_block * acc + dq   # K/V + spare, dK/dV ×2 + incoming (fp32), dQ


def layer_flops(m: ModelSpec, p: ParallelSpec, t: int, seq_len: int) -> tuple[float, float, float]:
    """(projection+MLP, MLP, attention) forward FLOPs of one layer on one rank (causal attention halved)."""
    d, f = m.head_dim, ceil_div(m.ffn, p.tp)
    q_w, kv_w = m.heads // p.tp * d, max(m.kv_heads // p.tp, 1) * d
    mlp = 2 * t * m.hidden * f * (3 if m.gated else 2)
    proj = 2 * t * m.hidden * (2 * q_w + 2 * kv_w)
    return proj + mlp, mlp, 2 * t * seq_len * q_w


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU (one rank) for one training step's peak, and the recompute it costs."""

    params: int
    grads: int
    optimizer: int
    activations: int
    """Kept for backward, all layers plus the final norm/head inputs."""
    per_layer: list[int] = field(repr=False)
    """Activations kept by each layer."""
    recompute_peak: int
    """Activations re-materialised at once while the largest region is recomputed in backward."""
    cp_buffers: int
    """Transient context-parallel communication buffers of one attention call."""
    logits_peak: int
    """Logits, their fp32 copy and the saved log-softmax at the loss."""
    recompute_fraction: float
    """Extra FLOPs of recomputation relative to a step's forward+backward FLOPs."""

    @property
    def peak(self) -> int:
        """Static state + kept activations + the largest transient (loss, or recompute + communication)."""
        return self.params + self.grads + self.optimizer + self.activations + \
            max(self.logits_peak, self.recompute_peak + self.cp_buffers)


def estimate(model: ModelSpec, parallel: ParallelSpec, recompute: RecomputeConfig | str, *, seq_len: int,
             micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """Memory per GPU of one training step (mixed-precision Adam: params and grads in ``dtype``, fp32 master
    weights and moments; float32 training keeps no master copy)."""
    recompute = RecomputeConfig.parse(recompute)
    if recompute.has_modifiers:
        raise ValueError(f"the memory model does not describe recompute modifiers yet ({recompute}); estimate "
                         f"{recompute.base}")
    if not isinstance(model, ModelSpec) or not isinstance(parallel, ParallelSpec):
        raise TypeError("estimate(model=ModelSpec, parallel=ParallelSpec, ...)")
    unit = shard_layout(CPConfig(backend=parallel.backend, ulysses_size=parallel.ulysses_size)).unit(parallel.cp)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1 or seq_len % unit:
        raise ValueError(f"seq_len must be a positive multiple of {unit} ({parallel.backend} over cp={parallel.cp}), "
                         f"got {seq_len!r}")
    if model.heads % (parallel.tp * parallel.ulysses):
        raise ValueError(f"heads ({model.heads}) must divide by tp × Ulysses size ({parallel.tp * parallel.ulysses})")
    e = torch.empty((), dtype=dtype).element_size()
    acc = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    n_params = param_count(model, parallel.tp)
    opt_bytes = 8 if dtype == torch.float32 else 12
    z, shards = parallel.zero_stage, parallel.shard_degree
    params = n_params * e // (shards if z >= 3 else 1)
    grads = n_params * e // (shards if z >= 2 else 1)
    optimizer = n_params * opt_bytes // (shards if z >= 1 else 1)
    per_layer = layer_activations(model, parallel, recompute, seq_len=seq_len, micro_batch=micro_batch, dtype=dtype)
    k = _terms(model, parallel, seq_len, micro_batch, dtype)
    t = micro_batch * seq_len // parallel.cp
    head = k.x + k.stats + k.norm_out                         # final norm input and output (the head's input)
    none = _layer_none(k)
    preset = recompute.preset
    spans = [stop - start for start, stop in regions(recompute, model.layers)]
    if spans:
        working = max(spans) * none
    else:
        working = {Recompute.SELECTIVE: none - per_layer[0], Recompute.MLP: k.mlp_inner}.get(preset, 0)
    full_step, mlp, attn = layer_flops(model, parallel, t, seq_len)
    step = 3 * model.layers * (full_step + attn)
    extra = {Recompute.MLP: model.layers * mlp, Recompute.CORE_ATTN: model.layers * attn}.get(preset, 0.0)
    extra += sum(spans) * full_step
    vocab = ceil_div(model.vocab, parallel.tp)
    return MemoryEstimate(params=params, grads=grads, optimizer=optimizer, activations=sum(per_layer) + head,
                          per_layer=per_layer, recompute_peak=max(working, 0),
                          cp_buffers=_cp_buffers(model, parallel, t, seq_len, micro_batch, e, acc),
                          logits_peak=t * vocab * (e + 2 * acc), recompute_fraction=extra / step)


def resolve(recompute: RecomputeConfig | str, model: ModelSpec, parallel: ParallelSpec, *, seq_len: int,
            micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> RecomputeConfig:
    """``budget:<GiB>`` → among the presets whose estimated peak fits, the one with the least estimated recompute
    (:attr:`MemoryEstimate.recompute_fraction`, extra FLOPs); ties go to the preset without elementwise recompute
    (``none`` before ``selective``, whose recomputed norms and activations the FLOP estimate counts as free), then
    to the smaller peak. Other presets are returned unchanged. Also ``ctx_plugin.recompute.resolve``."""
    recompute = RecomputeConfig.parse(recompute)
    if recompute.preset != Recompute.BUDGET:
        return recompute
    if recompute.has_modifiers:
        raise ValueError(f"the memory model does not describe recompute modifiers yet ({recompute}); resolve "
                         f"{recompute.base}")
    budget = recompute.budget_gib * GiB
    estimates = [(candidate, estimate(model, parallel, candidate, seq_len=seq_len, micro_batch=micro_batch,
                                      dtype=dtype)) for candidate in candidates(model.layers)]
    fits = [(c, est) for c, est in estimates if est.peak <= budget]
    if fits:     # min keeps the first of equal keys: candidates' order (none before attn_out)
        return min(fits, key=lambda ce: (ce[1].recompute_fraction, ce[0].preset == Recompute.SELECTIVE,
                                         ce[1].peak))[0]
    smallest, est = min(estimates, key=lambda ce: ce[1].peak)
    raise ValueError(f"no recompute preset fits {recompute.budget_gib:g} GiB per GPU: the smallest estimate is "
                     f"{est.peak / GiB:.1f} GiB ({smallest}); raise the budget, the context-parallel size, tensor "
                     f"parallelism or the ZeRO stage, or shorten the sequence")
