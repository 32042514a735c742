"""Attention sinks: one logit per head that joins the softmax denominator and carries no value.

gpt-oss's ``s_aux``, megatron-core's ``softmax_type="learnable"`` (``"off-by-one"`` is sinks of zeros). Applied
once, after every key block has been merged into ``(out, lse)`` (never once per ring step)::

    lse' = logaddexp(lse, sink_h)        out' = out · exp(lse − lse')

Backends save ``(out', lse')``: every kernel's backward given the final ``(out', lse')`` yields the exact
dq/dk/dv (the sink column has no value, so ``Σ_d dout·out'`` is the softmax's full correction term), and::

    dsink_h = − Σ_{b,i} exp(sink_h − lse'_{b,h,i}) · Σ_d (dout · out')_{b,i,h}

Under context parallelism that sum covers this rank's query rows (and heads): the gradient of the replicated
parameter is the sum over the ranks, which the frameworks' gradient reduction makes.
"""
from __future__ import annotations

import torch


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')`` of ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` (accumulation dtype) with the sink
    logits ``sinks`` ``[H]``; ``out'`` in ``lse``'s dtype."""
    new_lse = torch.logaddexp(lse, sinks.detach().to(lse.dtype).view(1, -1, 1))
    # a row with no key (padding) and a sink of -inf has nothing to weigh: 0, not exp(-inf - -inf) = NaN
    weight = torch.where(torch.isneginf(new_lse), 0.0, torch.exp(lse - new_lse)).transpose(1, 2).unsqueeze(-1)
    return out.to(lse.dtype) * weight, new_lse


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits (``[H]``, ``sinks``' dtype) for these rows, given the final ``(out', lse')``."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)            # [B, H, S]
    weight = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
    weight = torch.where(torch.isneginf(lse), 0.0, weight)                 # rows with neither key nor sink
    return -(weight * delta).sum(dim=(0, 2)).to(sinks.dtype)
