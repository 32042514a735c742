"""Applying a recompute preset to a stack of layers (e.g. Hugging Face decoder layers or ctx_plugin's own).

Layers keep their identity, parameters and state-dict keys: ``apply`` replaces each layer's ``forward`` on the
instance (``remove`` restores it). Regions use non-reentrant ``torch.utils.checkpoint``; ``selective`` adds
PyTorch's selective-checkpoint policy. Every region pins the CP attention (see :mod:`ctx_plugin.pinning`), so
only ``core_attn`` ever re-runs attention — and with it, its communication — in backward.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..groups import CPGroups
from ..names import Recompute
from ..pinning import AttentionPins, Recording, Reusable
from .presets import RecomputeConfig, regions

_ORIGINAL = "_ctx_plugin_original_forward"
_aten = torch.ops.aten
# What "selective" keeps: matrix products and fused attention kernels (costly to recompute) ...
_SAVE_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                       _aten._scaled_mm.default, _aten._scaled_dot_product_flash_attention.default,
                       _aten._scaled_dot_product_cudnn_attention.default,
                       _aten._scaled_dot_product_efficient_attention.default,
                       _aten._scaled_dot_product_flash_attention_for_cpu.default})
# ... and every communication result (tensor/sequence-parallel collectives of the layer).
_COMM_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d"})


def _selective_policy(pins: AttentionPins, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if pins.in_attention:      # the pinned attention is replayed whole, never op by op
        return CheckpointPolicy.PREFER_RECOMPUTE
    if op in _SAVE_OPS or getattr(op, "namespace", "") in _COMM_NAMESPACES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@contextmanager
def _entered(*managers):
    with ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


def _hidden(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def _input(args: tuple, kwargs: dict):
    """The hidden states a layer is called with: the first positional argument, or ``hidden_states=``
    (Megatron's TransformerBlock passes it by keyword)."""
    return args[0] if args else kwargs.get("hidden_states")


def _with_input(hidden, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class _Region:
    """Layers ``forwards`` checkpointed as one region: only the region's input is stored (plus the pinned
    attention); in backward the region's forward runs again with attention replayed."""

    def __init__(self, forwards: list, pins: AttentionPins, selective: bool) -> None:
        self.forwards, self.pins, self.selective = forwards, pins, selective
        self.last = None

    def _contexts(self):
        # One Recording per forward run (several may be in flight before their backwards); the recompute context
        # is entered once per backward (more than once with retain_graph=True), so it is built anew each time.
        run = Recording(once=self.selective)
        record = self.pins.recording(run)
        if not self.selective:
            return record, Reusable(partial(self.pins.replaying, run))
        sac_fwd, sac_recompute = create_selective_checkpoint_contexts(partial(_selective_policy, self.pins))
        return _entered(sac_fwd, record), Reusable(lambda: _entered(self.pins.replaying(run), sac_recompute))

    def _body(self, *args, **kwargs):
        out = None
        for fwd in self.forwards:
            out = fwd(*args, **kwargs)
            args, kwargs = _with_input(_hidden(out), args, kwargs)
        return out

    def run(self, *args, **kwargs):
        if torch.is_grad_enabled():
            out = checkpoint(self._body, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)
        else:
            out = self._body(*args, **kwargs)
        self.last = out if len(self.forwards) > 1 else None
        return out

    def pass_through(self, position: int, *args, **kwargs):
        """A later layer of the region: its work is already done; hand on the region's output."""
        out = self.last
        if out is None or _hidden(out) is not _input(args, kwargs):
            raise RuntimeError("a layer inside a multi-layer recompute region was called with something other than "
                               "the previous layer's output; apply full:uniform:N / sqrt only to layers the model "
                               "calls one after another")
        if position == len(self.forwards) - 1:
            self.last = None
        return out


def _patch(module: nn.Module, forward) -> None:
    setattr(module, _ORIGINAL, module.forward)
    module.forward = forward


def _checkpointed_module(module: nn.Module):
    original = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        return checkpoint(original, *args, use_reentrant=False, **kwargs)
    return forward


def _core_recompute(forward, pins: AttentionPins):
    def patched(*args, **kwargs):
        with pins.recomputing_core():
            return forward(*args, **kwargs)
    return patched


def apply(layers: Sequence[nn.Module], config: RecomputeConfig | str, *, groups: CPGroups | None = None) -> None:
    """Applies ``config`` to ``layers`` (in the order the model calls them), in place.

    ``groups`` are the :class:`CPGroups` the layers' attention runs with (``None`` only for models without
    ctx_plugin attention, and then only for presets that do not recompute attention-bearing regions).
    ``budget:<GiB>`` must first be resolved with :func:`ctx_plugin.recompute.resolve`."""
    config = RecomputeConfig.parse(config)
    layers = list(layers)
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise TypeError("layers must be torch.nn.Module objects")
    if any(hasattr(m, _ORIGINAL) for layer in layers for m in (layer, getattr(layer, "mlp", None)) if m is not None):
        raise ValueError("a recompute preset is already applied to these layers; call "
                         "ctx_plugin.recompute.remove(layers) first")
    preset = config.preset
    if preset == Recompute.BUDGET:
        raise ValueError(f"{config} must be resolved to a concrete preset first: "
                         "ctx_plugin.recompute.resolve(config, model=..., parallel=..., ...)")
    if groups is not None and not isinstance(groups, CPGroups):
        raise TypeError(f"groups must come from ctx_plugin.build_cp_groups, got {type(groups).__name__}")
    if preset in (Recompute.NONE, Recompute.ATTN_OUT):
        return      # nothing is recomputed; the CP attention already keeps only q, k, v, out and LSE
    if preset == Recompute.MLP:
        missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, "mlp", None), nn.Module)]
        if missing:
            raise ValueError(f"the mlp preset needs layers with an `.mlp` submodule; layers {missing} have none")
        for layer in layers:
            _patch(layer.mlp, _checkpointed_module(layer.mlp))
        return
    if groups is None:
        raise ValueError(f"the {config} preset re-runs or pins the attention; pass groups= (the CPGroups the "
                         "layers' cp_attention uses)")
    if preset == Recompute.CORE_ATTN:
        warnings.warn("recompute preset core_attn re-runs the context-parallel attention in backward, repeating "
                      "its ring/all-to-all communication, and saves no memory over 'none' with ctx_plugin's "
                      "flash-style attention; prefer 'selective' or 'full'", stacklevel=2)
        for layer in layers:
            _patch(layer, _core_recompute(layer.forward, groups.pins))
        return
    if preset == Recompute.SELECTIVE:
        for layer in layers:
            _patch(layer, _Region([layer.forward], groups.pins, selective=True).run)
        return
    for start, stop in regions(config, len(layers)):      # full, full:uniform:N, full:block:N, sqrt
        region = _Region([layer.forward for layer in layers[start:stop]], groups.pins, selective=False)
        _patch(layers[start], region.run)
        for position in range(1, stop - start):
            _patch(layers[start + position], partial(region.pass_through, position))


def remove(layers: Sequence[nn.Module]) -> None:
    """Undoes :func:`apply` on ``layers`` (no-op for layers without a preset)."""
    for layer in layers:
        for module in (layer, getattr(layer, "mlp", None)):
            if module is not None and hasattr(module, _ORIGINAL):
                del module.forward           # the instance attribute; the class's forward shows again
                delattr(module, _ORIGINAL)
