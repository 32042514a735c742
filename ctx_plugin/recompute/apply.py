"""Applying a recompute preset to a stack of layers (e.g. Hugging Face decoder layers or ctx_plugin's own).

Layers keep their identity, parameters and state-dict keys: ``apply`` replaces each layer's ``forward`` on the
instance (``remove`` restores it). Regions use non-reentrant ``torch.utils.checkpoint``; ``selective`` adds
PyTorch's selective-checkpoint policy. Every region pins the CP attention (see
:mod:`ctx_plugin.recompute.pinning`), so only ``core_attn`` and the ``+recompute_attn`` modifier ever re-run
attention — and with it, its communication — in backward.

Modifiers applied here: ``+tile_mlp[:<tokens>]`` replaces every layer's ``.mlp`` forward by the chunked,
per-chunk-checkpointed one of :mod:`ctx_plugin.recompute.tiling` (with any preset; under ``mlp`` it replaces the
plain MLP checkpoint); ``+recompute_attn`` (``full``/``sqrt``) leaves the attention unpinned inside the regions;
``+offload:<GiB>`` / ``+offload_attn:<GiB>`` (``full``/``sqrt``) keep each region's input (and the pinned attention's
tensors) in host memory until backward (:mod:`ctx_plugin.recompute.offload`).
``+tile_loss`` belongs to the loss (pass ``config.for_layers`` here).
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..names import Recompute
from . import pinning
from .pinning import Recording, Reusable
from .offload import HostOffload, attach, detach
from .presets import RecomputeConfig, regions
from .tiling import TilingState, check_mlp, tiled_forward

_ORIGINAL = "_ctx_plugin_original_forward"
_aten = torch.ops.aten
# What "selective" keeps: matrix products and fused attention kernels (costly to recompute), nothing else.
_SAVE_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                       _aten._scaled_mm.default, _aten._scaled_dot_product_flash_attention.default,
                       _aten._scaled_dot_product_cudnn_attention.default,
                       _aten._scaled_dot_product_efficient_attention.default,
                       _aten._scaled_dot_product_flash_attention_for_cpu.default})


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul and fused-attention outputs; recompute every other op, communication included.

    The context-parallel attention needs no saving: it is pinned (recorded in forward, its output replayed in
    backward, see :mod:`ctx_plugin.recompute.pinning`), so its ring / all-to-all traffic runs once whatever this says. Any
    other collective inside a layer belongs to the framework around it, and caching its result is wrong:
    torch.distributed's collectives write into buffers their caller owns and frees or refills, e.g. ZeRO-3
    all-gathers each module's parameters into a buffer it releases after the module ran, so a saved gather hands
    stale memory to the recomputation (NaN gradients at data parallel 2). Re-running them is what such
    frameworks expect (ZeRO-3 gathers the parameters again for backward anyway)."""
    if pinning.in_attention():      # the pinned attention is replayed whole, never op by op
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _tiled_selective_policy(tiling: TilingState, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """:func:`_selective_policy`, recomputing everything inside a tiled MLP (its chunks are checkpointed
    themselves; saving their matrix products would keep every chunk's tokens × ffn outputs)."""
    if tiling.active:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return _selective_policy(ctx, op, *args, **kwargs)


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
    attention); in backward the region's forward runs again with attention replayed. ``pinned=False``
    (``+recompute_attn``): the attention is part of the region, re-run (communication included) with it.
    ``policy``: the selective policy (``selective`` regions only)."""

    def __init__(self, layers: list[nn.Module], selective: bool, *, pinned: bool = True,
                 policy=None, offload: HostOffload | None = None) -> None:
        self.layers, self.forwards = layers, [layer.forward for layer in layers]
        self.selective, self.pinned = selective, pinned
        self.offload = offload          # +offload/+offload_attn: the region's input (and attention) in host memory
        self.policy = policy if policy is not None else _selective_policy
        self.last = None

    def _contexts(self, hooks=None):
        if not self.pinned:
            return pinning.unpinned(), Reusable(pinning.unpinned)
        # One Recording per forward run (several may be in flight before their backwards); the recompute context
        # is entered once per backward (more than once with retain_graph=True), so it is built anew each time.
        run = Recording(once=self.selective, hooks=hooks)    # hooks: how the attention keeps its tensors (offload)
        record = pinning.recording(run)
        if not self.selective:
            return record, Reusable(partial(pinning.replaying, run))
        sac_fwd, sac_recompute = create_selective_checkpoint_contexts(self.policy)
        return _entered(sac_fwd, record), Reusable(lambda: _entered(pinning.replaying(run), sac_recompute))

    def _body(self, *args, **kwargs):
        out = None
        for layer, fwd in zip(self.layers, self.forwards):
            with _restored_if_cut_short(layer):
                out = fwd(*args, **kwargs)
            args, kwargs = _with_input(_hidden(out), args, kwargs)
        return out

    def run(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.offload is not None:
            out = self.offload.checkpoint(self, self._body, self._contexts, args, kwargs)
        elif torch.is_grad_enabled():
            out = checkpoint(self._body, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)
        else:
            out = self._body(*args, **kwargs)
        self.last = out if len(self.forwards) > 1 else None
        return out

    def pass_through(self, position: int, *args, **kwargs):
        """A later layer of the region: its work is already done; hand on the region's output, as the tensor this
        layer was called with. That is the output itself, or an alias of it made by module hooks: ZeRO-3 passes
        every module's inputs and outputs through autograd functions (to fetch and release parameters in
        backward), and handing on what the layer got keeps those functions in the gradient's path."""
        out, hidden = self.last, _input(args, kwargs)
        if out is None or not _aliases(_hidden(out), hidden):
            raise RuntimeError("a layer inside a multi-layer recompute region was called with something other than "
                               "the previous layer's output; apply full:uniform:N / sqrt only to layers the model "
                               "calls one after another")
        if position == len(self.forwards) - 1:
            self.last = None
        return hidden if isinstance(out, torch.Tensor) else (hidden, *out[1:])


