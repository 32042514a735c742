"""Every configuration of a cluster, ranked, and the reason the winner wins.

Layouts: tp from the options given (each divides the GPUs of a node, the heads and the K/V heads, as Megatron
splits them), cp over the divisors of GPUs/tp, dp = GPUs/(tp·cp); for cp > 1 every backend of
:class:`ctx_plugin.names.Backend` (``ulysses_ring`` with every Ulysses size 1 < u < cp dividing cp), for cp = 1 one
configuration without context parallelism. Each layout is tried with every recompute preset the memory model's
``budget`` chooses from (:func:`ctx_plugin.recompute.presets.candidates`). A layout the sequence length or the
heads do not allow (the memory model's and the attention's own checks) is skipped. Every layout with tp > 1 runs
Megatron's sequence parallelism (the memory model's ``sequence_parallel``, the TP collectives of the cost model), so
its ``seq_len / cp`` tokens must split over its tp ranks (:func:`ctx_plugin.core.rules.check_sequence_parallel`), and it
is tried only at the ZeRO stages a framework runs it at, without optimizer offload
(:mod:`ctx_plugin.plan.frameworks`: Megatron's ZeRO 0 or 1; ZeRO-2/3 and optimizer offload are DeepSpeed's, which
has no TP).

Ranking: configurations that fit first, by throughput (tokens per second per GPU; equal to ordering by step time
when dp is equal — a step with dp > 1 trains dp sequences at once, so raw step times of different dp are not
comparable); then those that do not fit, by memory. Ties keep enumeration order: Backend order, and among presets
of equal predicted time the one that recomputes less (selective's elementwise recompute is counted as free, so
``none`` wins a tie with it).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from ..core.config import CPConfig
from ..core.rules import check_tp_heads
from ..memory.specs import ModelSpec, ParallelSpec, ZeroSettings
from ..names import Backend, Framework, Recompute
from ..recompute.presets import RecomputeConfig, candidates
from .frameworks import check_search, runnable_stages
from .predict import NAMES, Cluster, Prediction, check_heads_split, predict
from .variants import Checker, Config, Setting, fitting, stage_order


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def layouts(cp: int) -> list[tuple[Backend, int]]:
    """(backend, ulysses_size) pairs to try at context-parallel size ``cp``."""
    if cp == 1:
        return [(CPConfig().backend, 1)]
    pairs = []
    for backend in Backend:
        sizes = [u for u in divisors(cp) if 1 < u < cp] if backend == Backend.ULYSSES_RING else [1]
        pairs += [(backend, u) for u in sizes]
    return pairs


def rank_key(p: Prediction) -> tuple:
    """Sort key (with a stable sort over the enumeration, so equal times keep the lighter recompute preset)."""
    return (0, -p.tokens_per_s_per_gpu) if p.fits else (1, p.memory_bytes, p.step_ms)


def _check_tp(model: ModelSpec, cluster: Cluster, tp_options: Iterable[int]) -> tuple[int, ...]:
    options = tuple(dict.fromkeys(tp_options))
    if not options:
        raise ValueError("give at least one tensor-parallel size (tp_options / --tp)")
    for tp in options:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor-parallel sizes must be positive ints, got {tp!r}")
        if cluster.gpus_per_node % tp:
            raise ValueError(f"tp={tp} must divide the GPUs per node ({cluster.gpus_per_node}): TP stays inside a "
                             f"node; valid tp: {tp_sizes(model, cluster)}")
        check_tp_heads(model.heads, model.kv_heads, tp, NAMES, replicate_kv=False)
    return options


def tp_sizes(model: ModelSpec, cluster: Cluster) -> list[int]:
    """The tensor-parallel sizes the planner can try: they divide the GPUs of a node and split the heads
    (:func:`ctx_plugin.core.rules.check_tp_heads`, K/V heads not replicated)."""
    out = []
    for k in divisors(cluster.gpus_per_node):
        try:
            check_tp_heads(model.heads, model.kv_heads, k, NAMES, replicate_kv=False)
        except ValueError:
            continue
        out.append(k)
    return out


def enumerate_plans(model: ModelSpec, seq_len: int, cluster: Cluster, *, micro_batch: int = 1,
                    dtype: torch.dtype = torch.bfloat16, tp_options: Iterable[int] = (1,),
                    presets: Iterable[RecomputeConfig | str] | None = None, zero_stage: int | Iterable[int] = 1,
                    modifiers: bool = False, documents=None,
                    zero_settings: ZeroSettings = ZeroSettings(),
                    framework: Framework | None = None) -> list[Prediction]:
    """Every valid configuration's prediction, best first (see the module docstring). ``zero_stage`` 1 is Megatron's
    distributed optimizer (several stages: each is tried); ``presets`` defaults to the memory model's candidates.
    ``modifiers``: each layout × preset also with the memory modifiers, activation offload and optimizer offload
    that make it fit (:func:`ctx_plugin.plan.variants.fitting`: the settings that may be fastest, at the lowest
    ZeRO stage given that fits), and the plain preset at the lightest stage where nothing makes it fit; when no
    configuration fits at all, also each such preset's memory-saving setting with the least GPU memory
    (:func:`ctx_plugin.plan.variants.saving_sets`), so that what comes closest, which :func:`explain` names, may
    carry modifiers. ``documents``: each sequence's packed documents (None, a mean length or lengths;
    :func:`predict`). ``zero_settings``: DeepSpeed's bucket sizes (:class:`ctx_plugin.memory.ZeroSettings`);
    ``framework``: only what it runs, with its model state (:mod:`.frameworks`)."""
    if not isinstance(model, ModelSpec) or not isinstance(cluster, Cluster):
        raise TypeError("enumerate_plans(model=ModelSpec, seq_len, cluster=Cluster, ...)")
    stages = tuple(sorted(set([zero_stage] if isinstance(zero_stage, int) else zero_stage)))
    if not stages:
        raise ValueError("give at least one ZeRO stage")
    for z in stages:
        ParallelSpec(zero_stage=z)    # checks the stages once, before anything is enumerated
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise ValueError(f"micro_batch must be a positive int, got {micro_batch!r}")
    options = _check_tp(model, cluster, tp_options)
    check_search(options, stages, framework)
    presets = candidates(model.layers) if presets is None else [RecomputeConfig.parse(p) for p in presets]
    if not presets:
        raise ValueError("give at least one recompute preset")
    plans, closest, skipped = [], [], []
    for tp in options:
        tp_stages = runnable_stages(tp, stages, framework)          # tp > 1: Megatron's ZeRO 0/1 only (plan.frameworks)
        if not tp_stages:
            continue
        for cp in divisors(cluster.gpus // tp):
            for backend, u in layouts(cp):
                try:
                    parallel = ParallelSpec(cp=cp, backend=backend, ulysses_size=u, tp=tp, sequence_parallel=tp > 1,
                                            dp=cluster.gpus // (tp * cp), zero_settings=zero_settings,
                                            framework=framework)
                    parallel = replace(parallel, zero_stage=stage_order(model, parallel, tp_stages, dtype)[-1])
                    check_heads_split(model, parallel)
                    if modifiers:
                        row, near = _with_modifiers(model, parallel, presets, tp_stages, seq_len, cluster,
                                                    micro_batch, dtype, documents)
                    else:
                        near = []
                        row = [predict(model, replace(parallel, zero_stage=z), preset, seq_len=seq_len,
                                       cluster=cluster, micro_batch=micro_batch, dtype=dtype, documents=documents)
                               for z in tp_stages for preset in presets]
                except ValueError as e:
                    skipped.append(f"{backend.value} cp={cp} tp={tp}: {e}")
                    continue
                plans += row
                closest += near
    if not plans:
        raise ValueError("no configuration can run: " + "; ".join(skipped[:3]))
    if not any(p.fits for p in plans):
        plans += [predict(model, par, rec, offload_optimizer=opt, seq_len=seq_len, cluster=cluster,
                          micro_batch=micro_batch, dtype=dtype, documents=documents) for par, rec, opt, _ in closest]
    return sorted(plans, key=rank_key)


class _Closest(Checker):
    """A :class:`Checker` that also keeps, for each preset, the configuration with the least GPU memory among those
    it found not to fit (for a preset nothing makes fit: its memory-saving settings at the lightest stage)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.closest: dict[RecomputeConfig, Config] = {}

    def __call__(self, parallel: ParallelSpec, setting: Setting, base: RecomputeConfig,
                 budget: float | None = None) -> Config | None:
        found = super().__call__(parallel, setting, base, budget)
        if found is not None and not found[3].fits:
            best = self.closest.get(base)
            if best is None or found[3].gpu_bytes < best[3].gpu_bytes:
                self.closest[base] = found
        return found


