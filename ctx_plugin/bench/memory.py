"""What one call allocates and copies on one rank, from the torch profiler's memory events.

:func:`call_bytes` runs a call once under ``torch.profiler`` with ``profile_memory=True`` and reads its
allocation events in time order (on the CPU, or the GPU for CUDA tensors): ``allocated`` is the sum of every
allocation, ``peak`` the most bytes alive at once among those the call allocated (inputs and parameters are not
counted, nor their release; a tensor the call leaves alive, such as a ``.grad``, is). ``copied`` counts the bytes
written by the data-movement operators the call issues (copies, dtype conversions, concatenation, reordering,
expansion, fills: :data:`COPY_OPS`, and the written part of scatters), seen by a dispatch mode at the aten level,
where composite operators have been decomposed (``stack`` arrives as ``cat``, ``contiguous`` as ``clone``,
``repeat_interleave`` of an int as ``clone`` of an expanded view). Arithmetic (kernels, merges, in-place sums) is
not a copy, whatever it writes.

The bound a rank's peak is compared with (:func:`peak_bound`) is the issue's target for a context-parallel
call: ``1/N`` of the one-device peak (one kernel on the whole sequence, measured the same way) plus at most two
K/V blocks (one rank's K and V) in flight. The all-gather backend holds every rank's K/V by design, so it exceeds
that bound by construction; the ring layouts should not.

On the CPU the sizes are exact (the allocator reports what was asked for); on a GPU they are the caching
allocator's blocks (rounded up to 512 bytes).
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.config import CPConfig
from ..core.kernels import select_kernel
from ..core.mask import Mask
from ..names import Kernel
from .harness import Shape, attention_step
from .simulated import SILENT, simulated_groups

_aten = torch.ops.aten
COPY_OPS = frozenset({
    _aten.copy_.default, _aten.copy.default, _aten._to_copy.default, _aten.clone.default, _aten.cat.default,
    _aten.stack.default, _aten.index_select.default, _aten.index.Tensor, _aten.gather.default,
    _aten.repeat_interleave.self_int, _aten.repeat_interleave.Tensor, _aten.repeat.default, _aten.flip.default,
    _aten.roll.default, _aten.narrow_copy.default, _aten.constant_pad_nd.default, _aten._reshape_copy.default,
    _aten.fill_.Scalar, _aten.fill_.Tensor, _aten.fill.Scalar, _aten.zero_.default, _aten.zeros.default,
    _aten.ones.default, _aten.full.default, _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default,
    _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default})
"""Operators whose written bytes count as copied: their results (the destination of in-place ones)."""
_SCATTERS = {_aten.index_copy_.default: 3, _aten.index_copy.default: 3, _aten.index_put_.default: 2,
             _aten.index_put.default: 2, _aten.slice_scatter.default: 1, _aten.select_scatter.default: 1,
             _aten.scatter_.src: 3, _aten.scatter.src: 3}
"""Operators that write only part of their result: the argument (by position) whose bytes they write."""
_KINETO_NOISE = re.compile(r"^(USDT|STAGE|INFO|WARNING|ERROR):\S* \S+ \d+:\d+ \S+\.cpp:\d+\] "
                           r"(profiler_start|profiler_stop|Completed Stage|gpuGetDeviceCount failed)")
"""The lines libkineto prints to stderr around every CPU-only profile (on a machine without a GPU)."""


@dataclass(frozen=True)
class CallBytes:
    allocated: int
    """Bytes of all allocations during the call (freed or not)."""
    copied: int
    """Bytes written by :data:`COPY_OPS` (and the written part of scatters)."""
    peak: int
    """The most bytes alive at once among those the call allocated."""


class _CopyCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        written = out if func in COPY_OPS else args[_SCATTERS[func]] if func in _SCATTERS else ()
        self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(written) if isinstance(t, torch.Tensor))
        return out


@contextlib.contextmanager
def _quiet_kineto() -> Iterator[None]:
    """Drops libkineto's start/stop chatter from stderr (file descriptor 2); every other line written meanwhile is
    passed on when the block ends."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):        # no real stderr (e.g. captured by a test runner): nothing to filter
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_NOISE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))


