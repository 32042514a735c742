"""Applying a recompute preset to a stack of layers (e.g. Hugging Face decoder layers or ctx_plugin's own).

Layers keep their identity, parameters and state-dict keys: ``apply`` replaces each layer's ``forward`` on the
instance (``remove`` restores it). Regions use non-reentrant ``torch.utils.checkpoint``; ``selective`` adds
PyTorch's selective-checkpoint policy. Every region pins the CP attention (see
:mod:`ctx_plugin.recompute.pinning`), so only ``core_attn`` and the ``+recompute_attn`` modifier ever re-run
attention — and with it, its communication — in backward.

Modifiers applied here: ``+tile_mlp[:<tokens>]`` replaces every layer's ``.mlp`` forward, and its norms', by the
chunked, per-chunk-checkpointed one of :mod:`ctx_plugin.recompute.tiling` (with any preset; under ``mlp`` it
replaces the plain MLP checkpoint); ``+recompute_attn`` (``full``/``sqrt``) leaves the attention unpinned inside
the regions; ``+offload:<GiB>`` / ``+offload_attn:<GiB>`` (``full``/``sqrt``) keep each region's input (and the
pinned attention's tensors) in host memory until backward (:mod:`ctx_plugin.recompute.offload`).
``+tile_loss`` belongs to the loss (pass ``config.for_layers`` here).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..names import Recompute
from . import pinning
from .offload import HostOffload, attach, detach
from .presets import RecomputeConfig, regions
from .checkpointing import Region, tiled_selective_policy
from .tiling import TilingState, check_mlp, check_norm, layer_norms, tiled_forward

_ORIGINAL = "_ctx_plugin_original_forward"


def _parts(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` whose forward :func:`apply` may replace: the layer, its MLP and its norms."""
    mlp = getattr(layer, "mlp", None)
    return [layer, *([mlp] if isinstance(mlp, nn.Module) else []), *layer_norms(layer)]


def _hf_checkpointing(layer: nn.Module) -> bool:
    """Whether Hugging Face's own gradient checkpointing (``model.gradient_checkpointing_enable()``) is on for
    ``layer`` (transformers sets ``gradient_checkpointing`` on its ``GradientCheckpointingLayer`` modules)."""
    return getattr(layer, "gradient_checkpointing", False) is True


def _hf_conflict(config, layers: list[int]) -> ValueError:
    return ValueError(f"decoder layers {layers} use Hugging Face's own gradient checkpointing "
                      f"(model.gradient_checkpointing_enable()) and the recompute preset {config} at once: HF's "
                      "checkpoint re-runs the context-parallel attention in backward (repeating its communication) "
                      "or fails there; use one or the other: model.gradient_checkpointing_disable() to keep the "
                      "preset (whose attention stays pinned), or recompute preset 'none'")


def refuse_hf_checkpointing(layers: Sequence[nn.Module], config: RecomputeConfig) -> None:
    """A ValueError if ``config`` (any preset but ``none``, or ``none`` with a layer modifier: ``+tile_mlp``) would
    run next to HF's own gradient checkpointing (its reentrant forward runs under no_grad, where the patched layers
    cannot tell: the error would come in backward)."""
    on = [i for i, layer in enumerate(layers) if _hf_checkpointing(layer)]
    if on and config.for_layers != RecomputeConfig():
        raise _hf_conflict(config, on)


def _patch(module: nn.Module, forward, *, layers: list, index: int, config) -> None:
    """Replaces ``module.forward`` (``module`` is ``layers[index]`` or part of it); the replacement refuses to run
    while HF's gradient checkpointing is on for that layer (also when it is switched on after :func:`apply`)."""
    layer = layers[index]

    def patched(*args, **kwargs):
        if _hf_checkpointing(layer) and layer.training and torch.is_grad_enabled():
            raise _hf_conflict(config, [index])
        return forward(*args, **kwargs)

    setattr(module, _ORIGINAL, module.forward)
    module.forward = patched


