"""What the benchmark measures: one attention shape, timed per simulated rank against the one-kernel ideal.

Efficiency of a backend at N ranks = ideal ÷ slowest rank, where ideal = the time of one local-kernel call on
the whole sequence ÷ N (what perfect splitting with free communication would give; with a window, that kernel's
full-mask call scaled by the share of FLOPs the window keeps, see :func:`ideal_time`). TFLOP/s per GPU = the
attention's FLOPs ÷ N ÷ slowest rank: ``4·B·S²·H·D`` forward (halved when causal), forward+backward 3.5× that
(backward 2.5×, the flash-attention convention). With a sliding window of w tokens back (``Shape.window``) the
FLOPs count the pairs the window keeps, ``4·B·H·D·(S·(w+1) − w·(w+1)/2)``.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from ..api import cp_attention
from ..config import CPConfig
from ..kernels import select_kernel
from ..layouts import shard_layout
from ..mask import Mask
from ..rules import check_seq_len
from ..names import Kernel
from .simulated import SILENT, run_threaded, simulated_groups

PASSES = ("fwd", "fwd+bwd")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The attention the benchmark runs (global sequence; every rank holds seq_len / N tokens)."""

    seq_len: int
    heads: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    batch: int = 1
    causal: bool = True
    window: int | None = None
    """A sliding window: each query sees itself and the ``window`` tokens before it (``window=(w, 0)``)."""
    dtype: torch.dtype = torch.bfloat16
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        for name in ("seq_len", "heads", "kv_heads", "head_dim", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 0):
            raise ValueError(f"window must be None or an int >= 0, got {self.window!r}")

    @property
    def mask(self) -> dict:
        """``cp_attention``'s mask keywords for this shape."""
        return {"causal": self.causal, "window": None if self.window is None else (self.window, 0)}

    def flops(self, backward: bool) -> float:
        if self.window is None:
            pairs = self.seq_len ** 2 * (0.5 if self.causal else 1.0)
        else:
            w = min(self.window, self.seq_len - 1)
            pairs = self.seq_len * (w + 1) - w * (w + 1) / 2
        return 4 * self.batch * self.heads * self.head_dim * pairs * (3.5 if backward else 1.0)

    def tensors(self, seq: int, generator: torch.Generator, grad: bool) -> tuple[torch.Tensor, ...]:
        """q, k, v, dout of ``seq`` tokens (random, on the shape's device and dtype)."""
        def make(h: int) -> torch.Tensor:
            t = torch.randn(self.batch, seq, h, self.head_dim, generator=generator).to(self.device, self.dtype)
            return t.requires_grad_(grad)
        return make(self.heads), make(self.kv_heads), make(self.kv_heads), make(self.heads).detach()

    def describe(self) -> dict:
        d = asdict(self)
        d.update(dtype=str(self.dtype).removeprefix("torch."), device=str(self.device))
        return d


def median_time(fn, device: torch.device, reps: int, warmup: int = 1, before=None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (CUDA events on GPUs, wall clock on the CPU); ``before()``
    runs untimed ahead of each run (e.g. a barrier that starts the ranks together)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_step(shape: Shape, config: CPConfig, groups, q, k, v, dout, backward: bool):
    """One timed call of ``cp_attention``: forward, or forward and backward."""
    def go():
        out = cp_attention(q, k, v, config=config, groups=groups, **shape.mask)
        if backward:
            out.backward(dout)
    return go


def call_time(shape: Shape, kernel: Kernel, backward: bool, reps: int, *, windowed: bool = True) -> tuple[float, str]:
    """(seconds for one local-kernel call on the whole sequence, the kernel's name). The kernel is the one
    ``kernel`` selects for the shape's mask; ``windowed=False`` times it over the mask without the window."""
    mask = Mask(shape.causal, shape.mask["window"]).within(shape.seq_len)
    k_obj = select_kernel(kernel, shape.device, shape.dtype, shape.head_dim, mask.features)
    q, k, v, dout = shape.tensors(shape.seq_len, torch.Generator().manual_seed(0), grad=False)
    scale = shape.head_dim ** -0.5
    window = mask.window if windowed else Mask(shape.causal).window
    kw = {"causal": shape.causal, "scale": scale, "window": window}    # the whole sequence: one square block

    def go():
        out, lse = k_obj.forward(q, k, v, **kw)
        if backward:
            k_obj.backward(dout, q, k, v, out, lse, **kw)
    return median_time(go, shape.device, reps), k_obj.name


def ideal_time(shape: Shape, kernel: Kernel, backward: bool, reps: int) -> tuple[float, str]:
    """(the one-device time whose N-th part is the ideal, the kernel's name): one local-kernel call on the whole
    sequence. With a window, the kernel that applies it runs the whole sequence over the mask without the window
    and the time is scaled by the share of FLOPs the window keeps (:meth:`Shape.flops`): the windowed work at that
    kernel's own full-mask rate. (Timing the windowed call itself would credit a kernel that computes every score
    and masks, like the torch kernel, with a window's cost equal to the full mask's, and ranks that skip blocks
    would beat that "ideal".)"""
    if shape.window is None:
        return call_time(shape, kernel, backward, reps)
    seconds, name = call_time(shape, kernel, backward, reps, windowed=False)
    return seconds * shape.flops(backward) / replace(shape, window=None).flops(backward), name


def rank_times(shape: Shape, config: CPConfig, size: int, backward: bool, reps: int) -> list[float]:
    """Each simulated rank's time for its real per-step work, run alone on the device (no communication)."""
    times = []
    for rank in range(size):
        groups = simulated_groups(config, rank, size, SILENT, shape.device.type)
        q, k, v, dout = shape.tensors(shape.seq_len // size, torch.Generator().manual_seed(rank), grad=backward)
        times.append(median_time(attention_step(shape, config, groups, q, k, v, dout, backward), shape.device,
                                 reps))
    return times


def simulated_outputs(config: CPConfig, size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor, *, causal: bool, window=None) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of the whole sequence (original order) computed by ``size`` simulated ranks exchanging
    real data in threads: what a distributed run computes (``window``: cp_attention's)."""
    layout = shard_layout(config)
    seq = q.shape[1]
    check_seq_len(config, seq, size)
    index = [layout.local_indices(seq, r, size).to(q.device) for r in range(size)]

    def rank_work(rank: int, world) -> tuple[torch.Tensor, ...]:
        groups = simulated_groups(config, rank, size, world, q.device.type)
        local = [t.index_select(1, index[rank]).detach().requires_grad_(True) for t in (q, k, v)]
        out = cp_attention(*local, config=config, groups=groups, causal=causal, window=window)
        out.backward(dout.index_select(1, index[rank]))
        return (out.detach(), *(t.grad for t in local))

    results = run_threaded(size, rank_work)
    full = [torch.empty_like(t) for t in (q, q, k, v)]
    for rank, parts in enumerate(results):
        for whole, part in zip(full, parts):
            whole[:, index[rank]] = part
    return tuple(full)
