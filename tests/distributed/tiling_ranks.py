"""+recompute_attn and +tile_mlp inside spawned ranks (see test_tiling_ranks.py): float64 gradients of a stack of
ctx_plugin's blocks under a preset against the same stack without recompute, the CP communication counted after
the forward and after the backward, and the attention's executions; a megatron-core TransformerLayer with
Megatron's own attention ([s, b, h], MLP returning (output, bias)) tiled at CP 1, tensor parallelism 1 and 2, with
and without sequence parallelism."""
from __future__ import annotations

import warnings

import torch

import ctx_plugin
import ctx_plugin.core.api
from ctx_plugin import recompute
from ctx_plugin.bench.counting import CommCounter
from ctx_plugin.models import CoreAttention, DecoderBlock, DecoderConfig
from ctx_plugin.recompute import pinning

C = DecoderConfig(hidden=32, ffn=64, layers=3, heads=4, kv_heads=2, gated=False)     # GELU MLP with biases
BATCH = 2


def _step(preset: str, cfg: ctx_plugin.CPConfig, groups, seq: int) -> dict:
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DecoderBlock(C, CoreAttention(cfg, groups)) for _ in range(C.layers)).double()
    for p in blocks.parameters():
        if p.dim() == 1:
            torch.nn.init.normal_(p, 0.5, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")        # core_attn warns by design
        recompute.apply(blocks, preset)
    full = torch.randn(BATCH, seq, C.hidden, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    x = ctx_plugin.shard_sequence(full, config=cfg, groups=groups).requires_grad_(True)
    pos = ctx_plugin.sequence_positions(seq, config=cfg, groups=groups)
    calls = {"n": 0}
    original = ctx_plugin.core.api.run_backend

    def counting(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    ctx_plugin.core.api.run_backend = counting
    try:
        with CommCounter().counting() as counter:
            y = x
            for block in blocks:
                y = block(y, pos)
            forward = dict(counter.counts)
            y.pow(2).sum().backward()
    finally:
        ctx_plugin.core.api.run_backend = original
    grads = {"input": x.grad, **{name: p.grad for name, p in blocks.named_parameters()}}
    return {"grads": grads, "forward": forward, "total": dict(counter.counts), "runs": calls["n"],
            "mode": pinning.state().mode}


def stacks(rank: int, world: int, payload: dict) -> dict:
    out = {}
    for backend, u, presets in payload["configs"]:
        cfg = ctx_plugin.CPConfig(backend=backend, ulysses_size=u, kernel="torch")
        groups = ctx_plugin.build_cp_groups(cfg)
        reference = _step("none", cfg, groups, payload["seq"])
        for preset in ["none", *presets]:
            step = reference if preset == "none" else _step(preset, cfg, groups, payload["seq"])
            err = max(((g - reference["grads"][n]).abs().max() / reference["grads"][n].abs().max()).item()
                      for n, g in step["grads"].items())
            out[f"{backend}-u{u}-{preset}"] = {"grad_err": err, "forward": step["forward"], "total": step["total"],
                                              "runs": step["runs"], "mode": step["mode"]}
    if payload.get("megatron"):
        out["megatron"] = _megatron_layer(payload["megatron"])
    return out


def _megatron_layer(presets: list[str]) -> dict:
    """Relative gradient errors of one megatron-core TransformerLayer (local spec: Megatron's own attention and MLP,
    biases, GQA, init std 0.1, float64) under each preset against the same layer without one, at CP 1 with
    tensor parallelism 1 and 2, and 2 with sequence parallelism (each rank holds half the sequence; its MLP
    gathers the same chunk of both halves and scatters it back; the norms built by
    :func:`tests.integration.megatron_ranks.sequence_parallel_norms`). Keys: ``tp{N}-sp{bool}-{preset}``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.integration.megatron_ranks import _cpu_shims, sequence_parallel_norms   # (_cpu_shims: CUDA buffers)

    warnings.filterwarnings("ignore")
    seq = 24
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]
    result = {}
    for tp, sp in ((1, False), (2, False), (2, True)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)     # CP 1
        try:
            config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                                       ffn_hidden_size=80, use_cpu_initialization=True, attention_dropout=0.0,
                                       hidden_dropout=0.0, add_bias_linear=True, add_qkv_bias=True,
                                       init_method_std=0.1, tensor_model_parallel_size=tp, sequence_parallel=sp)
            spec = get_gpt_layer_local_spec()
            tp_rank = parallel_state.get_tensor_model_parallel_rank()

            def grads(preset):
                torch.manual_seed(0)
                with sequence_parallel_norms():
                    layer = build_module(spec, config=config, layer_number=1).double()
                if preset is not None:
                    recompute.apply([layer], preset, sequence_dim=0)
                x = torch.randn(seq, BATCH, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
                x = (x.chunk(tp, dim=0)[tp_rank] if sp else x).clone().requires_grad_(True)
                with _cpu_shims():
                    out, _ = layer(x, attention_mask=mask)
                    (out.pow(2) * torch.linspace(-1, 1, out.shape[0], dtype=torch.float64)[:, None, None]).sum() \
                        .backward()
                return {"input": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}

            want = grads(None)
            for preset in presets:
                got = grads(preset)
                result[f"tp{tp}-sp{sp}-{preset}"] = max(((got[n] - w).abs().max() / w.abs().max()).item()
                                                         for n, w in want.items())
        finally:
            parallel_state.destroy_model_parallel()
    return result
