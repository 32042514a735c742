"""Recompute regions (layers checkpointed together, storing only the region's input plus the pinned attention) and
what "selective" saves. :func:`ctx_plugin.recompute.apply` builds them.

A region of several layers runs them all when the model calls its first one, with that layer's arguments (the
hidden states passed on from layer to layer); the later layers hand on the region's output. A later layer called with
other arguments is a ValueError (the region ran it with the first one's). The checkpoint always gets the hidden
states positionally: ``torch.utils.checkpoint`` saves and restores the device RNG state (dropout masks in the
recomputation) of its positional tensor arguments' devices only.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import pinning
from .inplace import SavedOutputs
from .offload import HostOffload, hidden_first
from .pinning import Recording, Reusable
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
    ``policy``: the selective policy (``selective`` regions only)."""

    def __init__(self, layers: list[nn.Module], selective: bool, *, pinned: bool = True,
                 policy=None, offload: HostOffload | None = None) -> None:
        self.layers, self.forwards = layers, [layer.forward for layer in layers]
        self.selective, self.pinned = selective, pinned
        self.offload = offload          # +offload/+offload_attn: the region's input (and attention) in host memory
        self.policy = policy if policy is not None else selective_policy
        self.last = None
        self.others = None          # (args, kwargs) the region's first layer got, hidden states left out

    def _contexts(self, hooks=None):
        if not self.pinned:
            return pinning.unpinned(), Reusable(pinning.unpinned)
        # One Recording per forward run (several may be in flight before their backwards); the recompute context
        # is entered once per backward (more than once with retain_graph=True), so it is built anew each time.
        run = Recording(once=self.selective, hooks=hooks)    # hooks: how the attention keeps its tensors (offload)
        record = pinning.recording(run)
        if not self.selective:
            return record, Reusable(partial(pinning.replaying, run))
        saved = SavedOutputs(self.policy)      # in-place collectives on saved outputs (sees each op before SAC)
        sac_fwd, sac_recompute = create_selective_checkpoint_contexts(saved.policy)
        return _entered(sac_fwd, saved, record), Reusable(lambda: _entered(pinning.replaying(run), sac_recompute))

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
            fn, fn_args, fn_kwargs = hidden_first(self._body, args, kwargs)     # device RNG saved for dropout
            out = checkpoint(fn, *fn_args, use_reentrant=False, context_fn=self._contexts, **fn_kwargs)
        else:
            out = self._body(*args, **kwargs)
        multi = len(self.forwards) > 1
        self.last = out if multi else None
        self.others = _with_input(None, args, kwargs) if multi else None
        return out

    def pass_through(self, position: int, *args, **kwargs):
        """A later layer of the region: its work is already done; hand on the region's output, as the tensor this
        layer was called with. That is the output itself, or an alias of it made by module hooks: ZeRO-3 passes
        every module's inputs and outputs through autograd functions (to fetch and release parameters in
        backward), and handing on what the layer got keeps those functions in the gradient's path. The region ran
        this layer with the first layer's other arguments: a layer the model calls with others (Gemma-3's
        position_embeddings per layer type) is a ValueError."""
        out, hidden = self.last, _input(args, kwargs)
        if out is None or not _aliases(_hidden(out), hidden):
            raise RuntimeError("a layer inside a multi-layer recompute region was called with something other than "
                               "the previous layer's output; apply full:uniform:N / sqrt only to layers the model "
                               "calls one after another")
        differs = _differing(self.others, _with_input(None, args, kwargs))
        if differs:
            self.last = self.others = None
            raise ValueError(f"layer {position} of a multi-layer recompute region (full:uniform:N with N > 1, or "
                             f"sqrt) is called with another {differs} than the region's first layer, but a region "
                             "runs all its layers with the first one's arguments (e.g. Gemma-3 gives its sliding-"
                             "window and full-attention layers different position_embeddings); use a preset with "
                             "one layer per region: full, full:block:N, selective")
        if position == len(self.forwards) - 1:
            self.last = self.others = None
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


def _same(a, b) -> bool:
    """Whether a later layer's argument ``b`` equals the region's first layer's ``a``: tensors the same memory viewed
    the same way (:func:`_aliases`: what models pass on, no device synchronisation) or else equal in shape, dtype,
    device and every value, containers element by element, anything else identical or equal."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor):
        return _aliases(a, b) or (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                                  and a.device == b.device and torch.equal(a, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):       # e.g. a dataclass of tensors: only identity counts
        return False


def _differing(first: tuple[tuple, dict], later: tuple[tuple, dict]) -> str | None:
    """The first argument (besides the hidden states) in which a later layer's call differs from the region's first
    one, named for the error (``None``: the same)."""
    (args_a, kwargs_a), (args_b, kwargs_b) = first, later
    if len(args_a) != len(args_b):
        return "number of positional arguments"
    for i, (a, b) in enumerate(zip(args_a[1:], args_b[1:]), start=1):
        if not _same(a, b):
            return f"positional argument {i}"
    for key in sorted(kwargs_a.keys() | kwargs_b.keys()):
        if key != "hidden_states" and (key not in kwargs_a or key not in kwargs_b or not _same(kwargs_a[key],
                                                                                              kwargs_b[key])):
            return f"{key}="
    return None


def _aliases(out: torch.Tensor, x) -> bool:
    """Whether ``x`` is ``out`` or views all of its memory the same way (e.g. ``out.detach()``)."""
    return isinstance(x, torch.Tensor) and (x is out or (
        x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr() and x.device == out.device
        and x.dtype == out.dtype and x.shape == out.shape and x.stride() == out.stride()
        and x.storage_offset() == out.storage_offset()))