def _checkpointed_module(module: nn.Module):
    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)
    return forward


def _core_recompute(forward):
    def patched(*args, **kwargs):
        with pinning.recomputing_core():
            return forward(*args, **kwargs)
    return patched


def _refuse_running_stats(layers: list[nn.Module], config: RecomputeConfig) -> None:
    """A ValueError for a module that updates running statistics in its forward (BatchNorm, InstanceNorm with
    ``track_running_stats``) in a part ``config`` re-runs in backward: the recomputation would update them a second
    time (what any buffer changed in forward goes through under activation checkpointing)."""
    preset = config.preset
    whole = preset not in (Recompute.NONE, Recompute.ATTN_OUT, Recompute.MLP, Recompute.CORE_ATTN)
    for i, layer in enumerate(layers):
        part = layer if whole else getattr(layer, "mlp", None) if config.tile_mlp or preset == Recompute.MLP else None
        if not isinstance(part, nn.Module):
            continue
        for name, module in part.named_modules():
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
                where = ("" if whole else "mlp") + ("." if name and not whole else "") + name
                raise ValueError(f"layer {i}'s {where or 'module'} ({type(module).__name__}) updates running "
                                 f"statistics in its forward: recompute preset {config} re-runs it in backward, "
                                 f"which would update them a second time; use track_running_stats=False, or a "
                                 f"preset that does not recompute it ('none', 'attn_out'"
                                 f"{'' if config.tile_mlp or preset == Recompute.MLP else ', mlp'})")


