"""What one decoder layer of each block family keeps for backward, and its backward temporaries (bytes per rank).

Families (:class:`ModelSpec.family <ctx_plugin.memory.ModelSpec>`), measured tensor by tensor on CPU (see
``tests/unit/test_memory_blocks.py``; ``ctx_plugin`` and ``hf`` also at CP 2–8 with simulated ranks of every
backend), with t local tokens (b·s/cp), e bytes per element, q_w = heads·d and
kv_w = kv_heads·d per TP rank, f the MLP width:

``ctx_plugin``  (``ctx_plugin.models``) fused QKV projection, RoPE on q and k, ctx_plugin's fused RMSNorm keeping
                its input and the fp32 reciprocal RMS; SwiGLU's gate and up are one matrix product.
``hf``          Hugging Face Llama / Mistral / Qwen2: separate q/k/v projections (Qwen2's biases change nothing
                kept), ``LlamaRMSNorm`` keeping an fp32 copy of its input (the input itself in fp32), the
                normalised input and the product with its weight; cos/sin computed once per forward for the model
                ([b, s, d]); SwiGLU as two products.
``megatron``    megatron-core GPT layers from the local spec (``get_gpt_layer_local_spec`` with ctx_plugin's core
                attention, as :mod:`ctx_plugin.megatron` builds them; ``[s, b, h]``): fused QKV linear whose output
                (holding v) is kept, and with a QKV bias ``selective`` caches the product too; torch's RMSNorm
                (CUDA: a fused kernel keeping its input and the fp32 rstd; CPU: a composite keeping fp32 copies) or
                LayerNorm (statistics in fp32 on CUDA, in the input's type on CPU); unfused RoPE keeping cos and sin
                for q and for k in every layer; Megatron's fused SwiGLU keeping its input and fc2's
                (``ModelSpec.bias_activation_fusion``), or the unfused GLU keeping the SiLU output and
                ``x_linear + offset`` too. Held to measured bytes on CPU (``tests/memory_megatron.py``). Not
                measured here: Transformer-Engine specs (transformer_engine does not install on this CPU machine;
                TE's LayerNormLinear and fused RoPE keep other tensors — the estimate describes the local spec),
                the fused SwiGLU's compiled backward and CUDA's RMSNorm kernel (modelled from their saved tensors)
                and CP > 1. Regions of several layers and ``+recompute_attn`` are exact too: ctx_plugin's regions
                undo what megatron-core's ``TransformerLayer`` keeps on itself (``mlp_norm_manager``) when PyTorch
                cuts a recomputation short (``tests/unit/test_recompute_cut_short.py``).

Per layer under ``none`` (every family): two norms, the attention's kept tensors (the *pins*: q and k after
RoPE, v, the output and the fp32 LSE — what the context-parallel attention keeps, and what full/sqrt regions
keep pinned), the projections' inputs and the MLP's intermediates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..names import Backend
from .specs import FAMILIES, ModelSpec, ParallelSpec, ceil_div

__all__ = ["DEVICES", "FAMILIES", "LayerTerms", "layer_terms"]

DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class LayerTerms:
    """One layer's byte counts on one rank."""

    x: int            # the layer input (a region's checkpointed input)
    none: int         # kept under none (shared per-model tensors excluded)
    pins: int         # the attention's kept tensors (pinned under full/sqrt/selective)
    lse: int          # the LSE among them (what core_attn does not keep)
    pins_parts: tuple[int, ...]  # the same tensors copied to host memory (+offload_attn), one by one: by
                                 # elements (a view copies alone), each its own host allocation
    core_extra: int   # what core_attn keeps besides none − lse (its saved inputs where the attention held views)
    mlp_inner: int    # the MLP's intermediates (what the mlp preset and +tile_mlp drop)
    selective: int    # kept under selective
    sel_working: int  # re-materialised at once while a selective layer is recomputed
    sel_mlp: int      # the MLP's part of sel_working (a +tile_mlp layer re-materialises one chunk's instead; the
                      # rest is alive at the layer's norm backward)
    mlp_outs: int     # the MLP's projection outputs selective caches (what +tile_mlp drops from a selective layer)
    x_in_none: int    # part of ``none`` that is the layer input itself (not re-materialised by a region's recompute)
    bwd_temps: int    # a layer's backward temporaries at its worst moment (the MLP's), beyond what it kept
    mlp_temps: int    # the MLP backward temporaries alone (per token: scales with a +tile_mlp chunk)
    shared: int       # per-model tensors (HF's cos/sin), once for all layers
    mlp_weights: int  # the MLP's parameters (their gradients, summed over +tile_mlp's chunks before accumulation)
    last_weight: int  # the MLP's output projection (the first weight gradient a chunk's backward sums)
    first_weight: int  # the MLP's largest input projection (fused gate+up, or gate alone; summed last)
    chunk_copies: int  # contiguous copies of a strided +tile_mlp chunk: of its input by each projection reading it,
                       # of its output's gradient by backward (chunks of [b, s, h] with b > 1 are strided)
    head: int         # the final norm's kept tensors (the LM head's input among them)
    norm_bwd: int     # a norm's backward temporaries beyond its kept tensors and its output's slot (which its
                      # incoming gradient takes): the final norm's, and each layer's (the peak of a recomputed
                      # layer whose MLP is tiled)
    sel_norm_drop: int  # what a selective layer's recomputation no longer re-materialises when its norms are tiled
                        # (hf: and the input norm's input, which the region keeps anyway)
    grad: int         # the gradient flowing between layers
    attn_grads: int   # the attention's incoming gradient (its output's) and returned gradients alive at its
                      # buffers' worst moment (_attn_grads)

    @property
    def norm_drop(self) -> int:
        """What a norm no longer keeps when +tile_mlp chunks it: all but its input and its output (``head`` is one
        norm's kept tensors, its output among them)."""
        return self.head - 2 * self.x

    @property
    def pins_host(self) -> int:
        """Bytes of the pinned attention's host copies."""
        return sum(self.pins_parts)


