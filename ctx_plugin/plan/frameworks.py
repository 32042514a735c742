"""Which planned configurations a supported framework runs: one rule, checked by every prediction and used by the
searches to leave the others out.

Megatron-LM runs tensor parallelism (with sequence parallelism: the planner assumes it whenever tp > 1) next to
context parallelism; its optimizer state is replicated (ZeRO-0) or sharded by its distributed optimizer
(``--use-distributed-optimizer``, ZeRO-1), and it has no optimizer offload. DeepSpeed's ``"context_parallel"``
section runs ZeRO 0–3 and ``offload_optimizer`` (which needs ZeRO ≥ 1), but no tensor parallelism. So tp > 1 runs
at ZeRO 0 or 1 without optimizer offload, and tp = 1 runs every stage. A search for one framework
(``--framework``) keeps to what that framework runs, and counts the model state as it holds it
(:mod:`ctx_plugin.memory.state`; without it, as :attr:`ctx_plugin.memory.ParallelSpec.runs_on` says).
"""
from __future__ import annotations

from collections.abc import Iterable

from ..names import Framework


def check_runnable(tp: int, zero_stage: int, offload_optimizer: bool = False,
                   framework: Framework | None = None) -> None:
    """ValueError naming the conflict when no supported framework (or not ``framework``, when given) runs
    ``tp``-way tensor parallelism with this ZeRO stage and optimizer offload."""
    if offload_optimizer and zero_stage < 1:
        raise ValueError("optimizer offload (DeepSpeed offload_optimizer) needs ZeRO stage 1, 2 or 3, not 0")
    if framework == Framework.MEGATRON and (zero_stage > 1 or offload_optimizer):
        what = f"ZeRO-{zero_stage}" + (" with optimizer offload" if offload_optimizer else "")
        raise ValueError(f"{what} on Megatron: its distributed optimizer is ZeRO-1 and has no optimizer offload; "
                         f"use --zero 0 1 (or --framework deepspeed)")
    if framework == Framework.DEEPSPEED and tp > 1:
        raise ValueError(f"tp={tp} on DeepSpeed: its context_parallel section has no tensor parallelism; use --tp 1 "
                         f"(or --framework megatron)")
    if tp > 1 and (zero_stage > 1 or offload_optimizer):
        what = f"ZeRO-{zero_stage}" + (" and optimizer offload" if offload_optimizer else "")
        raise ValueError(f"tp={tp} with {what}: no supported framework runs it. Tensor parallelism runs on "
                         f"Megatron only, whose distributed optimizer is ZeRO-1 (no ZeRO-2/3, no optimizer "
                         f"offload), and DeepSpeed's context_parallel section, which has ZeRO-2/3 and optimizer "
                         f"offload, has no tensor parallelism: use ZeRO 0 or 1 with tp > 1 (--zero 0 1), or tp 1 "
                         f"(--tp 1)")


def runnable(tp: int, zero_stage: int, offload_optimizer: bool = False, framework: Framework | None = None) -> bool:
    """Whether :func:`check_runnable` accepts the combination."""
    try:
        check_runnable(tp, zero_stage, offload_optimizer, framework)
    except ValueError:
        return False
    return True


def runnable_stages(tp: int, stages: Iterable[int], framework: Framework | None = None) -> tuple[int, ...]:
    """The ZeRO stages of ``stages`` (ascending) that a layout with ``tp``-way tensor parallelism runs at."""
    return tuple(z for z in sorted(set(stages)) if runnable(tp, z, framework=framework))


def check_search(tp_options: Iterable[int], stages: Iterable[int], framework: Framework | None = None) -> None:
    """ValueError naming the conflict when no tensor-parallel size of the search runs at any of its ZeRO stages
    (e.g. ``--tp 2 --zero 3``; ``--framework megatron --zero 3``)."""
    tps, zs = sorted(set(tp_options)), sorted(set(stages))
    if framework == Framework.MEGATRON and zs and zs[-1] > 1:
        raise ValueError(f"--framework megatron with --zero {' '.join(map(str, zs))}: Megatron's distributed optimizer "
                         f"is ZeRO-1; give --zero 0 1, or --framework deepspeed for ZeRO-2/3")
    if framework == Framework.DEEPSPEED and tps and tps[-1] > 1:
        raise ValueError(f"--framework deepspeed with --tp {' '.join(map(str, tps))}: DeepSpeed's context_parallel "
                         f"section has no tensor parallelism; give --tp 1, or --framework megatron for TP")
    if tps and zs and not any(runnable_stages(tp, zs, framework) for tp in tps):
        try:
            check_runnable(tps[0], zs[0], framework=framework)
        except ValueError as e:
            raise ValueError(f"nothing to search: tensor-parallel sizes {tps} with ZeRO stages {zs}: {e}") from None


def excluded(tp_options: Iterable[int], stages: Iterable[int], optimizer_offload: bool,
             framework: Framework | None = None) -> str | None:
    """The line the planner prints when the search leaves combinations out because no framework (or not
    ``framework``) runs them (None when it leaves none out); ``optimizer_offload``: whether the search tries
    optimizer offload."""
    if framework == Framework.MEGATRON and optimizer_offload and any(z >= 1 for z in stages):
        return "not searched: optimizer offload (--framework megatron: Megatron has none)"
    if framework is not None:
        return None
    tps = sorted(tp for tp in set(tp_options) if tp > 1)
    high = sorted(z for z in set(stages) if z > 1)
    offload = optimizer_offload and any(z >= 1 for z in stages)
    if not tps or not (high or offload):
        return None
    what = " or ".join(([f"ZeRO-{'/'.join(map(str, high))}"] if high else [])
                       + (["optimizer offload"] if offload else []))
    return (f"not searched: tp {'/'.join(map(str, tps))} with {what} (no supported framework runs them: tensor "
            f"parallelism is Megatron's, with ZeRO 0 or 1 and no optimizer offload; DeepSpeed has no TP)")


def deepspeed_counted(stages: Iterable[int], optimizer_offload: bool, framework: Framework | None = None) -> bool:
    """Whether a search counts some configuration's model state as DeepSpeed holds it (so a DeepSpeed config's
    bucket sizes matter): with ``framework`` deepspeed, else at ZeRO-2/3 or with optimizer offload (ZeRO ≥ 1)."""
    if framework is not None:
        return framework == Framework.DEEPSPEED
    return any(z >= 2 or (optimizer_offload and z >= 1) for z in stages)
