"""A non-reentrant checkpoint that spans several calls: a multi-layer recompute region opens one when the model calls
its first layer and closes it when the model calls its last, so that each layer runs with the arguments the model
gives *it* (Gemma-3 gives its sliding-window and full-attention layers different ``position_embeddings``) and
returns its own output (``output_hidden_states`` records each layer's), while the region keeps only its input.

``torch.utils.checkpoint.checkpoint`` takes one function run in one call, so this uses the generator behind it,
``torch.utils.checkpoint._checkpoint_without_reentrant_generator``, as PyTorch's own composable
``torch.distributed._composable.checkpoint`` does between a module's pre- and post-forward hooks: the first
``next`` saves the inputs (through any ``saved_tensors_hooks`` active around it: ``+offload``) and enters the
checkpoint's hooks and the forward context; the second exits them. In backward the region's recomputation replays
its layers in order with the arguments each got (the hidden states chained from layer to layer).

What runs between the two ``next`` calls is the checkpointed forward. The model's code between two layers must
therefore save nothing for backward (a tensor it saves would be missing from the replay: torch's checkpoint raises
in backward), and must pass each layer's output on to the next (checked by the region). A context the model
enters around one layer call and leaves after it stays balanced (it is entered before the span's hooks and left
while they are active) unless it is itself a ``saved_tensors_hooks`` context: Megatron's ``--cpu-offloading`` is
refused with multi-layer regions for this reason.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack

import torch


def opener() -> Callable:
    """``start(fn, context_fn, hidden)``: torch's non-reentrant checkpoint generator with its other arguments bound,
    resolved once per region (at :func:`ctx_plugin.recompute.apply`, not on every forward). A RuntimeError when this
    torch has no such generator, or one taking arguments ctx_plugin does not know."""
    from torch.utils import checkpoint as ckpt
    gen = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if gen is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.utils.checkpoint."
                           "_checkpoint_without_reentrant_generator, which ctx_plugin's multi-layer recompute regions "
                           "use; use a preset with one layer per region (full, full:block:N, selective) or the torch "
                           "version in constraints.txt")
    fixed = {"preserve_rng_state": True, "determinism_check": getattr(ckpt, "_DEFAULT_DETERMINISM_MODE", "default"),
             "debug": False, "early_stop": True}
    names = list(inspect.signature(gen).parameters)
    head = names[:names.index("args")] if "args" in names else names
    unknown = [n for n in head if n not in fixed and n not in ("fn", "context_fn")]
    if unknown:
        raise RuntimeError(f"torch {torch.__version__}'s non-reentrant checkpoint generator takes {unknown}, which "
                           "ctx_plugin's multi-layer recompute regions do not know; use a preset with one layer per "
                           "region (full, full:block:N, selective) or the torch version in constraints.txt")

    def start(fn: Callable, context_fn: Callable, hidden: torch.Tensor):
        values = {**fixed, "fn": fn, "context_fn": context_fn}
        return gen(*(values[n] for n in head), hidden)
    return start


class Span:
    """One forward run of a multi-layer region under checkpoint: opened with the region's input, closed after its
    last layer (:meth:`close`), or abandoned when a layer fails (:meth:`abandon`, which leaves the checkpoint's
    contexts without completing it). ``start``: what :func:`opener` returned; ``replay(hidden)`` re-runs the region
    in backward (the checkpoint keeps it until then: it must not hold the span); ``outer`` is entered first and left
    last (``+offload``'s hooks that move the saved input to host memory)."""

    def __init__(self, start: Callable, replay: Callable, hidden: torch.Tensor, context_fn: Callable,
                 outer: AbstractContextManager | None = None) -> None:
        self._stack = ExitStack()
        if outer is not None:
            self._stack.enter_context(outer)
        try:
            self._gen = start(replay, context_fn, hidden)
            next(self._gen)
        except BaseException:
            self._stack.close()
            raise

    def close(self) -> None:
        try:
            next(self._gen)
        except StopIteration:
            pass
        else:
            raise RuntimeError("torch's checkpoint generator did not finish after the region's last layer")
        finally:
            self._stack.close()

    def abandon(self) -> None:
        try:
            self._gen.close()
        finally:
            self._stack.close()