@contextmanager
def _restored_if_cut_short(layer: nn.Module):
    """Undoes what a layer's forward assigned to the layer's own attributes when it does not finish.

    PyTorch's non-reentrant checkpoint stops a region's recomputation once it has re-made the last tensor backward
    needs (early stop: an exception raised inside the layer's forward), so the end of the last layer's forward never
    runs again in backward. A layer that keeps an intermediate tensor on itself until its forward ends would keep
    the recomputed tensor, and the recomputed autograd graph behind it, alive until its next forward: megatron-core's
    ``TransformerLayer`` holds the hidden states after attention in ``self.mlp_norm_manager`` from its pre-MLP norm
    until after the MLP's residual add, which kept a finished region's recomputed attention (norm, QKV, RoPE'd q/k,
    output, LSE) and, through the residual, its earlier layers, into every later region's backward. Only the
    layer's own ``__dict__`` is restored (its submodules' state and their hooks' bookkeeping, e.g. ZeRO-3's, are
    untouched; the layer's own hooks do not run inside a region)."""
    before = dict(vars(layer))
    try:
        yield
    except BaseException:
        state = vars(layer)
        for name in [name for name in state if name not in before]:
            del state[name]
        state.update(before)
        raise


def _aliases(out: torch.Tensor, x) -> bool:
    """Whether ``x`` is ``out`` or views all of its memory the same way (e.g. ``out.detach()``)."""
    return isinstance(x, torch.Tensor) and (x is out or (
        x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and x.device == out.device
        and x.dtype == out.dtype and x.shape == out.shape and x.stride() == out.stride()
        and x.storage_offset() == out.storage_offset()))


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
    """A ValueError if ``config`` (any preset but ``none``) would run next to HF's own gradient checkpointing."""
    on = [i for i, layer in enumerate(layers) if _hf_checkpointing(layer)]
    if on and config.preset != Recompute.NONE:
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


def apply(layers: Sequence[nn.Module], config: RecomputeConfig | str, *, sequence_dim: int = 1) -> None:
    """Applies ``config`` to ``layers`` (in the order the model calls them), in place.

    The pinned attention's record/replay state is context-scoped (:mod:`ctx_plugin.recompute.pinning`), so
    no groups are needed: the regions pin whatever ``cp_attention`` calls run inside them. ``budget:<GiB>`` must
    first be resolved with :func:`ctx_plugin.recompute.resolve`. ``sequence_dim``: the sequence dimension of
    the hidden states the layers' MLPs get, for ``+tile_mlp`` (1 for ``[batch, seq, hidden]`` models, 0 for
    Megatron's ``[seq, batch, hidden]``). ``+tile_loss`` is refused: the loss applies it,
    the layers take ``config.for_layers``."""
    config = RecomputeConfig.parse(config)
    layers = list(layers)
    if not all(isinstance(layer, nn.Module) for layer in layers):
        raise TypeError("layers must be torch.nn.Module objects")
    if any(hasattr(m, _ORIGINAL) for layer in layers for m in (layer, getattr(layer, "mlp", None)) if m is not None):
        raise ValueError("a recompute preset is already applied to these layers; call "
                         "ctx_plugin.recompute.remove(layers) first")
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
    if config.tile_mlp:
        for i, layer in enumerate(layers):
            check_mlp(getattr(layer, "mlp", None), i)
    elif preset == Recompute.MLP:
        missing = [i for i, layer in enumerate(layers) if not isinstance(getattr(layer, "mlp", None), nn.Module)]
        if missing:
            raise ValueError(f"the mlp preset needs layers with an `.mlp` submodule; layers {missing} have none")
    patch = partial(_patch, layers=layers, config=config)
    tiling = TilingState()
    for i, layer in enumerate(layers):            # +tile_mlp: every preset; under `mlp` it replaces the checkpoint
        if config.tile_mlp:
            tiled = tiled_forward(layer.mlp, layer.mlp.forward, tokens=config.mlp_tokens, sequence_dim=sequence_dim,
                                  state=tiling)
            patch(layer.mlp, tiled, index=i)
        elif preset == Recompute.MLP:
            patch(layer.mlp, _checkpointed_module(layer.mlp), index=i)
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
        policy = partial(_tiled_selective_policy, tiling) if config.tile_mlp else None
        for i, layer in enumerate(layers):
            patch(layer, _Region([layer], selective=True, policy=policy).run, index=i)
        return
    offload = HostOffload.from_config(config)      # one host budget for the whole stack
    for start, stop in regions(config, len(layers)):      # full, full:uniform:N, full:block:N, sqrt
        region = _Region(layers[start:stop], selective=False,
                         pinned=not config.recompute_attention, offload=offload)
        attach(layers[start:stop], offload)
        patch(layers[start], region.run, index=start)
        for position in range(1, stop - start):
            patch(layers[start + position], partial(region.pass_through, position), index=start + position)


def remove(layers: Sequence[nn.Module]) -> None:
    """Undoes :func:`apply` on ``layers`` (no-op for layers without a preset)."""
    for layer in layers:
        detach(layer)
        for module in (layer, getattr(layer, "mlp", None)):
            if module is not None and hasattr(module, _ORIGINAL):
                del module.forward           # the instance attribute; the class's forward shows again
                delattr(module, _ORIGINAL)
