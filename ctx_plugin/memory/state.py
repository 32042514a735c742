"""Model state per GPU as the framework that trains it holds it: parameters, gradients, optimizer state, the
framework's own buffers, and the transients of its optimizer step and (ZeRO-3) of its parameter gathers.

Megatron-LM (``megatron.training``; read in its sources, megatron-core 0.19): parameters in the training dtype
(a contiguous buffer, whole on every rank: no ZeRO-3); gradients in a whole-model buffer (``main_grad``) in fp32
when training in bf16 (``validate_args`` sets ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16``
or ``--main-grads-dtype bf16``), else in the training dtype; the distributed optimizer (ZeRO-1) reduce-scatters in
that buffer and shards only fp32 master weights and Adam's two moments over data × context parallel ranks. Master
gradients are views of an fp32 buffer (no copy); with a 16-bit buffer the step makes an fp32 copy of the rank's
share, alive until the next ``zero_grad`` (before the next forward: a step transient). fp32 training keeps no master
copy. Adam is Transformer Engine's or apex's fused multi-tensor update (no whole-model temporary; Megatron's
fallback without them, torch's AdamW, adds 4 bytes per element of the rank's share at the step: not counted).

DeepSpeed (0.19.8, bf16/fp16 without ``data_types``, so gradients in the training dtype; Adam from the config with
``torch_adam``, i.e. torch's AdamW, whose default on GPUs is the foreach update with one fp32 temporary per
element it steps; its moments are created at the first step), with the zero_optimization defaults
(:class:`ctx_plugin.memory.specs.ZeroSettings`). Measured on CPU ranks (live tensor bytes after init, at the
backward's and the step's peaks, every stage, to within the activations' bytes), P parameters per rank, N ZeRO
shards, B the reduce bucket in elements, all in bytes per rank:

* ZeRO-0 (``FP16_UnfusedOptimizer``): 2P params, 2P gradients, 12P fp32 master and moments; the step copies every
  gradient to fp32 (4P) and the foreach update adds 4P: 24P at the step.
* ZeRO-1/2 (``DeepSpeedZeroOptimizer``): 2P params, 12P/N; the reduction bucket (2B, allocated at the first
  gradient of every backward, freed after its reduction) and its flattened copy before each all-reduce (up to 2B);
  the rank's bf16 gradient partition (2P/N, until the step). ZeRO-1 keeps every full gradient (2P) until the
  reduction after backward; ZeRO-2 only the one being reduced (up to the largest parameter). The step makes the
  partition fp32 (4P/N) and the update adds 4P/N: 2P + 20P/N.
* ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): 2P/N params, 2P/N bf16 gradient partition, 12P/N, parameters below
  the persistence threshold whole on every rank, and the reduction bucket (2B) allocated at init and kept, with the
  reduce-scatter's concatenated copy (2B) while it runs. Forward/backward hold gathered parameters: the module in
  use (the largest: the head or the embedding), the prefetch bucket, the parameters whose next use lies within the
  reuse distance (the last layers and the head stay gathered from their forward to their backward: about half the
  distance, in elements) and a full parameter's gradient before its reduce-scatter. The step works one sub-group
  at a time (at most ``sub_group_size`` elements of the rank's partition): flattened and made fp32 (4 bytes per
  element) plus the update's temporary (4).

With DeepSpeed's FusedAdam (its default on GPUs without ``torch_adam``: a multi-tensor update) the step has no
such temporary, so the step's peak is counted 4 bytes per stepped element high there (never low).

Read in the sources and not measured: ZeRO-3's working set at scale (the reuse distance, the head's gradient);
gloo's reduce-scatter copies its input once more (NCCL does not: not counted). Allocator caching, fragmentation,
NCCL's own buffers and the CUDA context are not counted, for either framework.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..names import Framework
from .specs import ModelSpec, ParallelSpec, ZeroSettings, ceil_div


@dataclass(frozen=True)
class ModelState:
    """Bytes per GPU of the model state (see the module docstring)."""

    params: int
    grads: int
    optimizer: int
    """fp32 master weights (16-bit training) and Adam's two moments."""
    buffers: int = 0
    """The framework's buffers alive through forward and backward (DeepSpeed's gradient reduction bucket)."""
    gathered: int = 0
    """ZeRO-3: the gathered parameters alive next to the activations at the worst moment of a step."""
    step: int = 0
    """All the model state alive at the optimizer step's peak (activations are gone by then): parameters,
    optimizer state, the gradients then, their fp32 copies and the update's temporaries."""

    @property
    def extra(self) -> int:
        """What the framework holds beyond parameters, gradients and optimizer state next to the activations."""
        return self.buffers + self.gathered

    @property
    def training(self) -> int:
        """All of it next to the activations (what differs between ZeRO stages at any length)."""
        return self.params + self.grads + self.optimizer + self.extra


def grad_dtype_default(framework: Framework, dtype: torch.dtype) -> torch.dtype:
    """The gradient buffer's dtype when nothing overrides it: Megatron accumulates bf16 training's gradients in
    fp32; DeepSpeed keeps them in the training dtype (``data_types.grad_accum_dtype`` unset)."""
    if framework == Framework.MEGATRON and dtype == torch.bfloat16:
        return torch.float32
    return dtype


