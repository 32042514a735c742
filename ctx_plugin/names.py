"""The one source of names: backends, local kernels, recompute presets, frameworks.

Command-line choices, JSON validation, documentation tables and test parametrization all read these
enums; nothing else spells the names.
"""
from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    """Context-parallel attention algorithms."""

    RING = "ring"
    """Ring attention over contiguous shards (rank r holds tokens [r·S/P, (r+1)·S/P)). Unbalanced when causal."""
    ZIGZAG = "zigzag"
    """Ring attention over 2·P chunks, rank r holding chunks r and 2P−1−r: balanced causal work (Megatron's
    layout)."""
    STRIPED = "striped"
    """Ring attention with token t on rank t mod P: balanced causal work, finest interleave."""
    ULYSSES = "ulysses"
    """DeepSpeed-Ulysses: all-to-all from sequence to head sharding, full-sequence attention on heads/P heads."""
    ULYSSES_RING = "ulysses_ring"
    """Ulysses inside groups of ``ulysses_size`` ranks (a node), zigzag ring attention across the groups."""
    ALLGATHER = "allgather"
    """All-gather K/V once; each rank attends its zigzag-balanced query rows to the keys they need, one softmax."""


class Kernel(StrEnum):
    """Local (single-device) attention kernels. ``auto`` picks the fastest available one."""

    AUTO = "auto"
    TORCH = "torch"
    """Pure PyTorch math, any device and float dtype (float64 included): the reference kernel."""
    SDPA_CUDNN = "sdpa_cudnn"
    """torch's cuDNN attention entry point (CUDA, fp16/bf16)."""
    SDPA_FLASH = "sdpa_flash"
    """torch's built-in FlashAttention-2 entry point (CUDA, fp16/bf16)."""
    SDPA_CPU = "sdpa_cpu"
    """torch's blockwise flash attention for CPU (float32/float64/bf16/fp16): the fast CPU kernel."""
    FLASH_ATTN = "flash_attn"
    """The flash-attn library, 3.x (Hopper) or 2.x (CUDA, fp16/bf16)."""


class Recompute(StrEnum):
    """Recompute presets (see :mod:`ctx_plugin.recompute`); ``full``, ``budget`` take parameters after ``:``."""

    NONE = "none"
    """Save everything; nothing is recomputed."""
    ATTN_OUT = "attn_out"
    """The CP attention keeps q, k, v, its output and LSE and is never re-run; everything else saved."""
    SELECTIVE = "selective"
    """Op-level: keep matmul outputs, attention outputs and communication results; recompute the rest."""
    CORE_ATTN = "core_attn"
    """Megatron's selective recompute of the attention core: re-runs attention and its communication."""
    MLP = "mlp"
    """Recompute the MLP sub-block in backward (Megatron's recompute_modules=["mlp"])."""
    FULL = "full"
    """Recompute whole layers (``full``, ``full:uniform:N``, ``full:block:N``), attention pinned."""
    SQRT = "sqrt"
    """Chen et al. 2016: checkpoint every ⌈√L⌉ layers (groups of ⌈√L⌉ layers), attention pinned."""
    BUDGET = "budget"
    """``budget:<GiB>``: the least-recompute preset whose estimate fits the budget."""


class Modifier(StrEnum):
    """Memory modifiers added to a recompute preset with ``+`` (``full+tile_mlp+offload:64``); see
    :class:`ctx_plugin.recompute.RecomputeConfig`."""

    TILE_LOSS = "tile_loss"
    """``tile_loss[:<tokens>]``: the LM head and cross-entropy over sequence chunks of ``<tokens>`` tokens (automatic
    when omitted), each chunk's logits recomputed in backward: the full ``[tokens, vocab]`` logits never exist."""
    TILE_MLP = "tile_mlp"
    """``tile_mlp[:<tokens>]``: every layer's MLP and norms, and the final norm, over sequence chunks of ``<tokens>``
    tokens (automatic when omitted), each chunk recomputed in backward: one layer's MLP intermediates and a norm's
    fp32 copies and temporaries exist for one chunk at a time."""
    RECOMPUTE_ATTN = "recompute_attn"
    """With ``full``/``sqrt``: the attention is recomputed with its region (not pinned), re-running its ring /
    all-to-all communication in backward (Megatron's full recompute)."""
    OFFLOAD = "offload"
    """``offload:<GiB>`` with ``full``/``sqrt``: each checkpoint region's input is moved to host memory after the
    region's forward and brought back one region ahead in backward; at most ``<GiB>`` of host memory per rank."""
    OFFLOAD_ATTN = "offload_attn"
    """``offload_attn:<GiB>``: as ``offload``, and the pinned attention tensors too (same host budget)."""


class Framework(StrEnum):
    """The training frameworks ctx_plugin plugs into: what the memory model and the planner hold a layout's model
    state to (:mod:`ctx_plugin.plan.frameworks` says which layouts each runs)."""

    MEGATRON = "megatron"
    """Megatron-LM / megatron-core: tensor parallelism, ZeRO 0 or 1 (``--use-distributed-optimizer``), bf16
    gradients accumulated in fp32 by default."""
    DEEPSPEED = "deepspeed"
    """DeepSpeed (and Hugging Face models under it): ZeRO 0–3, optimizer offload, no tensor parallelism."""


class Part(StrEnum):
    """Where a rank's wall time goes in ``ctx-plugin bench --profile`` (:mod:`ctx_plugin.bench.profile`); the first
    three are also the attention's profiler ranges (:func:`ctx_plugin.core.profiling.span`)."""

    KERNEL = "kernel"
    """The local attention kernel's forward and backward calls (flash/cuDNN/efficient SDPA, flash-attn, torch)."""
    MERGE = "merge"
    """Combining partial results: the online-softmax merge (fused Triton or torch ops), gradient accumulation."""
    COPIES = "copies"
    """Data movement: K/V buffers, layout permutations, dtype casts, cat/stack/index/contiguous copies, fills."""
    OTHER = "other"
    """Any other device work (allocations, sinks, masks, ...)."""
    GAPS = "gaps"
    """Wall time with the device idle: launch and host overhead (on the CPU: host time outside every op)."""


def parse_enum(enum_cls: type[StrEnum], value: object, what: str) -> StrEnum:
    """``value`` as a member of ``enum_cls``; a clear TypeError/ValueError listing the valid names otherwise."""
    if isinstance(value, enum_cls):
        return value
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {type(value).__name__}")
    try:
        return enum_cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in enum_cls)
        raise ValueError(f"unknown {what} {value!r}; choose one of: {choices}") from None
