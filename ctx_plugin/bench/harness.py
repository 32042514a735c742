"""What the benchmark measures: one attention shape, timed per simulated rank against the one-kernel ideal.

Efficiency of a backend at N ranks = ideal ÷ slowest rank, where ideal = the time of one local-kernel call on
the whole sequence ÷ N (what perfect splitting with free communication would give; with a window or packed
documents, that kernel's full-mask call scaled by the share of pairs they keep, see :func:`ideal_time`). TFLOP/s
per GPU = the attention's FLOPs ÷ N ÷ slowest rank. FLOPs are ``4·B·H·D`` per (query, key) pair forward (2 for the
scores, 2 for the values), forward+backward 3.5× that (backward 2.5×, the flash-attention convention), and the pairs
are counted exactly by the memory model's one function (:func:`ctx_plugin.memory.flops.pack`, so the benchmark and
``ctx-plugin plan`` count the same): ``S²`` full, ``S(S+1)/2`` causal, ``S·(w+1) − w·(w+1)/2`` with a sliding window
of w tokens back (``Shape.window``), and with packed documents (``Shape.documents``) the sum of those over the
documents' real tokens (attention never crosses a document nor touches padding).
"""
from __future__ import annotations

import functools
import itertools
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from ..core.api import cp_attention
from ..core.config import CPConfig
from ..core.documents import Documents, pad_documents
from ..core.kernels import select_kernel
from ..core.layouts import shard_layout
from ..core.mask import Mask
from ..core.rules import SettingNames, check_seq_len, padding_units
from ..memory.flops import Packing, check_documents, pack
from ..names import Kernel
from .simulated import FILLING, run_threaded, simulated_groups

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
    documents: tuple[int, ...] | None = None
    """Packed documents, as ``ctx-plugin plan --doc-len/--doc-lengths`` take them (the rule of
    :mod:`ctx_plugin.memory.flops`): ``None`` (one document, no packing), a mean length ``m`` (stored as ``(m,)``:
    documents of m tokens) or lengths (in order, repeated); they fill the sequence one after another and the last
    one is cut at its end. Each is padded at its end to the layout's document unit (:meth:`documents_for`)."""
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
        object.__setattr__(self, "documents", check_documents(self.documents))

    @property
    def mask(self) -> dict:
        """``cp_attention``'s mask keywords for this shape (the documents, which depend on the layout, apart:
        :meth:`documents_for`)."""
        return {"causal": self.causal, "window": None if self.window is None else (self.window, 0)}

    def packing(self, unit: int = 1) -> Packing:
        """What fills the sequence, each document padded to a multiple of ``unit`` (the layout's document unit;
        1: no padding): :func:`ctx_plugin.memory.flops.pack`'s pairs, real tokens and documents. A window
        ``(w, 0)`` admits no key after the query, with or without the causal flag: its pairs are causal ones."""
        return pack(self.seq_len, self.documents, unit=unit, causal=self.causal or self.window is not None,
                    window=self.window)

    def flops(self, backward: bool, unit: int = 1) -> float:
        """The attention's FLOPs: ``4·B·H·D`` per pair the mask keeps (:meth:`packing`), forward+backward 3.5×."""
        return 4 * self.batch * self.heads * self.head_dim * self.packing(unit).pairs * (3.5 if backward else 1.0)

    def document_unit(self, config: CPConfig, size: int) -> int:
        """What each document is padded to for ``config`` over ``size`` ranks (1 without documents)."""
        return 1 if self.documents is None else padding_units(config, size)[0]

    def documents_for(self, config: CPConfig, size: int) -> Documents | None:
        """The packed :class:`~ctx_plugin.core.documents.Documents` that ``cp_attention`` gets for ``config`` over
        ``size`` ranks (``None`` without documents): the documents of :attr:`documents` filling the sequence, each
        padded at its end to the layout's document unit by :func:`ctx_plugin.core.documents.pad_documents` with
        :func:`ctx_plugin.core.rules.padding_units` — the positions, real tokens and documents that :meth:`packing`
        counts. ValueError naming the fix when the sequence does not split over the ranks."""
        if self.documents is None:
            return None
        check_seq_len(config, self.seq_len, size, SettingNames(seq_len="--seq-len", cp="N"))
        return _padded_documents(self.seq_len, self.documents, *padding_units(config, size))

    def tensors(self, seq: int, generator: torch.Generator, grad: bool) -> tuple[torch.Tensor, ...]:
        """q, k, v, dout of ``seq`` tokens (random, on the shape's device and dtype; drawn there, from a seed that
        ``generator`` gives, when that is not the CPU: host draws of 128k-token tensors dominated a GPU run)."""
        device = torch.device(self.device)
        if device.type != "cpu":
            seed = int(torch.randint(0, 2 ** 62, (1,), generator=generator))
            generator = torch.Generator(device=device).manual_seed(seed)

        def make(h: int) -> torch.Tensor:
            t = torch.randn(self.batch, seq, h, self.head_dim, generator=generator, device=device)
            return t.to(self.dtype).requires_grad_(grad)
        return make(self.heads), make(self.kv_heads), make(self.kv_heads), make(self.heads).detach()

    def describe(self) -> dict:
        d = asdict(self)
        d.update(dtype=str(self.dtype).removeprefix("torch."), device=str(self.device))
        return d


