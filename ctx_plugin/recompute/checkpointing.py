"""Recompute regions (layers checkpointed together, storing only the region's input plus the pinned attention) and
what "selective" saves. :func:`ctx_plugin.recompute.apply` builds them.

A region of one layer checkpoints that layer's call; a region of several layers is one checkpoint spanning their
calls (:mod:`ctx_plugin.recompute.span`), each layer run with the arguments the model gives it. The checkpoint always
gets the hidden states positionally: ``torch.utils.checkpoint`` saves and restores the device RNG state (dropout
masks in the recomputation) of its positional tensor arguments' devices only.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from ..core.compiler import opaque
from . import pinning
from .inplace import SavedOutputs
from .offload import HostOffload, hidden_first
from .pinning import Recording, Reusable
from .sac import selective_contexts
from . import span
from .tiling import TilingState

_aten = torch.ops.aten
# What "selective" keeps: matrix products and fused attention kernels (costly to recompute), nothing else.
_SAVE_OPS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
                       _aten._scaled_mm.default, _aten._scaled_dot_product_flash_attention.default,
                       _aten._scaled_dot_product_cudnn_attention.default,
                       _aten._scaled_dot_product_efficient_attention.default,
                       _aten._scaled_dot_product_flash_attention_for_cpu.default})


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul and fused-attention outputs; recompute every other op, communication included.

    The context-parallel attention needs no saving: it is pinned (recorded in forward, its output replayed in
    backward, see :mod:`ctx_plugin.recompute.pinning`), so its ring / all-to-all traffic runs once whatever this says. Any
    other collective inside a layer belongs to the framework around it, and caching its result is wrong (except an
    in-place one on a saved output, :mod:`ctx_plugin.recompute.inplace`, which the regions add):
    torch.distributed's collectives write into buffers their caller owns and frees or refills, e.g. ZeRO-3
    all-gathers each module's parameters into a buffer it releases after the module ran, so a saved gather hands
    stale memory to the recomputation (NaN gradients at data parallel 2). Re-running them is what such
    frameworks expect (ZeRO-3 gathers the parameters again for backward anyway)."""
    if pinning.in_attention():      # the pinned attention is replayed whole, never op by op
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def tiled_selective_policy(tiling: TilingState, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """:func:`selective_policy`, recomputing everything inside a tiled MLP (its chunks are checkpointed
    themselves; saving their matrix products would keep every chunk's tokens × ffn outputs)."""
    if tiling.active:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return selective_policy(ctx, op, *args, **kwargs)


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


class Region:
    """Layers ``forwards`` checkpointed as one region: only the region's input is stored (plus the pinned
    attention); in backward the region's forward runs again with attention replayed. ``pinned=False``
    (``+recompute_attn``): the attention is part of the region, re-run (communication included) with it.
    ``policy``: the selective policy (``selective`` regions only).

    A region of one layer is ``torch.utils.checkpoint`` of that layer's call (:meth:`run`). A region of several
    layers is a checkpoint *span* (:mod:`ctx_plugin.recompute.span`): :meth:`run` (the first layer's forward) opens
    it, :meth:`later` (each later layer's) runs that layer with its own arguments inside it, and the last layer
    closes it; the recomputation replays each layer with the arguments it got, the hidden states chained."""

    def __init__(self, layers: list[nn.Module], selective: bool, *, pinned: bool = True,
                 policy=None, offload: HostOffload | None = None) -> None:
        self.layers, self.forwards = layers, [layer.forward for layer in layers]
        self.selective, self.pinned = selective, pinned
        self.offload = offload          # +offload/+offload_attn: the region's input (and attention) in host memory
        self.policy = policy if policy is not None else selective_policy
        self.start = span.opener() if len(layers) > 1 else None     # torch's checkpoint generator, bound
        self.under_way: _Forward | None = None      # a multi-layer region's forward under way

    def _contexts(self, hooks=None):
        if not self.pinned:
            return pinning.unpinned(), Reusable(lambda: _entered(pinning.unpinned(), pinning.recomputation()))
        # One Recording per forward run (several may be in flight before their backwards); the recompute context
        # is entered once per backward (more than once with retain_graph=True), so it is built anew each time.
        run = Recording(once=self.selective, hooks=hooks)    # hooks: how the attention keeps its tensors (offload)
        record = pinning.recording(run)
        if not self.selective:
            return record, Reusable(lambda: _entered(pinning.replaying(run), pinning.recomputation()))
        saved = SavedOutputs(self.policy)      # in-place collectives on saved outputs (sees each op before SAC)
        sac_fwd, sac_recompute = selective_contexts(saved.policy)
        return _entered(sac_fwd, saved, record), Reusable(
            lambda: _entered(pinning.replaying(run), sac_recompute, pinning.recomputation()))

    def _call(self, position: int, *args, **kwargs):
        layer = self.layers[position]
        with _restored_if_cut_short(layer), _tensors_restored(layer) if pinning.state().recomputing else nullcontext():
            return self.forwards[position](*args, **kwargs)

    def run(self, *args, **kwargs):
        """The first layer's forward."""
        if len(self.forwards) > 1:
            return self._open(args, kwargs)
        if not torch.is_grad_enabled():
            return self._call(0, *args, **kwargs)
        body = partial(self._call, 0)
        if self.offload is not None:
            return self.offload.checkpoint(self, body, self._contexts, args, kwargs)
        fn, fn_args, fn_kwargs = hidden_first(body, args, kwargs)     # device RNG saved for dropout
        return checkpoint(fn, *fn_args, use_reentrant=False, context_fn=self._contexts, **fn_kwargs)

    @opaque         # a span of calls is no graph: Dynamo runs the region's layers eagerly (graph breaks around)
    def _open(self, args: tuple, kwargs: dict):
        if self.under_way is not None:     # the last forward stopped inside the region (an exception between layers)
            self._abandon()
        if not torch.is_grad_enabled():
            return self._call(0, *args, **kwargs)
        hidden = _input(args, kwargs)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"a multi-layer recompute region checkpoints its first layer's hidden states (its first "
                            f"argument or hidden_states=), which must be a tensor, got {type(hidden).__name__}")

        calls: list[tuple[tuple, dict]] = []

        def replay(hidden):     # kept by the checkpoint until backward: holds the calls' arguments only
            out = None
            for position, (a, k) in enumerate(calls):
                a, k = _with_input(hidden, a, k)
                out = self._call(position, *a, **k)
                hidden = _hidden(out)
            return out
        outer, hooks = self.offload.hooks(self, hidden) if self.offload is not None else (None, None)
        self.under_way = _Forward(span.Span(self.start, replay, hidden, lambda: self._contexts(hooks), outer), calls)
        return self._step(0, args, kwargs)

    def _step(self, position: int, args: tuple, kwargs: dict):
        opened = self.under_way
        opened.calls.append(_with_input(None, args, kwargs))
        try:
            out = self._call(position, *args, **kwargs)
        except BaseException:
            self._abandon()
            raise
        if position == len(self.forwards) - 1:
            self.under_way = None
            opened.span.close()
        else:
            opened.last = _hidden(out)
        return out

    def _abandon(self) -> None:
        opened, self.under_way = self.under_way, None
        opened.span.abandon()

    @opaque
    def later(self, position: int, *args, **kwargs):
        """A later layer's forward (``position`` ≥ 1 in the region)."""
        opened = self.under_way
        if opened is None:
            if not torch.is_grad_enabled():         # the region's forward runs without autograd
                return self._call(position, *args, **kwargs)
            raise RuntimeError(f"layer {position} of a multi-layer recompute region was called with autograd on but "
                               "not after the region's first layer; apply full:uniform:N / sqrt only to layers the "
                               "model calls one after another, passing each layer's output to the next")
        if position != len(opened.calls):
            self._abandon()
            raise RuntimeError(f"layer {position} of a multi-layer recompute region was called while layer "
                               f"{len(opened.calls)} was due; apply full:uniform:N / sqrt only to layers the model "
                               "calls one after another")
        if not _aliases(opened.last, _input(args, kwargs)):
            self._abandon()
            raise RuntimeError("a layer inside a multi-layer recompute region was called with something other than "
                               "the previous layer's output; apply full:uniform:N / sqrt only to layers the model "
                               "calls one after another, passing each layer's output to the next")
        return self._step(position, args, kwargs)