def _with_modifiers(model: ModelSpec, parallel: ParallelSpec, presets: list[RecomputeConfig], stages: tuple[int, ...],
                    seq_len: int, cluster: Cluster, micro_batch: int, dtype: torch.dtype,
                    documents=None) -> tuple[list[Prediction], list[Config]]:
    """The layout's configurations (see :func:`enumerate_plans`), and for each preset that nothing makes fit, its
    setting with the least GPU memory when that is less than the plain preset's (for the closest of a search where
    nothing fits)."""
    check = _Closest(model, cluster, seq_len, micro_batch=micro_batch, dtype=dtype)
    kw = dict(seq_len=seq_len, cluster=cluster, micro_batch=micro_batch, dtype=dtype, documents=documents)
    found = list(fitting(check, parallel, presets, stages))
    fitted = {rec.base for _, rec, _, _ in found}
    plain = [predict(model, parallel, preset, **kw) for preset in presets if preset not in fitted]
    near = [c for p in plain if (c := check.closest.get(p.recompute)) is not None and c[3].gpu_bytes < p.memory_bytes]
    return [predict(model, par, rec, offload_optimizer=opt, **kw) for par, rec, opt, _ in found] + plain, near


def _key(p: Prediction) -> tuple:
    return p.backend, p.cp, p.ulysses_size, p.tp


