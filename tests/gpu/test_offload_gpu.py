"""Activation offload on CUDA (``+offload``/``+offload_attn``, ctx_plugin.recompute.offload): the CUDA path
(pinned host buffers, side streams, events, ``record_stream``) is exact, frees the device memory it offloads, and
its copies overlap compute.

Skipped without CUDA. ``python -m pytest -q tests/gpu/test_offload_gpu.py`` (about a minute on one GPU).

Overlap is verified with ``torch.profiler`` on a second training step (the first one warms the pinned-memory and
device caching allocators): in the exported trace, the device-to-host copies ("Memcpy DtoH") and the copies back
("Memcpy HtoD") run on streams other than the compute kernels', and a good part of their time lies inside the time
intervals of compute kernels that run meanwhile on the compute stream (the next region's forward, resp. the
recomputation and backward of the region after the one being brought back).
"""
from __future__ import annotations

import json

import pytest
import torch

import ctx_plugin
from ctx_plugin import recompute
from ctx_plugin.models import CoreAttention, DecoderBlock, DecoderConfig
from ctx_plugin.recompute.offload import host_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OVERLAP = 0.25          # the least fraction of each direction's copy time that must run under compute kernels


def _stack(c: DecoderConfig, preset: str, kernel: str, dtype: torch.dtype):
    cfg = ctx_plugin.CPConfig(kernel=kernel)
    groups = ctx_plugin.build_cp_groups(cfg)
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DecoderBlock(c, CoreAttention(cfg, groups)) for _ in range(c.layers))
    for p in blocks.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.1)
    blocks = blocks.to("cuda", dtype)
    recompute.apply(blocks, preset)
    return blocks


def _step(blocks, x0: torch.Tensor):
    x = x0 * 1.0
    pos = torch.arange(x0.shape[1], device="cuda")
    for block in blocks:
        x = block(x, pos)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    offload = host_offload(blocks)
    held = offload.held_bytes if offload else 0
    x.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return allocated, held


@pytest.mark.parametrize("preset", ["full", "full:uniform:2", "full:block:1", "sqrt"])
def test_exact_on_cuda_and_device_memory_freed(preset):
    """float64 (the torch kernel): gradients of ``<preset>+offload_attn`` equal ``<preset>``'s to rounding (the
    same kernels on the same values; cuBLAS may pick another algorithm for other addresses); after forward the
    device holds at least the host bytes less than without offload."""
    c = DecoderConfig(hidden=256, heads=8, kv_heads=2, ffn=512, layers=4)
    x0 = torch.randn(2, 1024, c.hidden, device="cuda", dtype=torch.float64, requires_grad=True)
    results = {}
    for p in (preset, f"{preset}+offload_attn:4"):
        blocks = _stack(c, p, "torch", torch.float64)
        x0.grad = None
        allocated, held = _step(blocks, x0)
        grads = {n: q.grad for n, q in blocks.named_parameters()} | {"input": x0.grad.clone()}
        results[p] = allocated, held, grads
        assert host_offload(blocks) is None or host_offload(blocks).held_bytes == 0
    (plain_alloc, _, want), (alloc, held, got) = results[preset], results[f"{preset}+offload_attn:4"]
    for name, w in want.items():
        err = ((got[name] - w).abs().max() / w.abs().max()).item()
        assert err <= 1e-12, f"{name}: relative error {err:.1e}"
    assert held > 0 and plain_alloc - alloc >= held, (plain_alloc, alloc, held)


def _intervals(events):
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events)


def _overlapped(copies, kernels) -> float:
    """The fraction of the copies' time during which some kernel runs."""
    busy = []
    for start, end in _intervals(kernels):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    total = inside = 0.0
    for start, end in _intervals(copies):
        total += end - start
        inside += sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
    return inside / total


def test_copies_overlap_compute(tmp_path):
    """bf16, the fastest attention kernel, 8k tokens × 2048 wide: the profiler trace of a second step."""
    c = DecoderConfig(hidden=2048, heads=16, kv_heads=4, ffn=5632, layers=6)
    blocks = _stack(c, "full+offload_attn:64", "auto", torch.bfloat16)
    x0 = torch.randn(1, 8192, c.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _step(blocks, x0)                                   # warm-up: allocators, kernel choice
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        _step(blocks, x0)
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    busy: dict = {}
    for e in kernels:
        busy[e["args"]["stream"]] = busy.get(e["args"]["stream"], 0) + e["dur"]
    compute = max(busy, key=busy.get)            # the stream the model runs on (the side streams may run a
    kernels = [e for e in kernels if e["args"]["stream"] == compute]    # contiguous() before a strided copy)
    for direction in ("DtoH", "HtoD"):
        copies = [e for e in events if e.get("cat") == "gpu_memcpy" and direction in e["name"]]
        assert copies, f"no {direction} copies in the trace"
        streams = {e["args"]["stream"] for e in copies}
        assert compute not in streams, f"{direction} copies on the compute stream {compute}"
        fraction = _overlapped(copies, kernels)
        assert fraction >= OVERLAP, f"only {fraction:.0%} of the {direction} copy time overlaps compute"


def test_large_copies_take_exact_registered_buffers():
    """Region inputs of at least 64 MiB go to host buffers of their exact size registered with cudaHostRegister
    (torch's pinned blocks would round 64.5 MiB up to 128 MiB), reused by the next step; gradients unchanged."""
    from ctx_plugin.recompute.pinned import REGISTER_MIN

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()) for _ in range(2))
    layers = layers.to("cuda", torch.bfloat16)
    x0 = torch.randn(1, 66_048, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    nbytes = x0.numel() * 2
    assert nbytes > REGISTER_MIN and nbytes & (nbytes - 1)          # not a power of two

    def step():
        x = x0 * 1.0
        for layer in layers:
            x = layer(x)
        torch.cuda.synchronize()
        offload = host_offload(layers)
        held = offload.held_bytes if offload else 0
        x.float().pow(2).mean().backward()
        torch.cuda.synchronize()
        grads = [x0.grad.clone(), *(p.grad.clone() for p in layers.parameters())]
        x0.grad = None
        layers.zero_grad(set_to_none=True)
        return held, grads

    _, want = step()
    recompute.apply(layers, "full+offload:1")
    held, got = step()
    assert held == 2 * nbytes                                       # two regions' inputs, exact bytes
    pool = host_offload(layers)._pinned
    assert pool.registered_bytes == 2 * nbytes
    held, again = step()                                            # the next step reuses the same buffers
    assert pool.registered_bytes == 2 * nbytes and held == 2 * nbytes
    for a, b, c in zip(want, got, again):
        assert torch.equal(a, b) and torch.equal(b, c)
