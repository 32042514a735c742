"""Tiled MLP (the ``+tile_mlp[:<tokens>]`` recompute modifier): a layer's MLP and norms run over chunks of the
sequence, each chunk recomputed in backward (Arctic Long Sequence Training's TiledMLP, extended to the norms).

Each chunk runs under its own non-reentrant ``torch.utils.checkpoint``: the forward keeps only the MLP's input
(the chunks are views of it: one copy), and backward recomputes one chunk's MLP and runs its backward before the
next chunk's (the chunks are independent branches; autograd finishes the later one first). So the MLP's
intermediates (tokens × ffn: the up/gate projections and the activation) exist for one chunk at a time — in the
forward, in backward, and when an enclosing checkpoint region (``full``, ``sqrt``) recomputes the layer, whose
recomputation re-runs the chunked forward. Exact: each token's MLP is computed by the same operations; only
the parameters' gradients are sums over chunks (a different summation order, float64 round-off).

A checkpoint per chunk rather than DeepSpeed's ``TiledMLP`` (a custom autograd function calling
``torch.autograd.backward`` per chunk) because the parameters' gradients then reach them through autograd as for
any module called several times: summed before accumulation, so gradient hooks of DDP, Megatron's DDP and ZeRO fire
once per step; and checkpoint restores the RNG state for each chunk (dropout recomputes identically).

Chunk size: ``+tile_mlp:<tokens>`` gives at most that many tokens (of this rank's sequence) per chunk; plain
``+tile_mlp`` uses the MLP's input width h (ALST's ``ceil(seq / h)`` chunks): a chunk's intermediates
(about h × ffn values) are then about one MLP weight matrix, small next to the weights at long sequences and
large enough to keep the matrix products efficient. Chunks are balanced (sizes differ by at most one token).

The sequence dimension is 1 for ``[batch, seq, hidden]`` models (Hugging Face, ctx_plugin's own) and 0 for
Megatron's ``[seq, batch, hidden]``. Under Megatron's tensor parallelism each chunk is gathered/reduced by the
MLP's own linears (with sequence parallelism: the same chunk of every rank's sequence shard is gathered, then
scattered back), all ranks using the same chunks because their shards have the same length: per-token work,
exact per chunk. MoE layers (an ``experts`` or ``router`` submodule, or a module class named as a mixture of
experts) are refused: routing statistics and auxiliary losses are computed over the tokens of a call, so chunking
changes them.

The layer's own norms (:func:`layer_norms`: its direct submodules that are torch's ``LayerNorm``/``RMSNorm`` or a
class named ``...LayerNorm``/``...RMSNorm``, as Hugging Face's, Megatron's and ctx_plugin's) are chunked the same
way: per token over the hidden dimension, so exact, and with them an eager norm's fp32 copies (Hugging Face's
``LlamaRMSNorm`` keeps four bytes per element of its input in fp32 besides its normalised input) and its fp32
backward temporaries (several tokens × hidden fp32 tensors) exist for one chunk at a time; the norm keeps its input
and its consumer keeps its output. At long sequences those temporaries otherwise bound a recomputed layer's
backward once the MLP is tiled. Norms not over the hidden dimension alone (a torch norm over several dimensions,
a norm with parameters that are not vectors) are refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(eq=False)
class TilingState:
    """Whether a tiled MLP's forward is running now: the ``selective`` policy recomputes everything inside it
    (saving its matrix products would keep every chunk's tokens × ffn outputs, which tiling exists to avoid)."""

    depth: int = 0

    @property
    def active(self) -> bool:
        return self.depth > 0


def check_mlp(mlp, index: int) -> None:
    """A ValueError if layer ``index``'s ``.mlp`` cannot be tiled exactly."""
    if not isinstance(mlp, nn.Module):
        raise ValueError(f"+tile_mlp needs layers with an `.mlp` submodule; layer {index} has none")
    moe = _mixture_of_experts(mlp)
    if moe is not None:
        raise ValueError(f"+tile_mlp cannot tile layer {index}'s {type(mlp).__name__} ({moe}): a mixture-of-experts "
                         "layer routes tokens with statistics and auxiliary losses over all tokens of a call, which "
                         "chunking would change; drop +tile_mlp for MoE models")


def _mixture_of_experts(mlp: nn.Module) -> str | None:
    """What marks ``mlp`` as a mixture of experts, else None: a submodule named ``experts`` or ``router`` (at any
    depth: JetMoE keeps its experts in ``input_linear``/``output_linear`` next to a ``router``), or a module class
    named as one (``...MoE...``, ``...Moe...``, ``...Experts...``)."""
    for name, module in mlp.named_modules():
        leaf, kind = name.rsplit(".", 1)[-1], type(module).__name__
        if leaf in ("experts", "router"):
            return f"its `{name}`"
        if "MoE" in kind or "Moe" in kind or "Experts" in kind:
            return f"{'its ' + repr(name) + ', ' if name else ''}a {kind}"
    return None


_NORM_CLASSES = ("LayerNorm", "RMSNorm")


def layer_norms(layer: nn.Module) -> list[nn.Module]:
    """The norms of ``layer`` that ``+tile_mlp`` chunks: its direct submodules that are torch's LayerNorm/RMSNorm or
    whose class is named ``...LayerNorm``/``...RMSNorm`` (Megatron's ``IdentityOp`` placeholders are not)."""
    return [m for m in layer.children()
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith(_NORM_CLASSES)]


def check_norm(norm: nn.Module, whose: str) -> None:
    """A ValueError for ``norm`` (``whose``: "layer 3's norms", "the final norm") if it does not normalise each token
    over the last dimension alone."""
    shape = getattr(norm, "normalized_shape", None)     # torch's, and Megatron's/HF's LayerNorm-likes
    wide = shape is not None and len(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,)) != 1
    if wide or any(p.dim() != 1 for p in norm.parameters()):
        what = f"normalized_shape {tuple(shape)}" if wide else "parameters that are not vectors"
        raise ValueError(f"+tile_mlp chunks {whose} over the sequence, but its "
                         f"{type(norm).__name__} normalises over more than the last dimension ({what}), which "
                         "chunking would change; drop +tile_mlp for this model")