def megatron_state(n_params: int, zero_stage: int, shards: int, dtype: torch.dtype,
                   grad_dtype: torch.dtype) -> ModelState:
    """Megatron's model state (module docstring); ``zero_stage`` 1 is ``--use-distributed-optimizer``."""
    e, g = dtype.itemsize, grad_dtype.itemsize
    share = shards if zero_stage >= 1 else 1
    master = 0 if dtype == torch.float32 else 4
    params, grads, optimizer = n_params * e, n_params * g, n_params * (master + 8) // share
    copies = 4 * n_params // share if master and g < 4 else 0
    return ModelState(params=params, grads=grads, optimizer=optimizer, step=params + grads + optimizer + copies)


def model_state(m: ModelSpec, parallel: ParallelSpec, n_params: int, dtype: torch.dtype) -> ModelState:
    """The model state of ``m`` (``n_params`` per tensor-parallel rank) on ``parallel.runs_on``; ValueError for a
    gradient dtype the framework does not run."""
    framework, z, shards = parallel.runs_on, parallel.zero_stage, parallel.shard_degree
    if parallel.tp > 1 and z > 1:          # (with framework megatron ParallelSpec refuses it already)
        raise ValueError(f"tp={parallel.tp} with ZeRO-{z}: no supported framework runs it (Megatron's distributed "
                         f"optimizer is ZeRO-1; DeepSpeed has no tensor parallelism): use ZeRO 0 or 1 with tp > 1, "
                         f"or tp 1")
    grad_dtype = parallel.grad_dtype or grad_dtype_default(framework, dtype)
    if framework == Framework.MEGATRON:
        if grad_dtype not in (torch.float32, dtype):
            raise ValueError(f"grad_dtype {grad_dtype} with {dtype} training: Megatron keeps gradients in fp32 or in "
                             f"the training dtype")
        return megatron_state(n_params, z, shards, dtype, grad_dtype)
    if grad_dtype != dtype:
        raise ValueError(f"grad_dtype {grad_dtype} with {dtype} training on DeepSpeed (data_types.grad_accum_dtype): "
                         f"the memory model holds DeepSpeed's gradients in the training dtype only; leave "
                         f"grad_accum_dtype unset, or estimate with framework megatron for fp32 gradients")
    q_w, kv_w = m.hidden // parallel.tp, max(m.kv_heads // parallel.tp, 1) * m.head_dim
    norms = 1 if m.norm == "rms" else 2                      # weight (and bias) of each norm
    small = [(m.hidden, norms * (2 * m.layers + 1)), (m.head_dim, 2 * m.layers if m.qk_norm else 0),
             (m.position_embeddings * m.hidden, 1 if m.position_embeddings else 0)]
    if m.attention_bias:
        small += [(q_w, m.layers), (kv_w, 2 * m.layers)]
    if m.output_bias:
        small += [(m.hidden, m.layers)]
    if m.mlp_bias:                         # gate and up (Megatron: one fused fc1 of both) or fc1, and down
        f = ceil_div(m.ffn, parallel.tp)
        up = [(2 * f, m.layers)] if m.gated and m.family == "megatron" else [(f, (2 if m.gated else 1) * m.layers)]
        small += up + [(m.hidden, m.layers)]
    threshold = parallel.zero_settings.stage3_param_persistence_threshold
    persistent = sum(numel * count for numel, count in small if numel <= threshold)
    largest = max(ceil_div(m.vocab, parallel.tp) * m.hidden, m.hidden * ceil_div(m.ffn, parallel.tp),
                  m.position_embeddings * m.hidden)
    return deepspeed_state(n_params, z, shards, dtype, parallel.zero_settings, largest=largest,
                           persistent=persistent)


def deepspeed_state(n_params: int, zero_stage: int, shards: int, dtype: torch.dtype, zero: ZeroSettings, *,
                    largest: int, persistent: int) -> ModelState:
    """DeepSpeed's model state (module docstring); ``largest``: the largest parameter's elements, ``persistent``:
    the elements of the parameters below the ZeRO-3 persistence threshold."""
    e, P, N = dtype.itemsize, n_params, shards
    bucket = zero.reduce_bucket_size
    master = 0 if dtype == torch.float32 else 4
    opt = P * (master + 8)
    fp32_copy = 4 if master else 0          # the step's fp32 gradients (none to make in fp32 training)
    if zero_stage == 0:
        return ModelState(params=P * e, grads=P * e, optimizer=opt, step=P * e + P * (fp32_copy + 4) + P * e + opt)
    reduction = bucket * e + min(bucket, P) * e
    if zero_stage in (1, 2):
        partition = P * e // N
        grads = partition + (P * e if zero_stage == 1 else largest * e)
        return ModelState(params=P * e, grads=grads, optimizer=opt // N, buffers=reduction,
                          step=P * e + opt // N + P * (fp32_copy + 4) // N)
    sub_group = min(ceil_div(P, N), zero.sub_group_size)
    params = P * e // N + persistent * e
    held = zero.stage3_max_reuse_distance // 2 + largest + zero.stage3_prefetch_bucket_size
    gathered = min(P, held) * e + largest * e
    return ModelState(params=params, grads=P * e // N, optimizer=opt // N, buffers=2 * bucket * e,
                      gathered=gathered,
                      step=params + P * e // N + opt // N + bucket * e + sub_group * (fp32_copy + 4))
