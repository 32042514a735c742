"""The configurations of one parallel layout × recompute preset beyond the preset itself — memory modifiers
(``+tile_loss``, ``+tile_mlp``, ``+recompute_attn``, ``+offload:<GiB>``, ``+offload_attn:<GiB>``), the ZeRO stage and
optimizer offload — and the dominance rules that keep their number small.

Rules (each checked against a brute-force scan in ``tests/unit/test_plan_longest.py``):

1. Memory: the ZeRO stage changes only the model state, never what else the GPU holds, so the stage with the least
   model state (:func:`stage_order`; normally the highest, but DeepSpeed's fixed buffers can outweigh what ZeRO-2/3
   shard of a small model) never needs more GPU memory, and the same host memory; ``+tile_loss`` and
   ``+tile_mlp`` never add memory; ``+offload_attn`` keeps no more on the GPU than ``+offload``; ``full:block:N``
   needs no less than ``full:block:N+1`` (more layers keep all their activations) and ``full`` is
   ``full:block:L``, so no ``full:block:N`` fits where ``full`` does not. So a preset fits at some
   setting iff it fits with both tilings, the lightest stage allowed and one of the *memory-saving* modifier sets
   (:func:`saving_sets`), with or without optimizer offload.
2. Time: every modifier and optimizer offload adds time (recompute, copies, the CPU Adam step) and the ZeRO stage
   adds none (the planner ignores data-parallel traffic). So among the settings of a preset that fit, only the
   *minimal* ones can be fastest: a setting whose modifiers include a fitting setting's is never checked, and each
   setting takes the lowest ZeRO stage at which it fits.

Only what a framework runs is tried (:mod:`ctx_plugin.plan.frameworks`): a layout with tp > 1 only at ZeRO 0 or 1
and without optimizer offload.

The activation offload budget is what a node's host memory leaves per rank after the reserve and the rank's
optimizer offload (:func:`offload_budget_gib`, to 3 significant digits); a configuration that fits is shown with
the budget it needs (its offloaded bytes rounded up to 3 significant digits) when that is within what is left.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import product

import torch

from ..memory.model import param_count
from ..memory.state import model_state
from ..memory.specs import ModelSpec, ParallelSpec
from ..names import Recompute
from ..recompute.presets import RecomputeConfig
from .cluster import Cluster
from .costs import optimizer_offload
from .frameworks import runnable, runnable_stages
from .predict import Footprint, footprint

_REGION = (Recompute.FULL, Recompute.SQRT)


@dataclass(frozen=True)
class Setting:
    """One point of a preset's setting lattice: which modifiers and whether the optimizer is offloaded."""

    tile_loss: bool
    tile_mlp: bool
    recompute_attention: bool
    offload: str | None          # None, "offload" or "offload_attn"
    offload_optimizer: bool

    def covers(self, other: Setting) -> bool:
        """Whether this setting has every option ``other`` has (so it costs at least as much time)."""
        offload_rank = {None: 0, "offload": 1, "offload_attn": 2}
        return (self.tile_loss >= other.tile_loss and self.tile_mlp >= other.tile_mlp
                and self.recompute_attention >= other.recompute_attention
                and offload_rank[self.offload] >= offload_rank[other.offload]
                and (other.offload != "offload_attn" or self.offload == "offload_attn")
                and self.offload_optimizer >= other.offload_optimizer)

    @property
    def size(self) -> int:
        return (self.tile_loss + self.tile_mlp + self.recompute_attention + self.offload_optimizer
                + {None: 0, "offload": 1, "offload_attn": 2}[self.offload])

    def apply(self, base: RecomputeConfig, budget_gib: float | None) -> RecomputeConfig:
        mods = dict(tile_loss=self.tile_loss, tile_mlp=self.tile_mlp, recompute_attention=self.recompute_attention)
        if self.offload is not None:
            mods.update(offload_gib=budget_gib, offload_attention=self.offload == "offload_attn")
        return replace(base, **mods)


