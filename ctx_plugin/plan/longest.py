"""The longest sequence a model trains on a cluster, the fastest configuration at that length, and what binds.

Lengths are multiples of every layout's unit (the least common multiple, so each length is valid for each layout;
with tp > 1 the unit of sequence parallelism, :func:`ctx_plugin.core.rules.sequence_unit`). Only the combinations a
framework runs are searched (:mod:`ctx_plugin.plan.frameworks`: tp > 1 at ZeRO 0 or 1, without optimizer offload).
A length is feasible when some configuration — layout × recompute preset × modifiers × ZeRO stage × optimizer
offload — fits in GPU memory and in host memory; by :mod:`ctx_plugin.plan.variants`' rule 1 it is enough to try
each layout × preset with its memory-saving settings ("trials"). Memory grows with the length, so each trial fits
every length up to its own longest, and the answer is the largest of those: the search takes the trial that fits
the current length with the most room, finds its longest length (doubling, then bisection), keeps only the trials
that still fit one unit longer and repeats until none does — a binary search over the length whose feasibility
covers every trial, without re-trying a trial that has failed. At the longest length every configuration that may
be fastest (rule 2) is timed with :func:`ctx_plugin.plan.predict` and ranked like ``ctx-plugin plan``; one unit
longer, the trial that comes closest to fitting says what binds (GPU memory and its largest part, or host memory)
and by how much, and the trial that fits its GPUs with the least host memory, if any, shows what more host memory
would buy.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from ..core.config import CPConfig
from ..core.rules import sequence_unit
from ..memory.specs import ModelSpec, ParallelSpec, ZeroSettings
from ..names import Framework
from ..recompute.presets import RecomputeConfig, candidates
from .cluster import Cluster
from .frameworks import check_search, runnable, runnable_stages
from .predict import Footprint, check_heads_split, predict
from .prediction import Prediction
from .search import _check_tp, divisors, layouts, rank_key
from .variants import Checker, fitting, memory_presets, saving_sets, stage_order

MAX_TOKENS = 2**34
"""The search gives up above this many tokens (a model that still fits there is not bounded by memory)."""


def parallel_layouts(model: ModelSpec, cluster: Cluster, tp_options: Iterable[int],
                     zero_stages: Iterable[int] = (0,), zero_settings: ZeroSettings = ZeroSettings(),
                     framework: Framework | None = None) -> list[ParallelSpec]:
    """Every layout (tp × cp × backend × Ulysses size, dp the rest) whose heads split and that a framework runs at
    one of ``zero_stages`` (:mod:`.frameworks`: tp > 1 at ZeRO 0 or 1); ZeRO stage 0, sequence parallelism with
    tp > 1."""
    out = []
    for tp in _check_tp(model, cluster, tp_options):
        if not runnable_stages(tp, zero_stages, framework):
            continue
        for cp in divisors(cluster.gpus // tp):
            for backend, u in layouts(cp):
                parallel = ParallelSpec(cp=cp, backend=backend, ulysses_size=u, tp=tp, sequence_parallel=tp > 1,
                                        dp=cluster.gpus // (tp * cp), zero_settings=zero_settings,
                                        framework=framework)
                try:
                    check_heads_split(model, parallel)
                except ValueError:
                    continue
                out.append(parallel)
    return out


def unit(parallels: Iterable[ParallelSpec]) -> int:
    """The least common multiple of the layouts' sequence units (with sequence parallelism's cp·tp)."""
    return math.lcm(*(sequence_unit(CPConfig(backend=p.backend, ulysses_size=p.ulysses_size), p.cp,
                                    p.tp if p.sequence_parallel else 1)
                      for p in parallels))


@dataclass(frozen=True)
class Longest:
    """The answer of :func:`longest`."""

    seq_len: int
    """The longest sequence (tokens) some configuration fits."""
    unit: int
    """Lengths searched are multiples of this."""
    plans: list[Prediction]
    """The configurations that fit at ``seq_len`` and may be fastest, best first."""
    next_len: int
    """``seq_len + unit``: the shortest length that does not fit."""
    closest: Prediction
    """Of the memory-saving configurations (rule 1), the one that comes closest to fitting at ``next_len`` (over
    its GPU or host memory limit by the smallest fraction)."""
    host_bound: Prediction | None
    """Of the same configurations, the one that fits its GPUs at ``next_len`` with the least host memory (None
    when none fits its GPUs there): more host memory would make it fit."""
    checked: int
    """Configurations whose memory the search computed."""

    @property
    def winner(self) -> Prediction:
        return self.plans[0]


def _overflow(fp: Footprint, cluster: Cluster) -> float:
    return max(fp.gpu_bytes / cluster.gpu_bytes, fp.host_bytes / cluster.host_bytes_per_rank)


def longest(model: ModelSpec, cluster: Cluster, *, tp_options: Iterable[int] = (1,),
            zero_stages: Iterable[int] = (0, 1, 2, 3), presets: Iterable[RecomputeConfig | str] | None = None,
            micro_batch: int = 1, dtype: torch.dtype = torch.bfloat16, documents=None,
            zero_settings: ZeroSettings = ZeroSettings(), framework: Framework | None = None) -> Longest:
    """The longest sequence that fits, its fastest configurations and the one closest to fitting one unit longer
    (see the module docstring); ValueError when nothing fits even one unit. ``documents`` (packed documents: None,
    a mean length or lengths) change the step times, not the memory, so not the length found. ``zero_settings``:
    DeepSpeed's bucket sizes (its defaults), which size its buffers at ZeRO-2/3 (:mod:`ctx_plugin.memory.state`);
    ``framework``: search only what it runs, with its model state (:mod:`.frameworks`)."""
    if not isinstance(model, ModelSpec) or not isinstance(cluster, Cluster):
        raise TypeError("longest(model=ModelSpec, cluster=Cluster, ...)")
    stages = tuple(sorted(set(zero_stages)))
    if not stages:
        raise ValueError("give at least one ZeRO stage")
    for z in stages:
        ParallelSpec(zero_stage=z)
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
    presets = candidates(model.layers) if presets is None else [RecomputeConfig.parse(p) for p in presets]
    if not presets:
        raise ValueError("give at least one recompute preset")
    check_search(_check_tp(model, cluster, tp_options), stages, framework)
    parallels = parallel_layouts(model, cluster, tp_options, stages, zero_settings, framework)
    if not parallels:
        raise ValueError(f"no parallel layout splits {model.name}'s heads over {cluster.gpus} GPUs")
    step = unit(parallels)
    # rule 1's configurations ("trials"). Memory grows with the length, so each trial fits up to its own longest
    # length; the answer is the largest of those. Take the trial that fits the current length with most room,
    # find its longest length (doubling, then bisection), then keep only the trials that fit one unit longer
    # and repeat until none does: every trial that fails a length is never tried again.
    tops = [replace(p, zero_stage=stage_order(model, p, stages, dtype)[-1]) for p in parallels]
    trials = [(top, base, s) for top in tops for base in memory_presets(presets)
              for s in saving_sets(base, optimizer=runnable(top.tp, top.zero_stage, True, framework), offload=True)]
    checkers: dict[int, Checker] = {}

    def at(j: int, k: int):
        check = checkers.setdefault(k, Checker(model, cluster, k * step, micro_batch=micro_batch, dtype=dtype))
        parallel, base, setting = trials[j]
        return check(parallel, setting, base)

    def fits(j: int, k: int) -> bool:
        if k * step > MAX_TOKENS:
            raise ValueError(f"{(k - 1) * step:,} tokens still fit: memory does not bound this model on this cluster "
                             f"below {MAX_TOKENS:,} tokens")
        found = at(j, k)
        return found is not None and found[3].fits

    best, alive = 0, list(range(len(trials)))
    while True:
        k = best + 1
        found = {j: at(j, k) for j in alive}
        ok = [j for j in alive if found[j] is not None and found[j][3].fits]
        if not ok:
            break
        champion = min(ok, key=lambda j: _overflow(found[j][3], cluster))
        lo, stride = k, 1
        while fits(champion, lo + stride):
            lo, stride = lo + stride, 2 * stride
        hi = lo + stride
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(champion, mid) else (lo, mid)
        best, alive = lo, ok
    misses = [f for j in range(len(trials)) if (f := at(j, k)) is not None]      # every trial, one unit longer
    checked = sum(c.checked for c in checkers.values())
    if not misses:
        raise ValueError(f"no configuration can run {k * step:,} tokens on {cluster.gpus} GPUs")
    kw = dict(seq_len=k * step, cluster=cluster, micro_batch=micro_batch, dtype=dtype, documents=documents)
    par, rec, opt, _ = min(misses, key=lambda f: _overflow(f[3], cluster))
    closest = predict(model, par, rec, offload_optimizer=opt, **kw)
    host_bound = None
    if gpu_only := [f for f in misses if f[3].gpu_fits]:
        par, rec, opt, _ = min(gpu_only, key=lambda f: f[3].host_bytes)
        host_bound = predict(model, par, rec, offload_optimizer=opt, **kw)
    if best == 0:
        raise ValueError(f"nothing fits even {step:,} tokens (the shortest length every layout can split): the "
                         f"closest, {closest.setup}, {closest.reason}")
    seq_len = best * step
    check = Checker(model, cluster, seq_len, micro_batch=micro_batch, dtype=dtype)
    plans = [predict(model, par, rec, seq_len=seq_len, cluster=cluster, micro_batch=micro_batch, dtype=dtype,
                     offload_optimizer=opt, documents=documents)
             for p in parallels for par, rec, opt, _ in fitting(check, p, presets, stages)]
    checked += check.checked
    return Longest(seq_len=seq_len, unit=step, plans=sorted(plans, key=rank_key), next_len=seq_len + step,
                   closest=closest, host_bound=host_bound, checked=checked)


def binding(p: Prediction, cluster: Cluster) -> str:
    """What keeps ``p`` (a configuration that does not fit) from fitting, and by how much, in one line."""
    gib = 2**30
    gpu_over = p.memory_bytes / cluster.gpu_bytes
    host_over = p.host_bytes / cluster.host_bytes_per_rank
    budget = p.recompute.offload_gib
    budget_over = 0.0 if budget is None or p.estimate.fits_host else p.estimate.host / (budget * gib)
    if host_over <= 1 < budget_over and budget_over > gpu_over:     # the node has room, the budget stated has not
        over = (p.estimate.host - budget * gib) / 2**20
        return (f"host memory binds: {p.estimate.host / gib:,.2f} GiB of activations offloaded per rank > its "
                f"+offload:{budget:g} budget (the host memory a rank has left, to 3 significant digits): "
                f"{over:,.2f} MiB ({100 * (budget_over - 1):.2f}%) over")
    if host_over > gpu_over:
        node = p.host_bytes * cluster.gpus_per_node / gib
        room = cluster.host_memory_gib - cluster.host_reserve_gib
        over = (p.host_bytes - cluster.host_bytes_per_rank) * cluster.gpus_per_node / 2**20
        return (f"host memory binds: {node:,.2f} GiB per node > {room:,.2f} GiB ({cluster.host_memory_gib:g} less "
                f"{cluster.host_reserve_gib:g} reserved): {over:,.2f} MiB ({100 * (host_over - 1):.2f}%) over")
    est = p.estimate
    transient_name = "logits at the loss" if est.transient == est.logits_peak else "a layer's backward" \
        if est.transient == est.recompute_peak else "the attention's backward with its CP buffers and kernel workspace"
    parts = {"activations kept for backward": est.activations,
             f"transient ({transient_name})": est.transient,
             "parameters": est.params, "gradients": est.grads,
             "optimizer state": 0 if p.offload_optimizer else est.optimizer,
             f"{est.framework.value}'s buffers": est.framework_buffers}
    largest = max(parts, key=parts.get)
    text = ", ".join(f"{name} {value / gib:,.1f}" for name, value in sorted(parts.items(), key=lambda kv: -kv[1]))
    over = (p.memory_bytes - cluster.gpu_bytes) / 2**20
    return (f"GPU memory binds: {p.memory_gib:,.2f} GiB > {cluster.gpu_room_gib:g} GiB per GPU "
            f"({cluster.gpu_memory_gib:g} less {cluster.gpu_reserve_gib:g} reserved): {over:,.2f} MiB "
            f"({100 * (gpu_over - 1):.2f}%) over; its largest part is {largest} ({text} GiB)")
