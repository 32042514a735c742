"""Shared helpers for the activation-offload tests (one process or spawned ranks)."""
from __future__ import annotations

import torch

import ctx_plugin
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.recompute import RecomputeConfig, regions
from ctx_plugin.recompute.offload import host_offload
from tests.recompute_cases import BATCH, build_blocks, counting_attention, decoder_config, sharded_input

MODIFIED = ["full", "full:uniform:2", "full:block:1", "sqrt"]


def expected_host_bytes(shape: str, preset: str, local_tokens: int, attention_bytes: int) -> int:
    """What an offloading stack holds in host memory after one forward (float64): each checkpoint region's input
    ``[batch, local tokens, hidden]`` and, with ``offload_attn``, each checkpointed layer's attention tensors
    (``attention_bytes`` per layer)."""
    c = decoder_config(shape)
    config = RecomputeConfig.parse(preset)
    spans = regions(config, c.layers)
    inputs = len(spans) * BATCH * local_tokens * c.hidden * 8
    layers = sum(stop - start for start, stop in spans)
    return inputs + (layers * attention_bytes if config.offload_attention else 0)


def attention_bytes_cp1(shape: str, local_tokens: int) -> int:
    """The pinned attention's tensors at CP 1, float64, from the shapes: q and out ``[b, n, heads, d]``, k and v
    ``[b, n, kv_heads, d]``, the LSE ``[b, heads, n]``."""
    c = decoder_config(shape)
    d = c.hidden // c.heads
    return BATCH * local_tokens * 8 * (d * (2 * c.heads + 2 * c.kv_heads) + c.heads)


def offload_step(shape: str, preset: str, cfg: ctx_plugin.CPConfig, groups, seq_len: int) -> dict:
    """One float64 forward+backward of a stack under ``preset``: gradients, attention runs, communication, and the
    host bytes held after forward and after backward (``None`` without offload)."""
    c = decoder_config(shape)
    blocks = build_blocks(c, cfg, groups, preset).double()
    x, pos = sharded_input(c, cfg, groups, seq_len, torch.float64)
    offload = host_offload(blocks)
    with counting_attention() as calls, CommCounter().counting() as counter:
        y = x * 1.0
        for block in blocks:
            y = block(y, pos)
        held = None if offload is None else offload.held_bytes
        y.pow(2).sum().backward()
    grads = {name: p.grad for name, p in blocks.named_parameters()}
    grads["input"] = x.grad
    return {"grads": grads, "attention_runs": calls["n"], "comm": dict(counter.counts), "held": held,
            "after": None if offload is None else offload.held_bytes}


def attention_saved_bytes(cfg: ctx_plugin.CPConfig, groups, shape: str, seq_len: int) -> int:
    """The bytes of the distinct tensors one ``cp_attention`` call saves for backward plus its output, measured
    on the call alone with PyTorch's saved-tensor hooks (float64): what ``offload_attn`` copies per layer."""
    c = decoder_config(shape)
    n, d = seq_len // groups.size, c.hidden // c.heads
    q = torch.randn(BATCH, n, c.heads, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(BATCH, n, c.kv_heads, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(BATCH, n, c.kv_heads, d, dtype=torch.float64, requires_grad=True)
    seen: list[torch.Tensor] = []

    def pack(t):
        seen.append(t)
        return t

    q, k, v = q * 1.0, k * 1.0, v * 1.0             # the layer's projections: activations, not leaves
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ctx_plugin.cp_attention(q, k, v, config=cfg, groups=groups, causal=True)
    distinct = {id(t): t for t in [*seen, out]}
    return sum(t.numel() * t.element_size() for t in distinct.values())