def offload_budget_gib(model: ModelSpec, parallel: ParallelSpec, cluster: Cluster, dtype: torch.dtype,
                       offload_optimizer: bool) -> float | None:
    """Host GiB per rank left for activation offload, to 3 significant digits (rounded down: the budget a preset
    string states is the one checked), or None when nothing is left."""
    left = cluster.host_bytes_per_rank
    if offload_optimizer:
        left -= optimizer_offload(param_count(model, parallel.tp), parallel.shard_degree, dtype.itemsize, cluster)[0]
    return significant(left / 2**30, math.floor) if left > 0 else None


def significant(gib: float, rounding) -> float:
    """``gib`` rounded (``math.floor`` or ``math.ceil``) to 3 significant digits: 116.287 → 116, 0.019531 → 0.0195."""
    scale = 10.0 ** (math.floor(math.log10(gib)) - 2)
    return round(rounding(round(gib / scale, 9)) * scale, 12)


def settings(base: RecomputeConfig, *, optimizer: bool, offload: bool) -> list[Setting]:
    """Every setting of ``base`` (offload and +recompute_attn only for ``full``/``sqrt``), fewest options first."""
    region = base.preset in _REGION
    kinds = [(False, None)]
    if region:
        kinds += [(True, None)] + ([(False, "offload"), (True, "offload"), (False, "offload_attn")] if offload else [])
    out = [Setting(tl, tm, ra, kind, opt) for tl, tm, (ra, kind), opt in
           product((False, True), (False, True), kinds, (False, True) if optimizer else (False,))]
    return sorted(out, key=lambda s: s.size)


def saving_sets(base: RecomputeConfig, *, optimizer: bool, offload: bool) -> list[Setting]:
    """The settings that keep least on the GPU (rule 1): both tilings, each way to shed the pinned attention."""
    kinds = [(False, "offload_attn"), (True, "offload")] if offload else []
    if base.preset in _REGION:
        kinds += [(True, None), (False, None)]
    else:
        kinds = [(False, None)]
    return [Setting(True, True, ra, kind, opt) for (ra, kind) in kinds
            for opt in ((False, True) if optimizer else (False,))]


Config = tuple[ParallelSpec, RecomputeConfig, bool, Footprint]
"""(parallel with its ZeRO stage, recompute with modifiers, optimizer offload, the footprint)."""


class Checker:
    """Footprints of one model on one cluster at one length, counting how many the memory model was asked."""

    def __init__(self, model: ModelSpec, cluster: Cluster, seq_len: int, *, micro_batch: int, dtype: torch.dtype):
        self.model, self.cluster, self.seq_len, self.micro_batch, self.dtype = model, cluster, seq_len, micro_batch, dtype
        self.checked = 0

    def budget(self, parallel: ParallelSpec, offload_optimizer: bool) -> float | None:
        return offload_budget_gib(self.model, parallel, self.cluster, self.dtype, offload_optimizer)

    def __call__(self, parallel: ParallelSpec, setting: Setting, base: RecomputeConfig,
                 budget: float | None = None) -> Config | None:
        """The footprint of ``base`` with ``setting`` on ``parallel`` (offloading at most ``budget`` GiB per rank,
        by default all the host memory left), or None when it cannot be built (no host memory is left for
        offload) or the memory model refuses it."""
        budget = self.budget(parallel, setting.offload_optimizer) if budget is None else budget
        if setting.offload is not None and budget is None:
            return None
        recompute = setting.apply(base, budget)
        self.checked += 1
        try:
            fp = footprint(self.model, parallel, recompute, seq_len=self.seq_len, cluster=self.cluster,
                           micro_batch=self.micro_batch, dtype=self.dtype, offload_optimizer=setting.offload_optimizer)
        except ValueError:
            return None
        return parallel, recompute, setting.offload_optimizer, fp


    def tighten(self, found: Config, setting: Setting, base: RecomputeConfig) -> Config:
        """``found`` with its offload budget lowered to what it offloads (rounded up to 0.1 GiB) when that still
        fits: the preset string then states what the rank needs."""
        parallel, recompute, _, fp = found
        if recompute.offload_gib is None:
            return found
        if fp.estimate.host <= 0:
            return found
        need = significant(fp.estimate.host / 2**30, math.ceil)
        if need >= recompute.offload_gib:
            return found
        tight = self(parallel, setting, base, need)
        return tight if tight is not None and tight[3].fits else found