def best_per_layout(plans: list[Prediction]) -> list[Prediction]:
    """The first (best) plan of each parallel layout, in ranked order: its least-recompute preset that fits, or
    its smallest one when none does."""
    seen, best = set(), []
    for p in plans:
        if _key(p) not in seen:
            seen.add(_key(p))
            best.append(p)
    return best


def _link(inter: bool) -> str:
    return "InfiniBand" if inter else "NVLink"


def _ring_text(p: Prediction) -> str:
    link = _link(p.cp_inter_node)
    if p.min_tokens_to_hide is None:
        return (f"its ring exposes {p.ring_exposed_ms:.1f} ms over {link}: with these documents a ring step's "
                f"attention never outgrows its K/V transfer, however long the sequence")
    if p.ring_hidden:
        return (f"its ring hides every K/V step over {link}: {p.tokens_per_gpu:,} tokens per GPU ≥ the "
                f"{p.min_tokens_to_hide:,} needed (only the last dK/dV hop shows: {p.ring_exposed_ms:.1f} ms)")
    return (f"its ring exposes {p.ring_exposed_ms:.1f} ms over {link}: {p.tokens_per_gpu:,} tokens per GPU < the "
            f"{p.min_tokens_to_hide:,} needed to hide it")


def untried(model: ModelSpec, cluster: Cluster, tp_options: Iterable[int], zero_stages: Iterable[int],
            modifiers: bool) -> list[str]:
    """The options of ``ctx-plugin plan`` that save memory and that a search with these settings has not tried:
    larger tensor-parallel sizes the planner can use (:func:`tp_sizes`), a higher ZeRO stage (with tp 1:
    :mod:`.frameworks`), and the memory modifiers with offload."""
    tps, stages = set(tp_options), set(zero_stages)
    out = []
    more_tp = [k for k in tp_sizes(model, cluster) if k > max(tps)]
    if more_tp:
        at = "" if runnable_stages(more_tp[0], stages) else " --zero 1"        # TP runs at ZeRO 0 or 1 only
        out.append(f"more tensor parallelism (--tp {' '.join(map(str, more_tp))}{at})")
    higher = list(range(max(stages) + 1, 4))
    if higher:
        zero = f"--zero {' '.join(map(str, higher))}"          # ZeRO-2/3 run with tp 1 only
        if 1 not in tps:
            zero = f"--tp 1 {zero}"
        elif len(tps) > 1:
            zero += ", with tp 1"
        out.append(f"a higher ZeRO stage ({zero})")
    if not modifiers:
        out.append("the memory modifiers and offload (--modifiers)")
    return out