def _allocations(prof, device: torch.device, gpu_like: bool = False) -> list[tuple[int, int]]:
    """(address, bytes: + allocated, − freed) of every allocation event on ``device``'s type, in time order
    (at equal times allocations first, so a peak is never missed). ``gpu_like``: without the operand copies an
    in-place op with a dtype promotion makes on the CPU (``fp32 += bf16``; CUDA casts inside the kernel)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device.type:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size < 0, fields.ptr, fields.alloc_size, node))
    kept, promoted = [], set()          # addresses of promotion copies alive (their release is dropped too)
    for _, _, ptr, size, node in sorted(events, key=lambda ev: ev[:4]):
        if size > 0 and gpu_like and _promotion(node, _EventType.TorchOp):
            promoted.add(ptr)
        elif size < 0 and ptr in promoted:
            promoted.discard(ptr)
        else:
            kept.append((ptr, size))
    return kept


def _promotion(node, torch_op) -> bool:
    """Whether an allocation is TensorIterator's CPU copy of an operand into an in-place op's dtype: made by
    ``aten::to`` → ``aten::_to_copy`` under an in-place operator (a name ending in ``_``)."""
    ops, parent = [], node.parent
    while parent is not None and len(ops) < 4:
        if parent.tag == torch_op:
            ops.append(parent.name)
        parent = parent.parent
    return len(ops) == 4 and ops[1:3] == ["aten::_to_copy", "aten::to"] and ops[3].endswith("_")


def _profiled(fn: Callable[[], object], device: torch.device, counter: TorchDispatchMode | None = None):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with _quiet_kineto(), profile(activities=activities, profile_memory=True) as prof:
        with counter if counter is not None else contextlib.nullcontext():
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return prof


def call_bytes(fn: Callable[[], object], device: torch.device) -> CallBytes:
    """Runs ``fn()`` once and returns what it allocated, copied and held at its peak (see the module docstring).
    Whatever ``fn`` returns is dropped before the profile ends, so a returned tensor counts as freed."""
    counter = _CopyCounter()
    events = _allocations(_profiled(fn, device, counter), device)
    return CallBytes(allocated=sum(size for _, size in events if size > 0), copied=counter.bytes, peak=_peak(events))


def _peak(events: list[tuple[int, int]], left_out: frozenset[int] = frozenset()) -> int:
    """The most bytes alive at once among the blocks the events allocate (a block from before them: its release
    is not counted), leaving out the allocations at the indices ``left_out``."""
    live = peak = 0
    mine: dict[int, int] = {}           # address → bytes of the blocks allocated here and held
    for i, (ptr, size) in enumerate(events):
        if size > 0:
            if i not in left_out:
                mine[ptr] = size
                live += size
                peak = max(peak, live)
        elif mine.pop(ptr, None) is not None:
            live += size
    return peak


def transient_peak(fn: Callable[[], object], device: torch.device) -> int:
    """The most bytes alive at once among the blocks ``fn()`` allocates and frees before it returns (what it leaves
    alive, such as the gradients a backward returns, is left out from its allocation on), as a GPU holds them: on
    the CPU without the operand copies of in-place ops with a dtype promotion. What the memory model's
    ``cp_buffers`` counts for one attention backward (:mod:`ctx_plugin.memory.buffers`)."""
    events = _allocations(_profiled(fn, device), device, gpu_like=True)
    left: dict[int, int] = {}          # address → index of its allocation still alive at the end
    for i, (ptr, size) in enumerate(events):
        if size > 0:
            left[ptr] = i
        else:
            left.pop(ptr, None)
    return _peak(events, frozenset(left.values()))


def kv_block_bytes(batch: int, local_len: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One rank's K and V: ``2·B·(S/N)·Hkv·D`` elements."""
    return 2 * batch * local_len * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def peak_bound(single_device_peak: int, size: int, kv_block: int) -> float:
    """The target for one rank's peak: ``single-device peak / N + 2 K/V blocks``."""
    return single_device_peak / size + 2 * kv_block


def rank_bytes(shape: Shape, config: CPConfig, size: int, backward: bool) -> list[CallBytes]:
    """Each simulated rank's :class:`CallBytes` for one call (after one unmeasured warm-up call), run alone like
    :func:`~ctx_plugin.bench.harness.rank_times`: the local work, no data moved."""
    result = []
    for rank in range(size):
        groups = simulated_groups(config, rank, size, SILENT, shape.device.type)
        q, k, v, dout = shape.tensors(shape.seq_len // size, torch.Generator().manual_seed(rank), grad=backward)
        step = attention_step(shape, config, groups, q, k, v, dout, backward)
        step()
        result.append(call_bytes(step, shape.device))
    return result


def single_device_bytes(shape: Shape, kernel: Kernel, backward: bool) -> CallBytes:
    """One local-kernel call on the whole sequence (the benchmark's ideal), measured like a rank's call; with packed
    documents the call is the same, one document (kernels see no documents: the plans cut them into blocks)."""
    mask = Mask(shape.causal, shape.mask["window"]).within(shape.seq_len)
    k_obj = select_kernel(kernel, shape.device, shape.dtype, shape.head_dim, mask.features)
    q, k, v, dout = shape.tensors(shape.seq_len, torch.Generator().manual_seed(0), grad=False)
    kw = {"causal": shape.causal, "scale": shape.head_dim ** -0.5, "window": mask.window}

    def go():
        out, lse = k_obj.forward(q, k, v, **kw)
        if backward:
            k_obj.backward(dout, q, k, v, out, lse, **kw)
    go()
    return call_bytes(go, shape.device)


MIB = 2.0 ** 20


def memory_columns(shape: Shape, size: int, single: CallBytes, ranks: list[CallBytes]) -> dict:
    """The report's memory fields (MiB; allocated, copied and peak are each the largest over the ranks) and the
    peak against :func:`peak_bound`; ``rank_*_mib`` list every rank's values."""
    kv = kv_block_bytes(shape.batch, shape.seq_len // size, shape.kv_heads, shape.head_dim, shape.dtype)
    bound = peak_bound(single.peak, size, kv)
    peak = max(r.peak for r in ranks)
    return {"alloc_mib": max(r.allocated for r in ranks) / MIB, "copied_mib": max(r.copied for r in ranks) / MIB,
            "peak_mib": peak / MIB, "bound_mib": bound / MIB, "peak_vs_bound": peak / bound,
            "single_peak_mib": single.peak / MIB, "kv_block_mib": kv / MIB,
            "rank_alloc_mib": [r.allocated / MIB for r in ranks], "rank_copied_mib": [r.copied / MIB for r in ranks],
            "rank_peak_mib": [r.peak / MIB for r in ranks]}