def _ordered(presets: Iterable[RecomputeConfig]) -> list[RecomputeConfig]:
    """full and sqrt first, then full:block:N by descending N (rule 1's break), then the rest."""
    presets = list(presets)
    blocks = sorted((p for p in presets if p.preset == Recompute.FULL and p.method == "block"),
                    key=lambda p: -p.num_layers)
    first = [p for p in presets if p.preset in _REGION and p not in blocks]
    return first + blocks + [p for p in presets if p not in first and p not in blocks]


def memory_presets(presets: Iterable[RecomputeConfig]) -> list[RecomputeConfig]:
    """The presets whose memory decides whether any of ``presets`` fits (rule 1): ``full:block:N`` only when
    ``full`` is not among them; full and sqrt first."""
    presets = _ordered(presets)
    if RecomputeConfig(preset=Recompute.FULL) in presets:
        presets = [p for p in presets if p.method != "block"]
    return presets


def stage_order(model: ModelSpec, layout: ParallelSpec, zero_stages: Iterable[int],
                dtype: torch.dtype) -> tuple[int, ...]:
    """The ZeRO stages of ``zero_stages`` a framework runs ``layout`` at, heaviest model state first (ties: the
    lower stage first). Nothing else the GPU holds depends on the stage, so the last is where rule 1 tries a layout.
    Normally the stages ascend; DeepSpeed's fixed buffers (2–5 GB at its default bucket sizes) can make ZeRO-2/3
    heavier than Megatron's ZeRO-1 for a model under a billion parameters or so."""
    n = param_count(model, layout.tp)

    def state(z: int) -> int:
        return model_state(model, replace(layout, zero_stage=z), n, dtype).training

    return tuple(sorted(runnable_stages(layout.tp, zero_stages, layout.framework), key=lambda z: (-state(z), z)))


def can_fit(check: Checker, layout: ParallelSpec, presets: Iterable[RecomputeConfig],
            zero_stages: tuple[int, ...]) -> Config | None:
    """A fitting configuration of this layout (the first found by rule 1), or None when none fits."""
    stages = stage_order(check.model, layout, zero_stages, check.dtype)
    if not stages:
        return None
    top = replace(layout, zero_stage=stages[-1])
    block_failed = False
    for base in memory_presets(presets):
        if block_failed and base.method == "block":
            continue
        for setting in saving_sets(base, optimizer=runnable(top.tp, top.zero_stage, True, top.framework), offload=True):
            found = check(top, setting, base)
            if found is not None and found[3].fits:
                return found
        block_failed = base.method == "block"
    return None


def fitting(check: Checker, layout: ParallelSpec, presets: Iterable[RecomputeConfig],
            zero_stages: tuple[int, ...]) -> Iterator[Config]:
    """Every configuration of this layout that fits and may be fastest (rules 1 and 2), each at its lowest ZeRO
    stage (only the stages and optimizer offload a framework runs the layout with: :mod:`.frameworks`)."""
    stages = stage_order(check.model, layout, zero_stages, check.dtype)
    if not stages:
        return
    top = replace(layout, zero_stage=stages[-1])
    block_failed = False
    for base in _ordered(presets):
        if block_failed and base.method == "block":
            continue
        optimizer = runnable(top.tp, top.zero_stage, True, top.framework)
        if not any((f := check(top, s, base)) is not None and f[3].fits
                   for s in saving_sets(base, optimizer=optimizer, offload=True)):
            block_failed = base.method == "block"
            continue
        block_failed = False
        minimal: list[Setting] = []
        for setting in settings(base, optimizer=optimizer, offload=True):
            if any(setting.covers(m) for m in minimal):
                continue
            if (found := check(top, setting, base)) is None or not found[3].fits:
                continue
            minimal.append(setting)
            found = check.tighten(found, setting, base)
            for z in sorted(stages):
                if z < top.zero_stage and runnable(layout.tp, z, setting.offload_optimizer, layout.framework):
                    lower = check(replace(layout, zero_stage=z), setting, base, found[1].offload_gib)
                    if lower is not None and lower[3].fits:
                        found = lower
                        break
            yield found