def _host_too(p: Prediction) -> str:
    """What ``p`` also exceeds in host memory when its reason names its GPU memory (nothing otherwise)."""
    if p.gpu_fits or p.host_fits:
        return ""
    est = p.estimate
    if est.host_budget is not None and not est.fits_host:
        return (f", and offloads {est.host / 2**30:.2f} GiB per rank > its {est.host_budget / 2**30:.2f} GiB "
                f"offload budget (the host memory a rank has left)")
    return f", and {p.host_gib:.1f} GiB of host memory per rank, more than a rank's share of its node"


def explain(winner: Prediction, plans: list[Prediction], *, untried: Iterable[str] = ()) -> str:
    """Why ``winner`` (normally ``plans[0]``) ranks first; for a winner that does not fit, what comes closest and
    what may still make it fit: more nodes, a shorter sequence, and ``untried`` (:func:`untried`: the options the
    search has not tried; none named by default)."""
    if not winner.fits:
        closest = min(plans, key=lambda p: p.memory_bytes)
        tries = list(untried)
        advice = "add nodes"
        if tries:
            advice += ", try " + (tries[0] if len(tries) == 1 else ", ".join(tries[:-1]) + " or " + tries[-1])
        return (f"nothing fits: the closest is {closest.layout} with recompute {closest.recompute}"
                f"{', optimizer offload' if closest.offload_optimizer else ''}, which {closest.reason}"
                f"{_host_too(closest)}; {advice}, or shorten the sequence")
    fitting = [p for p in plans if p.fits]
    why = [f"it has the highest throughput of the {len(fitting)} configurations that fit (of {len(plans)})"]
    def slower(p: Prediction) -> float:
        return 100 * (winner.tokens_per_s_per_gpu / p.tokens_per_s_per_gpu - 1)

    others = [p for p in best_per_layout(fitting) if _key(p) != _key(winner)]
    tied = [p for p in others if slower(p) < 0.05]
    if tied:
        why.append(f"{', '.join(p.layout for p in tied)} ties with it (same predicted time; listed by Backend order)")
    other = next((p for p in others if slower(p) >= 0.05), None)
    if other is not None:
        why.append(f"the best slower layout, {other.layout} with {other.recompute}, is {slower(other):.1f}% slower "
                   f"({other.reason})")
    if winner.ring_hidden is not None:
        why.append(_ring_text(winner))
    else:
        ring = next((p for p in plans if p.backend == Backend.ZIGZAG and (p.cp, p.tp) == (winner.cp, winner.tp)), None)
        if ring is not None and ring.min_tokens_to_hide is not None:
            why.append(f"a zigzag ring over cp={ring.cp} would need {ring.min_tokens_to_hide:,} tokens per GPU to "
                       f"hide its K/V over {_link(ring.cp_inter_node)} (it has {ring.tokens_per_gpu:,})")
    if winner.exposed_ms > 0:
        why.append(f"exposed communication {winner.exposed_ms:.1f} ms ({100 * winner.exposed_ms / winner.step_ms:.1f}%"
                   f" of the step)")
    lighter = [p for p in plans if _key(p) == _key(winner) and not p.fits and p.recompute_ms <= winner.recompute_ms
               and p.recompute != winner.recompute]
    if winner.recompute_ms > 0:
        text = (f"recompute {winner.recompute} costs {winner.recompute_ms:.1f} ms "
                f"({100 * winner.recompute_ms / winner.step_ms:.1f}%)")
    elif winner.recompute.preset in (Recompute.NONE, Recompute.ATTN_OUT):
        text = "nothing is recomputed"
    else:
        text = f"recompute {winner.recompute} repeats no matmul or attention FLOPs"
    if lighter:
        best = min(lighter, key=lambda p: (p.recompute_ms, p.memory_bytes))
        text += f"; less recompute does not fit ({best.recompute} needs {best.memory_gib:.1f} GiB)"
    why.append(text)
    if winner.real_share < 1:
        why.append(f"padding its documents to the layout's document unit takes {100 * (1 - winner.real_share):.2f}% "
                   f"of its tokens (computed, not counted in tokens/s or MFU)")
    return (f"winner: {winner.setup}: {winner.step_ms:,.1f} ms per step, {winner.tokens_per_s_per_gpu:,.0f} "
            f"tokens/s per GPU, MFU {100 * winner.mfu:.1f}%, {winner.memory_gib:.1f} GiB per GPU\n  because "
            + ";\n  ".join(why))