def _sizes(dtype: torch.dtype) -> tuple[int, int]:
    e = torch.empty((), dtype=dtype).element_size()
    return e, torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()


def _pin_parts(t: int, q_w: int, kv_w: int, rep: int, u: int, e: int, lse: int) -> tuple[int, ...]:
    """The pinned attention tensors one by one: q, k, v, out (and with Ulysses the out handed back), the LSE."""
    if u > 1:
        return (t * q_w * e, t * kv_w * rep * e, t * kv_w * rep * e, t * q_w * e, t * q_w * e, lse)
    return (t * q_w * e, t * kv_w * e, t * kv_w * e, t * q_w * e, lse)


def _attn_grads(p: ParallelSpec, t: int, q_w: int, kv_w: int, e: int, acc: int) -> int:
    """The attention's incoming gradient, and the gradients it returns that are alive at its buffers' worst moment
    though :func:`~ctx_plugin.memory.buffers.cp_buffers` leaves them out as the layer's: under Ulysses k's and v's,
    sent back before q's; in fp32 (fp64) training the accumulators that are the returned gradients themselves (the
    all-gather's dq; the ring's dq and the dK/dV buffer that comes home)."""
    returned = 0
    if p.cp > 1 and p.ulysses > 1:
        returned = 2 * kv_w
    elif p.cp > 1 and e == acc:
        returned = q_w if p.backend == Backend.ALLGATHER else q_w + 2 * kv_w
    return t * (q_w + returned) * e


