"""megatron-core GPT layers (as :mod:`tests.memory_megatron` builds them) under whole-layer recompute regions: the
bytes alive in backward each time a region is done (its input's gradient is ready) against the memory model's
``megatron`` family (what the layers not yet back-propagated keep), and a step's peak, on one spawned gloo rank.

megatron-core's ``TransformerLayer`` keeps its hidden states after attention in ``self.mlp_norm_manager`` until
its forward ends, and PyTorch's checkpoint stops a recomputation early, inside the region's last layer: without
:func:`ctx_plugin.recompute.apply`'s restoring of a cut-short layer's attributes, every finished region's
recomputed attention (and, through the residual, its earlier layers) stayed alive into later regions' backward."""
from __future__ import annotations

import warnings

import torch

from tests.memory_megatron import BATCH, DTYPES, HIDDEN, SEQ, _measure, _model, spec


def _region_starts(preset: str, layers: int) -> list[int]:
    from ctx_plugin.names import Recompute
    from ctx_plugin.recompute import RecomputeConfig
    from ctx_plugin.recompute.presets import regions

    config = RecomputeConfig.parse(preset)
    if config.preset == Recompute.SELECTIVE:          # one region per layer
        return list(range(layers))
    return [start for start, _ in regions(config, layers)]


def kept_during_backward(preset: str, dtype: torch.dtype, layers: int) -> dict:
    """``measured``: bytes alive (besides parameters, their pre-allocated gradients, inputs, the layers' output and
    the gradient just formed) when each region's input gradient is ready; ``model``: what the memory model says the
    layers before that region keep."""
    from ctx_plugin.memory import ParallelSpec, layer_activations
    from ctx_plugin.memory.measure import _settled_alive, _StorageTracker

    model = _model(preset, dtype, 16, "rms", False, True, layers)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    rope = model.rotary_pos_emb(SEQ)
    x0 = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype, requires_grad=True)
    seed = torch.randn(SEQ, BATCH, HIDDEN, dtype=dtype)
    tracker = _StorageTracker(ignore=[*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
                                      x0, rope, seed])
    starts, measured, final = _region_starts(preset, layers), {}, []

    def at(start: int):
        def hook(grad):
            measured[start] = _settled_alive(tracker, [grad, *final])
        return hook

    with tracker:
        x = x0 * 1.0
        for i, layer in enumerate(model.decoder.layers):
            if i in starts:
                x.register_hook(at(i))
            x = layer(x, attention_mask=None, rotary_pos_emb=rope)[0]
        final.append(x)
        del x
        torch.autograd.backward(final[0], seed)
    per_layer = layer_activations(spec(16, "rms", False, True, layers), ParallelSpec(), preset, seq_len=SEQ,
                                  micro_batch=BATCH, dtype=dtype, device="cpu")
    return {"measured": [measured[s] for s in starts], "model": [sum(per_layer[:s]) for s in starts]}


def backward_cases(rank: int, world: int, payload: dict) -> dict:
    """``payload["kept"]``: (preset, dtype name, layers) measured by :func:`kept_during_backward`;
    ``payload["peak"]``: the same, a whole step's peak (:func:`tests.memory_megatron._measure`)."""
    from megatron.core import parallel_state

    warnings.filterwarnings("ignore")
    parallel_state.initialize_model_parallel()
    try:
        out = {"kept|" + "|".join(map(str, c)): kept_during_backward(c[0], DTYPES[c[1]], c[2])
               for c in payload.get("kept", [])}
        out.update({"peak|" + "|".join(map(str, c)): _measure(c[0], DTYPES[c[1]], 16, "rms", False, True,
                                                              layers=c[2]) for c in payload.get("peak", [])})
        return out
    finally:
        parallel_state.destroy_model_parallel()