def chunk_sizes(tokens: int, per_chunk: int) -> list[int]:
    """Balanced chunk sizes of ``tokens`` tokens with at most ``per_chunk`` each."""
    n = max(1, math.ceil(tokens / per_chunk))
    return [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]


def tiled_forward(mlp: nn.Module, forward, *, tokens: int | None, sequence_dim: int, state: TilingState):
    """The replacement ``mlp.forward`` (or a norm's): ``forward`` (the original) over chunks of the sequence, each
    chunk checkpointed. ``tokens``: tokens per chunk, ``None`` for the input width."""

    def run(hidden_states, *args, **kwargs):
        extra = [name for name, value in [*enumerate(args, 1), *kwargs.items()] if isinstance(value, torch.Tensor)]
        if extra:
            raise ValueError(f"+tile_mlp chunks only the hidden states, but {type(mlp).__name__} was called with "
                             f"tensor argument(s) {extra} (per-token masks or scales?); drop +tile_mlp for this model")
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not 0 <= sequence_dim < x.dim() - 1:
            raise ValueError(f"+tile_mlp: {type(mlp).__name__} got {tuple(getattr(x, 'shape', ()))}, which has no "
                             f"sequence dimension {sequence_dim} before the hidden one; pass apply(..., "
                             "sequence_dim=) matching the model ([batch, seq, hidden]: 1, Megatron's [seq, batch, "
                             "hidden]: 0)")
        sizes = chunk_sizes(x.shape[sequence_dim], tokens or x.shape[-1])
        state.depth += 1
        try:
            outs = [_chunk(forward, chunk, args, kwargs) for chunk in x.split(sizes, dim=sequence_dim)]
        finally:
            state.depth -= 1
        return _join(mlp, outs, sequence_dim)

    return run


def _chunk(forward, chunk: torch.Tensor, args: tuple, kwargs: dict):
    if torch.is_grad_enabled():
        return checkpoint(forward, chunk, *args, use_reentrant=False, **kwargs)
    return forward(chunk, *args, **kwargs)


def _join(mlp: nn.Module, outs: list, sequence_dim: int):
    """The chunks' outputs as one: hidden states concatenated; other outputs (Megatron's bias, added by the layer
    after the MLP) must be the same object for every chunk, ``None`` or a parameter of the MLP."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=sequence_dim) if len(outs) > 1 else outs[0]
    if not isinstance(outs[0], (tuple, list)) or not outs[0] or not isinstance(outs[0][0], torch.Tensor):
        raise ValueError(f"+tile_mlp: {type(mlp).__name__} returned {type(outs[0]).__name__}; it tiles MLPs and norms "
                         "that return the hidden states (or a tuple starting with them)")
    params = {id(p) for p in mlp.parameters()}
    for position in range(1, len(outs[0])):
        values = [out[position] for out in outs]
        if not all(v is values[0] for v in values) or not (values[0] is None or id(values[0]) in params):
            raise ValueError(f"+tile_mlp: output {position} of {type(mlp).__name__} depends on the tokens (router "
                             "logits, a fused norm's residual?); it tiles MLPs and norms whose other outputs are "
                             "None or their own parameters (as Megatron's bias); drop +tile_mlp for this model")
    first = torch.cat([out[0] for out in outs], dim=sequence_dim) if len(outs) > 1 else outs[0][0]
    return type(outs[0])([first, *outs[0][1:]])
