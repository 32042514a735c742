"""Pure mappings of recompute presets onto framework settings, with a clear error where a framework cannot
express a preset without re-running the CP attention (and repeating its communication)."""
from __future__ import annotations

from ..names import Recompute
from .presets import RecomputeConfig, regions


def _apply_instead(config: RecomputeConfig, framework: str, why: str) -> ValueError:
    loss = " and compute the loss with ctx_plugin.tiled_loss (+tile_loss)" if config.tile_loss else ""
    norm = ", final_norm=<the model's final norm>" if config.tile_mlp else ""
    return ValueError(f"{framework} cannot express recompute preset {config}: {why}; apply it with "
                      f"ctx_plugin.recompute.apply(layers, {str(config.for_layers)!r}{norm}){loss} instead (the "
                      f"ctx_plugin {framework} integration does this for you)")


def to_megatron(config: RecomputeConfig | str, num_layers: int, *, moe: bool = False) -> dict:
    """megatron-core ``TransformerConfig`` fields for ``config``.

    Megatron's own full recompute re-runs the core attention, so full presets are not mapped (ctx_plugin
    applies them itself, attention pinned); op-level ``selective`` has no Megatron equivalent. ``moe``: the model
    has MoE layers, whose MLP Megatron recomputes under the module name ``"moe"`` (``"mlp"`` is its dense MLP)."""
    config = RecomputeConfig.parse(config)
    if config.has_modifiers:
        raise _apply_instead(config, "Megatron", "its recompute settings have no sequence tiling or offload")
    off = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}
    if config.preset in (Recompute.NONE, Recompute.ATTN_OUT):
        return off
    if config.preset == Recompute.MLP and moe:
        return {**off, "recompute_granularity": "selective", "recompute_modules": ["mlp", "moe"]}
    if config.preset in (Recompute.CORE_ATTN, Recompute.MLP):
        return {**off, "recompute_granularity": "selective", "recompute_modules": [config.preset.value]}
    if config.preset == Recompute.SELECTIVE:
        raise _apply_instead(config, "Megatron", "its selective recompute works on whole modules (core_attn, mlp, "
                                                 "layernorm, ...), not per operation")
    if config.preset == Recompute.BUDGET:
        raise ValueError(f"resolve {config} to a concrete preset first (ctx_plugin.recompute.resolve)")
    raise _apply_instead(config, "Megatron", "its full recompute re-runs the core attention and so would repeat the "
                                             "context-parallel communication in backward")


DEEPSPEED_CHECKPOINTING = {"partition_activations": False, "contiguous_memory_optimization": False,
                           "cpu_checkpointing": False, "number_checkpoints": None,
                           "synchronize_checkpoint_boundary": False, "profile": False}
"""DeepSpeed's ``activation_checkpointing`` section with its defaults (``ACT_CHKPT_DEFAULT``)."""


def to_deepspeed(config: RecomputeConfig | str, num_layers: int) -> dict | None:
    """The ``activation_checkpointing`` section of a DeepSpeed config for ``config`` (``None``: no section).

    DeepSpeed checkpoints whole layers the model hands to ``deepspeed.checkpointing.checkpoint``; its section
    sets how (``number_checkpoints`` = regions of the stack). Partial presets have no DeepSpeed equivalent."""
    config = RecomputeConfig.parse(config)
    if config.has_modifiers:
        raise _apply_instead(config, "DeepSpeed", "its activation_checkpointing section has no sequence tiling and "
                                                  "offloads no ctx_plugin attention")
    if config.preset in (Recompute.NONE, Recompute.ATTN_OUT):
        return None
    if config.preset in (Recompute.FULL, Recompute.SQRT):
        if config.preset == Recompute.FULL and config.method == "block":
            raise _apply_instead(config, "DeepSpeed", "its activation checkpointing has no per-layer block method")
        return {**DEEPSPEED_CHECKPOINTING, "number_checkpoints": len(regions(config, num_layers))}
    if config.preset == Recompute.BUDGET:
        raise ValueError(f"resolve {config} to a concrete preset first (ctx_plugin.recompute.resolve)")
    raise _apply_instead(config, "DeepSpeed", "its activation_checkpointing section checkpoints whole layers only")