@dataclass
class _Forward:
    """A multi-layer region's forward under way: its checkpoint span, the arguments its layers got so far (hidden
    states left out; the replay reads them) and the latest layer's output (the next layer must be given it)."""

    span: span.Span
    calls: list[tuple[tuple, dict]]
    last: torch.Tensor | None = None


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


def tensor_holders(layer: nn.Module) -> list:
    """The layer's modules and the plain objects they hold (not modules, tensors or classes: megatron-core's MoE
    token dispatcher is one), whose tensor attributes a recomputation must leave as it found them."""
    modules = list(layer.modules())
    plain = [v for m in modules for v in vars(m).values() if hasattr(v, "__dict__")
             and not isinstance(v, (nn.Module, torch.Tensor, type)) and not callable(v)]
    return modules + list({id(v): v for v in plain}.values())


@contextmanager
def _tensors_restored(layer: nn.Module):
    """A layer's recomputation leaves the tensors its modules keep as attributes as it found them, whether it runs
    to the end or stops early (:func:`_restored_if_cut_short`): a module that keeps an intermediate tensor on itself
    until its next forward (megatron-core's MoE token dispatcher keeps the routing probabilities) would otherwise keep
    the recomputed one, and the recomputed autograd graph behind it (back through the region), alive after the
    region's backward, which never runs that graph. Tensor attributes only (:func:`tensor_holders`): other
    bookkeeping that modules' hooks keep (ZeRO-3's counters) is theirs to balance."""
    holders = tensor_holders(layer)
    before = [{k: v for k, v in vars(h).items() if isinstance(v, torch.Tensor)} for h in holders]
    try:
        yield
    finally:
        for h, kept in zip(holders, before):
            state = vars(h)
            for name in [k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in kept]:
                del state[name]
            state.update(kept)


def _aliases(out: torch.Tensor, x) -> bool:
    """Whether ``x`` is ``out`` or views all of its memory the same way (e.g. ``out.detach()``)."""
    return isinstance(x, torch.Tensor) and (x is out or (
        x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and x.device == out.device
        and x.dtype == out.dtype and x.shape == out.shape and x.stride() == out.stride()
        and x.storage_offset() == out.storage_offset()))
