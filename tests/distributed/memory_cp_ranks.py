"""What Hugging Face Llama layers keep for backward on each of 2 context-parallel gloo ranks (ring family and
Ulysses backends), measured against the memory model's ``hf`` family at CP 2 (``test_memory_cp.py``)."""
from __future__ import annotations

import warnings

import torch

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.memory import ParallelSpec, layer_activations, saved_bytes
from ctx_plugin.memory.blocks import layer_terms
from tests.memory_blocks import BATCH, HIDDEN, _hf, spec

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SEQ = 64


def kept(rank: int, world: int, payload: dict) -> dict:
    """``payload["cases"]``: (backend, preset, dtype name); the measured and modelled bytes."""
    warnings.filterwarnings("ignore")
    out = {}
    for backend, preset, dtype_name in payload["cases"]:
        dtype = DTYPES[dtype_name]
        cfg = ctx_plugin.CPConfig(backend=backend, kernel="sdpa_cpu")
        groups = ctx_plugin.build_cp_groups(cfg)
        torch.manual_seed(0)
        model, layers, run_layers, _ = _hf("llama", 16, dtype, groups, cfg)
        recompute.apply(layers, preset)
        shard = lambda t: ctx_plugin.shard_sequence(t, config=cfg, groups=groups, dim=1)  # noqa: E731
        x0 = shard(torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype)).requires_grad_(True)
        pos = shard(torch.arange(SEQ)[None])[0]
        result, measured = saved_bytes(lambda: run_layers(x0 * 1.0, pos),
                                       exclude=[*model.parameters(), *model.buffers(), x0, pos])
        result.float().sum().backward()        # the attention's communication completes on both ranks
        m, p = spec("hf", 16), ParallelSpec(cp=world, backend=backend)
        k = layer_terms(m, p, SEQ, BATCH, dtype)
        model_bytes = sum(layer_activations(m, p, preset, seq_len=SEQ, micro_batch=BATCH, dtype=dtype))
        out[f"{backend}-{preset}-{dtype_name}"] = {"kept": measured, "model": model_bytes + k.shared + k.head - k.x}
    return out


def collective_temporaries(rank: int, world: int, payload: dict) -> list[int]:
    """``saved_bytes`` of a forward whose all-to-all sends a temporary and keeps only the received tensor (the
    result): nothing is kept, on every one of ``payload["tries"]`` calls. gloo's worker thread drops the sent
    temporary a moment after the call returns; the measurement waits for it (``ctx_plugin.memory.measure``)."""
    import sys

    import torch.distributed as dist

    # The worker thread needs the GIL to free a tensor whose Python object outlived its last Python reference; with
    # a long switch interval this thread keeps the GIL until it blocks (sleeps), so the race is lost almost always.
    sys.setswitchinterval(payload["switch_interval_s"])
    x = torch.randn(world * 4096)
    counted = []
    for _ in range(payload["tries"]):
        def forward():
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x * 2.0)      # the product is freed as soon as the call returns
            return out
        _, kept_bytes = saved_bytes(forward, exclude=[x])
        counted.append(kept_bytes)
    return counted
