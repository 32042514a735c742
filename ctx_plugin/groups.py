"""Process groups for context parallelism, built once and passed explicitly to every call."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch.distributed as dist

from .config import CPConfig


@dataclass(eq=False)
class CommCounter:
    """Counts communication operations issued through these groups (tests read it; cheap enough to keep on).

    Keys are operation kinds such as ``"ring_kv"`` (one K/V rotation) and ``"ring_dkv"`` (one dK/dV hop)."""

    counts: Counter = field(default_factory=Counter)

    def record(self, kind: str, n: int = 1) -> None:
        self.counts[kind] += n

    def reset(self) -> None:
        self.counts.clear()


@dataclass(frozen=True, eq=False)
class CPGroups:
    """The context-parallel group of this rank, made by :func:`build_cp_groups` for one :class:`CPConfig`."""

    config: CPConfig
    """The configuration these groups were built for; ``cp_attention`` refuses any other."""
    group: dist.ProcessGroup | None
    """The context-parallel process group; ``None`` only when torch.distributed is not initialized (size 1)."""
    rank: int
    """This process's rank within ``group``."""
    size: int
    """Number of ranks P that share one sequence."""
    device_types: frozenset[str]
    """Device types (``"cpu"``, ``"cuda"``, ...) whose tensors the group's backend can send."""
    counter: CommCounter = field(default_factory=CommCounter)
    """Communication counts, for tests and diagnostics."""


def _device_types(group: dist.ProcessGroup) -> frozenset[str]:
    """Device types whose tensors ``group`` can send point to point, from its backend config
    (e.g. ``"cpu:gloo,cuda:nccl"``). gloo moves host memory only, so it never serves CUDA tensors here."""
    pairs = (item.split(":") for item in dist.get_backend_config(group).lower().split(","))
    return frozenset(dev for dev, backend in pairs if backend != "gloo" or dev == "cpu")


def build_cp_groups(config: CPConfig, group: dist.ProcessGroup | None = None) -> CPGroups:
    """Groups for ``config`` over ``group`` (``None``: the default group, or a single process when
    torch.distributed is not initialized). Call it on every rank of ``group``; it does not communicate."""
    if not isinstance(config, CPConfig):
        raise TypeError(f"config must be a ctx_plugin.CPConfig, got {type(config).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized; "
                             "call torch.distributed.init_process_group first")
        return CPGroups(config=config, group=None, rank=0, size=1, device_types=frozenset())
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given process group; call build_cp_groups with a "
                         "group that contains it (every rank passes its own context-parallel group)")
    return CPGroups(config=config, group=group, rank=rank, size=dist.get_world_size(group),
                    device_types=_device_types(group))
