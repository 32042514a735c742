"""Host time to plan a new batch of packed documents (the bench's ``plan ms`` column).

With packed documents every attention call runs blocks cut per document: a rank builds its ring schedule, each
step's blocks (:meth:`ctx_plugin.core.layouts.RingLayout.plan`, or the all-gather's query chunks) and their varlen
calls (:func:`ctx_plugin.core.block_calls.plan_calls`) in Python. That happens once per batch of documents, before
the first layer's attention launches: the plans are cached, so the other layers, the backward and recomputation
reuse them. This module times that work for each rank with the caches emptied first (a new batch), in the same
functions the backends call, and reports the slowest rank. It is host time, not device time: on a GPU it is
hidden only when the host runs ahead of the device, which at the first layer of a step it does not.
"""
from __future__ import annotations

import time

from ..core import allgather, block_calls, layouts
from ..core.config import CPConfig
from ..core.kernels import select_kernel
from ..core.kernels.varlen import has_varlen
from ..core.mask import Mask
from ..core.rules import ulysses_ranks
from ..names import Backend

_CACHES = (layouts._document_plan, layouts._segments, layouts._segment_table, layouts._schedule, block_calls._varlen_plan,
           allgather._query_chunks)


def _ring_axis(config: CPConfig, size: int, seq_len: int) -> tuple[int, int]:
    """(ring ranks, local length on the ring) of ``config`` over ``size`` ranks: Ulysses' ring has one rank over
    the whole sequence, the hybrid's ``size / ulysses_size``."""
    ring = size // ulysses_ranks(config, size)
    return ring, seq_len // ring


def _plan_rank(config: CPConfig, kernel, rank: int, ring: int, local: int, mask: Mask, batch: int) -> None:
    if config.backend == Backend.ALLGATHER:
        chunks = allgather._query_chunks(rank, ring, local, mask)
        block_calls.plan_calls(kernel, chunks, mask, local, local * ring, batch)
        return
    layout = layouts.ring_layout(config)
    for offset in layouts.ring_schedule(layout, ring, local, mask, rank).offsets:
        blocks = layout.plan(rank, (rank - offset) % ring, ring, local, mask)
        block_calls.plan_calls(kernel, blocks, mask, local, local, batch)


def _mask_and_kernel(shape, config: CPConfig, size: int):
    docs = shape.documents_for(config, size)
    if docs is None:
        raise ValueError("plan_ms times packed documents: the shape has none")
    mask = Mask(shape.causal, shape.mask["window"], None, docs).within(shape.seq_len)
    return mask, select_kernel(config.kernel, shape.device, shape.dtype, shape.head_dim, mask.features)


def plan_ms(shape, config: CPConfig, size: int, ring_ranks=None) -> float:
    """The slowest rank's host milliseconds to plan one new batch of ``shape``'s documents for ``config`` over
    ``size`` ranks: every rank of the ring (or those of ``ring_ranks``) timed in turn, caches emptied before each.
    With a kernel that has varlen calls, building them is part of it (chains and fillers: the GPU kernels')."""
    mask, kernel = _mask_and_kernel(shape, config, size)
    ring, local = _ring_axis(config, size, shape.seq_len)
    ranks = range(ring) if ring_ranks is None else ring_ranks
    _plan_rank(config, kernel, ranks[0], ring, local, mask, shape.batch)   # untimed: a training process is warm
    slowest = 0.0
    for rank in ranks:
        for cache in _CACHES:
            cache.cache_clear()
        start = time.perf_counter()
        _plan_rank(config, kernel, rank, ring, local, mask, shape.batch)
        slowest = max(slowest, time.perf_counter() - start)
    return slowest * 1e3


def plan_rows(shape, configs_per_size, sizes) -> list[dict]:
    """``ctx-plugin bench --plan-only``'s rows: per N and backend (``configs_per_size``: the ``(label, CPConfig or
    the reason it cannot run)`` pairs of each size in ``sizes``), the documents and the slowest rank's plan ms."""
    rows = []
    for size, configs in zip(sizes, configs_per_size):
        for label, config in configs:
            try:
                if isinstance(config, str):
                    raise ValueError(config)
                mask, kernel = _mask_and_kernel(shape, config, size)
                rows.append({"backend": label, "ranks": size, "documents": mask.documents.count,
                             "doc_unit": shape.document_unit(config, size), "kernel": kernel.name,
                             "varlen": has_varlen(kernel), "plan_ms": plan_ms(shape, config, size)})
            except ValueError as e:
                rows.append({"backend": label, "ranks": size, "skipped": str(e)})
    return rows


def format_plan_table(rows: list[dict]) -> str:
    lines = [f"{'backend':<17} {'N':>3} {'docs':>7} {'unit':>4} {'kernel':<11} {'varlen':<6} {'plan ms':>9}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['backend']:<17} {r['ranks']:>3} skipped: {r['skipped']}")
        else:
            lines.append(f"{r['backend']:<17} {r['ranks']:>3} {r['documents']:>7} {r['doc_unit']:>4} "
                         f"{r['kernel']:<11} {'yes' if r['varlen'] else 'no':<6} {r['plan_ms']:>9.1f}")
    return "\n".join(lines)
