"""megatron-core's MoE router under ctx_plugin's recompute regions.

The router's forward adds to running state in its buffers — the token counts of the expert bias
(``local_tokens_per_expert``), those of the global auxiliary loss (``global_tokens_per_expert``, ``ga_steps``), the
quantile balancing's (``qb_beta_accum``, ``qb_beta_count``) — and to the per-layer losses of the MoE metrics tracker
(``get_moe_metrics_tracker()``). megatron-core skips that when autograd is off, which is how its own
(reentrant) recompute runs; ctx_plugin's regions recompute with autograd on (a non-reentrant checkpoint), so a
recomputed router would add its tokens and losses a second time. :func:`keep_router_state` undoes what a router adds
while a region recomputes (:attr:`ctx_plugin.recompute.pinning.PinState.recomputing`). The global auxiliary loss
reads that state, as the forward left it, to compute the loss its recomputation must reproduce, which a
recomputation after other micro batches' forwards cannot: :func:`check_router_recompute` refuses it.
"""
from __future__ import annotations

import torch

from ..recompute import pinning

def _load_balancing(args) -> list[str]:
    kind = getattr(args, "moe_router_load_balancing_type", None) or []
    return [kind] if isinstance(kind, str) else list(kind)


def check_router_recompute(args, recompute) -> None:
    """ValueError for ``--moe-router-load-balancing-type global_aux_loss`` with a preset ctx_plugin applies that
    recomputes the router (anything but ``none``, ``attn_out`` and ``core_attn``)."""
    from ..names import Recompute

    if getattr(args, "num_experts", None) and "global_aux_loss" in _load_balancing(args) and \
            recompute.preset not in (Recompute.NONE, Recompute.ATTN_OUT, Recompute.CORE_ATTN):
        raise ValueError(f"--cp-recompute {recompute} with --moe-router-load-balancing-type global_aux_loss: the "
                         f"router's recomputation in backward would average its tokens with every micro batch's "
                         f"forwarded since (its running counts), not the counts its forward used, so the auxiliary "
                         f"loss's gradient would differ; use --cp-recompute core_attn or none, or the aux_loss / "
                         f"seq_aux_loss balancing")


def keep_router_state(layers) -> None:
    """Hooks on every ``TopKRouter`` in ``layers``: a forward that runs while a region recomputes leaves the router's
    buffers (its running counts; small) and the metrics tracker as it found them."""
    from megatron.core.transformer.moe.router import TopKRouter

    for module in layers.modules():
        if isinstance(module, TopKRouter) and not hasattr(module, "_ctx_plugin_router_state"):
            kept = _RouterState()
            module._ctx_plugin_router_state = kept
            module.register_forward_pre_hook(kept.before)
            module.register_forward_hook(kept.after, always_call=True)


class _RouterState:
    """What one router's recomputed forward is about to change (a stack: one entry per forward under way)."""

    def __init__(self) -> None:
        self.saved: list = []

    def before(self, module, args) -> None:
        if not pinning.state().recomputing:
            self.saved.append(None)
            return
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        counts = [(t, t.clone()) for t in module.buffers(recurse=False)]
        metrics = get_moe_metrics_tracker().metrics
        self.saved.append((counts, metrics, {name: entry.values.clone() for name, entry in metrics.items()}))

    def after(self, module, args, output) -> None:
        saved = self.saved.pop() if self.saved else None
        if saved is None:
            return
        counts, metrics, values = saved
        with torch.no_grad():
            for tensor, old in counts:
                tensor.copy_(old)
            for name in [name for name in metrics if name not in values]:
                del metrics[name]
            for name, old in values.items():
                metrics[name].values.copy_(old)