def layer_terms(m: ModelSpec, p: ParallelSpec, seq_len: int, micro_batch: int, dtype: torch.dtype,
                device: str = "cuda") -> LayerTerms:
    """``device``: where the layers run ("cuda" or "cpu"); only torch's RMSNorm in the megatron family keeps
    different tensors on each (a fused kernel on CUDA, a composite of elementwise ops on CPU)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    e, acc = _sizes(dtype)
    n = seq_len // p.cp
    t = micro_batch * n
    d = m.head_dim
    heads, kv = m.heads // p.tp, max(m.kv_heads // p.tp, 1)
    q_w, kv_w, f = heads * d, kv * d, ceil_div(m.ffn, p.tp)
    h_sp = m.hidden // p.tp if p.sequence_parallel else m.hidden
    x = t * h_sp * e
    lse = t * heads * acc
    u = p.ulysses
    rep = u // kv if kv < u else 1
    up = (2 if m.gated else 1) * f
    inner = (4 if m.gated else 2) * t * f * e
    mlp_temps = 2 * t * f * e if m.gated else t * f * e
    grad = x
    mlp_weights = (up * m.hidden + f * m.hidden + (f + m.hidden if m.mlp_bias and not m.gated else 0)) * e
    if m.family == "hf":
        norm = t * m.hidden * 4 + t * 4 + 2 * x          # fp32 copy (or the input itself), rstd, x̂, x̂·w
        if u > 1:    # head-sharded q, k, v (K/V replicated below u heads), out; the out handed back
            pins = t * (3 * q_w + 2 * kv_w * rep) * e + lse
            proj_kept = 0
        else:        # q, k after RoPE, v (the v projection's output), out (= o_proj's input)
            pins = t * (2 * q_w + 2 * kv_w) * e + lse
            proj_kept = 0
        # q_norm/k_norm (Qwen3): per head an fp32 copy (the input itself in fp32), the reciprocal RMS, x̂; their
        # outputs are read by RoPE, which keeps only cos/sin. Recomputed with the other norms under selective.
        qk = t * (4 * (q_w + kv_w) + 4 * (heads + kv) + e * (q_w + kv_w)) if m.qk_norm else 0
        none = 2 * norm + pins + proj_kept + inner + qk
        parts = _pin_parts(t, q_w, kv_w, rep, u, e, lse)
        x_in_none = x if e == 4 else 0
        v_shared = t * kv_w * e if u == 1 else 0
        selective = x + t * (q_w + 2 * kv_w) * e + 2 * x + t * up * e + pins - v_shared
        sel_working = 2 * norm + qk + t * f * e * (1 if m.gated else 0) - x_in_none
        return LayerTerms(x=x, none=none, pins=pins, pins_parts=parts, lse=lse, core_extra=0, mlp_inner=inner,
                          selective=selective,
                          sel_working=sel_working, x_in_none=x_in_none, bwd_temps=mlp_temps, mlp_temps=mlp_temps,
                          shared=2 * t * d * e, head=norm, grad=grad,     # norm_bwd: fp32 `.to`s return their input
                          norm_bwd=4 * t * m.hidden * 4 - t * 4 - (2 * x if e == 4 else 0),
                          sel_norm_drop=2 * (norm - 2 * x) + x - x_in_none,
                          mlp_weights=mlp_weights, last_weight=f * m.hidden * e,
                          first_weight=f * m.hidden * e, chunk_copies=3, sel_mlp=2 * t * f * e,
                          mlp_outs=t * up * e + x, attn_grads=_attn_grads(p, t, q_w, kv_w, e, acc))
    megatron = m.family == "megatron"
    stats_e = e if megatron and device == "cpu" else acc  # torch's LayerNorm keeps its statistics in e on CPU
    stats = t * (1 if m.norm == "rms" else 2) * stats_e
    norm = x + stats + x                                  # input, statistics, output (the projection's input)
    x_in_none, norm_bwd = x, (5 if e < 4 else 4) * t * m.hidden * 4
    if megatron and m.norm == "layer":                    # native_layer_norm_backward: incoming and input gradients
        norm_bwd = 2 * x
    if megatron and m.norm == "rms" and device == "cpu":  # fp32 copy (the input itself in fp32), rstd, fp32 x̂, out
        norm, x_in_none = 2 * t * m.hidden * 4 + t * 4 + x, (x if e == 4 else 0)
        norm_bwd = (3 if e < 4 else 2) * t * m.hidden * 4 + x      # fp32 temporaries and the incoming gradient
    qkv = t * (q_w + 2 * kv_w) * e
    q_k_out = t * (2 * q_w + kv_w) * e
    if u > 1:
        pins, qkv_extra = t * (3 * q_w + 2 * kv_w * rep) * e + lse, qkv
    else:
        pins, qkv_extra = qkv + q_k_out + lse, 0
    rope = (4 if megatron else 2) * n * d * e            # Megatron: cos and sin for q and for k, every layer
    if megatron and m.gated:      # fused SwiGLU keeps its input and fc2's; unfused: SiLU's output, x_linear + offset
        inner = (3 if m.bias_activation_fusion else 5) * t * f * e
    none = 2 * norm + pins + rope + inner
    matmul_outs = t * (2 * m.hidden + up) * e
    selective = x + qkv_extra + matmul_outs + pins
    if megatron and m.attention_bias and u == 1:          # the QKV product cached, and its sum with the bias pinned
        selective += qkv
    return LayerTerms(x=x, none=none, pins=pins, pins_parts=_pin_parts(t, q_w, kv_w, rep, u, e, lse), lse=lse,
                      core_extra=qkv + q_k_out - pins + lse,
                      mlp_inner=inner, selective=selective, sel_working=none - selective + x, x_in_none=x_in_none,
                      bwd_temps=mlp_temps, mlp_temps=mlp_temps, shared=0, head=norm,
                      norm_bwd=norm_bwd, sel_norm_drop=2 * (norm - 2 * x), grad=grad,
                      mlp_weights=mlp_weights,
                      last_weight=f * m.hidden * e,
                      first_weight=up * m.hidden * e,
                      chunk_copies=0 if megatron else 2,     # Megatron's chunks: contiguous ([s, b, h])
                      sel_mlp=inner - t * up * e, mlp_outs=t * up * e + x,
                      attn_grads=_attn_grads(p, t, q_w, kv_w, e, acc))