def apply(layers: Sequence[nn.Module], config: RecomputeConfig | str, *, sequence_dim: int = 1,
          final_norm: nn.Module | None = None) -> None:
    """Applies ``config`` to ``layers`` (in the order the model calls them), in place.

    The pinned attention's record/replay state is context-scoped (:mod:`ctx_plugin.recompute.pinning`), so
    no groups are needed: the regions pin whatever ``cp_attention`` calls run inside them. ``budget:<GiB>`` must
    first be resolved with :func:`ctx_plugin.recompute.resolve`. ``sequence_dim``: the sequence dimension of
    the hidden states the layers' MLPs get, for ``+tile_mlp`` (1 for ``[batch, seq, hidden]`` models, 0 for
    Megatron's ``[seq, batch, hidden]``). ``final_norm``: the model's norm after the layers (Hugging Face's
    ``model.model.norm``, Megatron's ``decoder.final_layernorm``), chunked with the layers' norms under
    ``+tile_mlp`` (its fp32 backward temporaries are otherwise as large as a layer's norm's; pass the same to
    :func:`remove`). ``+tile_loss`` is refused: the loss applies it, the layers take ``config.for_layers``."""
    config = RecomputeConfig.parse(config)
    layers = list(layers)
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise TypeError("layers must be torch.nn.Module objects")
    if final_norm is not None and not isinstance(final_norm, nn.Module):
        raise TypeError(f"final_norm must be a torch.nn.Module or None, got {type(final_norm).__name__}")
    if any(hasattr(m, _ORIGINAL) for m in _patchable(layers, final_norm)):
        raise ValueError("a recompute preset is already applied to these layers (or this final norm); call "
                         "ctx_plugin.recompute.remove(layers, final_norm=...) first, with the final norm given to "
                         "apply")
    preset = config.preset
    if config.tile_loss:
        raise ValueError(f"+tile_loss in {config} is applied by the loss (the LM head and cross-entropy over "
                         f"sequence chunks: ctx_plugin's tiled loss), not by the layers; pass config.for_layers "
                         f"({config.for_layers}) here and compute the loss with the tiled loss")
    if preset == Recompute.BUDGET:
        raise ValueError(f"{config} must be resolved to a concrete preset first: "
                         "ctx_plugin.recompute.resolve(config, model=..., parallel=..., ...)")
    if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int) or sequence_dim < 0:
        raise ValueError(f"sequence_dim must be a non-negative int (1 for [batch, seq, hidden], 0 for Megatron's "
                         f"[seq, batch, hidden]), got {sequence_dim!r}")
    refuse_hf_checkpointing(layers, config)
    _refuse_running_stats(layers, config)
    spans = regions(config, len(layers)) if preset in (Recompute.FULL, Recompute.SQRT) else []  # its error: nothing
    # patched yet
    if config.tile_mlp:
        for i, layer in enumerate(layers):
            check_mlp(getattr(layer, "mlp", None), i)
            for norm in layer_norms(layer):
                check_norm(norm, f"layer {i}'s norms")
        if final_norm is not None:
            check_norm(final_norm, "the final norm")
    elif preset == Recompute.MLP:
        missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, "mlp", None), nn.Module)]
        if missing:
            raise ValueError(f"the mlp preset needs layers with an `.mlp` submodule; layers {missing} have none")
    patch = partial(_patch, layers=layers, config=config)
    tiling = TilingState()
    for i, layer in enumerate(layers):            # +tile_mlp: every preset; under `mlp` it replaces the checkpoint
        if config.tile_mlp:
            for part in (layer.mlp, *layer_norms(layer)):
                tiled = tiled_forward(part, part.forward, tokens=config.mlp_tokens, sequence_dim=sequence_dim,
                                      state=tiling)
                patch(part, tiled, index=i)
        elif preset == Recompute.MLP:
            patch(layer.mlp, _checkpointed_module(layer.mlp), index=i)
    if config.tile_mlp and final_norm is not None:      # outside the layers: HF's checkpointing never covers it
        setattr(final_norm, _ORIGINAL, final_norm.forward)
        final_norm.forward = tiled_forward(final_norm, final_norm.forward, tokens=config.mlp_tokens,
                                           sequence_dim=sequence_dim, state=tiling)
    if preset in (Recompute.NONE, Recompute.ATTN_OUT, Recompute.MLP):
        return      # nothing else is recomputed; the CP attention already keeps only q, k, v, out and LSE
    if preset == Recompute.CORE_ATTN:
        warnings.warn("recompute preset core_attn re-runs the context-parallel attention in backward, repeating "
                      "its ring/all-to-all communication, and saves no memory over 'none' with ctx_plugin's "
                      "flash-style attention; prefer 'selective' or 'full'", stacklevel=2)
        for i, layer in enumerate(layers):
            patch(layer, _core_recompute(layer.forward), index=i)
        return
    if preset == Recompute.SELECTIVE:
        policy = partial(tiled_selective_policy, tiling) if config.tile_mlp else None
        for i, layer in enumerate(layers):
            patch(layer, Region([layer], selective=True, policy=policy).run, index=i)
        return
    offload = HostOffload.from_config(config)      # one host budget for the whole stack
    for start, stop in spans:      # full, full:uniform:N, full:block:N, sqrt
        region = Region(layers[start:stop], selective=False,
                         pinned=not config.recompute_attention, offload=offload)
        attach(layers[start:stop], offload)
        patch(layers[start], region.run, index=start)
        for position in range(1, stop - start):
            patch(layers[start + position], partial(region.later, position), index=start + position)


def _patchable(layers: Sequence[nn.Module], final_norm: nn.Module | None) -> list[nn.Module]:
    """Every module whose forward :func:`apply` may replace: each layer, its MLP and norms, and the final norm."""
    return [*(m for layer in layers for m in _parts(layer)), *([] if final_norm is None else [final_norm])]


def remove(layers: Sequence[nn.Module], *, final_norm: nn.Module | None = None) -> None:
    """Undoes :func:`apply` on ``layers`` and ``final_norm`` (no-op for those without a preset)."""
    for layer in layers:
        detach(layer)
    for module in _patchable(layers, final_norm):
        if hasattr(module, _ORIGINAL):
            del module.forward           # the instance attribute; the class's forward shows again
            delattr(module, _ORIGINAL)
