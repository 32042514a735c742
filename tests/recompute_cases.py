"""Shared helpers for the recompute and memory-model tests (one process or spawned ranks)."""
from __future__ import annotations

import contextlib
import warnings

import torch
from torch.utils.flop_counter import FlopCounterMode

import ctx_plugin
import ctx_plugin.core.api
from ctx_plugin import recompute
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.memory import ModelSpec, ParallelSpec, layer_activations, saved_bytes
from ctx_plugin.models import CoreAttention, DecoderBlock, DecoderConfig

PRESETS = ["none", "attn_out", "selective", "core_attn", "mlp", "full", "full:uniform:2", "full:block:2", "sqrt"]
SHAPES = {"mha-gated": dict(heads=4, kv_heads=4, gated=True), "gqa-gated": dict(heads=4, kv_heads=2, gated=True),
          "gqa-plain": dict(heads=4, kv_heads=2, gated=False), "mqa-layernorm": dict(heads=4, kv_heads=1, gated=True,
                                                                                     norm="layer")}
HIDDEN, FFN, LAYERS, BATCH = 64, 160, 3, 2


def decoder_config(shape: str) -> DecoderConfig:
    return DecoderConfig(hidden=HIDDEN, ffn=FFN, layers=LAYERS, **SHAPES[shape])


def model_spec(c: DecoderConfig) -> ModelSpec:
    return ModelSpec(layers=c.layers, hidden=c.hidden, heads=c.heads, kv_heads=c.kv_heads, ffn=c.ffn, vocab=c.vocab,
                     gated=c.gated, norm=c.norm)


def build_blocks(c: DecoderConfig, cfg: ctx_plugin.CPConfig, groups, preset: str, seed: int = 0):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList(DecoderBlock(c, CoreAttention(cfg, groups)) for _ in range(c.layers))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # core_attn warns by design
        recompute.apply(blocks, preset)
    return blocks


def measured_vs_model(shape: str, preset: str, cfg: ctx_plugin.CPConfig, groups, seq_len: int) -> tuple[int, int]:
    """(bytes a real stack keeps for backward on this rank, the memory model's estimate)."""
    c = decoder_config(shape)
    blocks = build_blocks(c, cfg, groups, preset)
    n = seq_len // groups.size
    x0 = torch.randn(BATCH, n, c.hidden, requires_grad=True)
    pos = ctx_plugin.sequence_positions(seq_len, config=cfg, groups=groups)

    def forward():
        x = x0 * 1.0                     # the first layer's input is an activation like any other
        for block in blocks:
            x = block(x, pos)
        return x

    # Under CP, a communication buffer can still be referenced by the transport's own thread for a moment after
    # the collective returned (seen once: one q-sized all-to-all buffer, 12 KiB, alive at measurement time), which
    # can only add bytes; the smallest of two identical forwards is what the stack itself keeps.
    measured = None
    for _ in range(1 if groups.size == 1 else 2):
        out, got = saved_bytes(forward, exclude=[*blocks.parameters(), x0, pos])
        out.sum().backward()             # completes (and so checks) the recompute path
        measured = got if measured is None else min(measured, got)
    parallel = ParallelSpec(cp=groups.size, backend=cfg.backend, ulysses_size=cfg.ulysses_size)
    model = sum(layer_activations(model_spec(c), parallel, recompute.RecomputeConfig.parse(preset), seq_len=seq_len,
                                  micro_batch=BATCH, dtype=torch.float32))
    return measured, model


@contextlib.contextmanager
def counting_attention():
    """Counts the backend runs of ``cp_attention`` inside the block (``calls["n"]``)."""
    calls = {"n": 0}
    original = ctx_plugin.core.api.run_backend

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    ctx_plugin.core.api.run_backend = counting
    try:
        yield calls
    finally:
        ctx_plugin.core.api.run_backend = original


def sharded_input(c, cfg: ctx_plugin.CPConfig, groups, seq_len: int, dtype: torch.dtype):
    """This rank's shard of a seeded ``[BATCH, seq_len, hidden]`` input (requires grad) and its positions."""
    full = torch.randn(BATCH, seq_len, c.hidden, generator=torch.Generator().manual_seed(1), dtype=dtype)
    x = ctx_plugin.shard_sequence(full, config=cfg, groups=groups).requires_grad_(True)
    return x, ctx_plugin.sequence_positions(seq_len, config=cfg, groups=groups)


def train_step(shape: str, preset: str, cfg: ctx_plugin.CPConfig, groups, seq_len: int):
    """Gradients, attention executions and FLOPs of one forward+backward of a stack under ``preset``."""
    c = decoder_config(shape)
    blocks = build_blocks(c, cfg, groups, preset)
    x, pos = sharded_input(c, cfg, groups, seq_len, torch.float32)
    with counting_attention() as calls, FlopCounterMode(display=False) as flops, CommCounter().counting() as counter:
        y = x
        for block in blocks:
            y = block(y, pos)
        forward_flops = flops.get_total_flops()
        y.pow(2).sum().backward()
    grads = {name: p.grad for name, p in blocks.named_parameters()}
    grads["input"] = x.grad
    return {"grads": grads, "attention_runs": calls["n"], "flops": flops.get_total_flops(),
            "forward_flops": forward_flops, "comm": dict(counter.counts)}