@functools.lru_cache(maxsize=32)
def _padded_documents(seq_len: int, lengths: tuple[int, ...], unit: int, total_unit: int) -> Documents:
    """:meth:`Shape.documents_for` (cached: every rank and repetition shares one object). The real lengths follow
    :func:`~ctx_plugin.memory.flops.pack`'s rule — each document takes its length rounded up to ``unit`` positions
    until the sequence is full; the one the end cuts keeps the room left, a multiple of ``unit`` (``seq_len`` is a
    multiple of ``total_unit``, which ``unit`` divides), all of it real — and ``pad_documents`` lays them out;
    checked against ``pack`` (the count FLOPs come from)."""
    reals, room = [], seq_len
    for n in itertools.cycle(lengths):
        if room == 0:
            break
        reals.append(min(n, room))
        room -= min(-(-n // unit) * unit, room)
    docs, _ = pad_documents(reals, unit, total_unit=total_unit)
    packing = pack(seq_len, lengths, unit=unit)
    if (docs.seq_len, docs.count, sum(map(docs.real, range(docs.count)))) != \
            (seq_len, packing.documents, packing.real_tokens):
        raise RuntimeError(f"internal: padded documents {docs} differ from the memory model's packing {packing}")
    return docs


def median_time(fn, device: torch.device, reps: int, warmup: int = 1, before=None) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (CUDA events on GPUs, wall clock on the CPU); ``before()``
    runs untimed ahead of each run (e.g. a barrier that starts the ranks together)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)      # every rep starts on an idle device, the first one too
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
    """One timed call of ``cp_attention``: forward, or forward and backward (the shape's mask and its documents
    padded for ``config`` over the group's ranks, :meth:`Shape.documents_for`). Each backward writes fresh
    ``.grad`` tensors, as a step after ``zero_grad(set_to_none=True)`` does: the previous call's are dropped before the
    forward, so repeated calls add no gradient accumulation (three extra elementwise passes) to what is timed."""
    mask = {**shape.mask, "documents": shape.documents_for(config, groups.size)}

    def go():
        for t in (q, k, v):
            t.grad = None
        out = cp_attention(q, k, v, config=config, groups=groups, **mask)
        if backward:
            out.backward(dout)
    return go


def call_time(shape: Shape, kernel: Kernel, backward: bool, reps: int, *, windowed: bool = True) -> tuple[float, str]:
    """(seconds for one local-kernel call on the whole sequence, the kernel's name). The kernel is the one
    ``kernel`` selects for the shape's mask; ``windowed=False`` times it over the mask without the window. The
    call never sees the documents: they need no kernel feature (the plans cut them into blocks)."""
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


def full_mask(shape: Shape) -> Shape:
    """The shape without its window and documents: the mask whose one-kernel time the ideal scales."""
    return replace(shape, window=None, documents=None)


def ideal_share(shape: Shape, unit: int = 1) -> float:
    """The share of :func:`full_mask`'s pairs that the shape's window and documents keep (documents padded to
    ``unit``, :meth:`Shape.document_unit`): 1 without either."""
    return shape.packing(unit).pairs / full_mask(shape).packing().pairs


def ideal_time(shape: Shape, kernel: Kernel, backward: bool, reps: int, unit: int = 1) -> tuple[float, str]:
    """(the one-device time whose N-th part is the ideal, the kernel's name): one local-kernel call on the whole
    sequence. With a window or packed documents (padded to ``unit``), the kernel ``kernel`` selects for the mask runs
    the whole sequence over the full mask (:func:`full_mask`: causal or not, no window, one document) and the time is
    scaled by the share of pairs they keep (:func:`ideal_share`): the needed work at that kernel's own full-mask
    rate, its best (one large call; no per-block or per-document overhead). Timing the masked work itself would not
    be fair: the windowed call of a kernel that computes every score and masks, like the torch kernel, costs the
    full mask's time; one call per document (or a varlen call) pays small-call overheads; ranks that skip blocks
    would beat either "ideal". So efficiency stays ≤ ~1, and < 1 measures what the plan's blocks cost beyond the
    needed FLOPs at the kernel's best rate."""
    seconds, name = call_time(shape, kernel, backward, reps, windowed=False)
    return seconds * ideal_share(shape, unit), name


def rank_times(shape: Shape, config: CPConfig, size: int, backward: bool, reps: int) -> list[float]:
    """Each simulated rank's time for its real per-step work, run alone on the device (no communication; its
    receive buffers filled from its own send buffers: :data:`~ctx_plugin.bench.simulated.FILLING`)."""
    times = []
    for rank in range(size):
        groups = simulated_groups(config, rank, size, FILLING, shape.device.type)
        q, k, v, dout = shape.tensors(shape.seq_len // size, torch.Generator().manual_seed(rank), grad=backward)
        times.append(median_time(attention_step(shape, config, groups, q, k, v, dout, backward), shape.device,
                                 reps))
    return times


def simulated_outputs(config: CPConfig, size: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      dout: torch.Tensor, *, causal: bool, window=None, documents=None) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of the whole sequence (original order) computed by ``size`` simulated ranks exchanging
    real data in threads: what a distributed run computes (``window``, ``documents``: cp_attention's; each rank's
    shard follows the documents, as :func:`ctx_plugin.shard_sequence` cuts it)."""
    layout = shard_layout(config)
    seq = q.shape[1]
    check_seq_len(config, seq, size)
    docs = None if documents is None else documents if isinstance(documents, Documents) else Documents(documents)
    index = [layout.local_indices(seq, r, size, docs).to(q.device) for r in range(size)]

    def rank_work(rank: int, world) -> tuple[torch.Tensor, ...]:
        groups = simulated_groups(config, rank, size, world, q.device.type)
        local = [t.index_select(1, index[rank]).detach().requires_grad_(True) for t in (q, k, v)]
        out = cp_attention(*local, config=config, groups=groups, causal=causal, window=window, documents=docs)
        out.backward(dout.index_select(1, index[rank]))
        return (out.detach(), *(t.grad for t in local))

    results = run_threaded(size, rank_work)
    full = [torch.empty_like(t) for t in (q, q, k, v)]
    for rank, parts in enumerate(results):
        for whole, part in zip(full, parts):
            whole[:, index[rank]] = part
    return tuple(full)
