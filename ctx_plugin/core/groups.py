"""Process groups for context parallelism, built once and passed explicitly to every call.

Topology only: communication observers live in :mod:`ctx_plugin.core.comm` (counters in :mod:`ctx_plugin.bench`),
the recompute record/replay state in :mod:`ctx_plugin.recompute.pinning`, the kernel choice in
:mod:`ctx_plugin.core.kernels`, simulated ranks in :mod:`ctx_plugin.bench.simulated`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..names import Backend
from .config import CPConfig
from .rules import check_ulysses_size

if TYPE_CHECKING:
    from .comm import Transport


@dataclass(frozen=True, eq=False)
class RankGroup:
    """One process group as the collectives see it: the group, this process's rank in it, its size."""

    group: dist.ProcessGroup | Transport | None
    """The process group: a ``torch.distributed.ProcessGroup``, ``None`` for a group of one process that never
    communicates, or a simulated group that moves the data itself (:class:`ctx_plugin.core.comm.Transport`: the
    benchmark's simulated ranks, :mod:`ctx_plugin.bench.simulated`, which run a group's ranks in one process)."""
    rank: int
    size: int


ALONE = RankGroup(group=None, rank=0, size=1)
"""The trivial group: the axis a backend does not use (e.g. the Ulysses axis of the plain ring)."""


@dataclass(frozen=True, eq=False)
class CPGroups:
    """The context-parallel groups of this rank, made by :func:`build_cp_groups` for one :class:`CPConfig`."""

    config: CPConfig
    """The configuration these groups were built for; ``cp_attention`` refuses any other."""
    cp: RankGroup
    """All P ranks that share one sequence."""
    ulysses: RankGroup
    """The all-to-all axis: the whole group for ``ulysses``, ``ulysses_size`` consecutive ranks for the hybrid,
    trivial otherwise."""
    ring: RankGroup
    """The ring (or all-gather) axis: the whole group for ring backends and ``allgather``, every
    ``ulysses_size``-th rank for the hybrid, trivial for ``ulysses``."""
    device_types: frozenset[str]
    """Device types (``"cpu"``, ``"cuda"``, ...) whose tensors the groups' backend can send."""
    check_group: dist.ProcessGroup | None = None
    """A CPU-side (gloo) group over the same ranks as ``cp`` for the rank-agreement check
    (:mod:`ctx_plugin.core.agreement`, ``CPConfig.check_ranks``): ``cp``'s own group when its backend serves CPU
    tensors, else a gloo group :func:`build_cp_groups` created. ``None`` (no check) for one rank, simulated
    ranks, or ``check_ranks=False``."""

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.cp.group

    @property
    def rank(self) -> int:
        return self.cp.rank

    @property
    def size(self) -> int:
        return self.cp.size


def _device_types(group: dist.ProcessGroup) -> frozenset[str]:
    """Device types whose tensors ``group`` can send point to point, from its backend config
    (e.g. ``"cpu:gloo,cuda:nccl"``). gloo moves host memory only, so it never serves CUDA tensors here."""
    pairs = (item.split(":") for item in dist.get_backend_config(group).lower().split(","))
    return frozenset(dev for dev, backend in pairs if backend != "gloo" or dev == "cpu")


def _split(cp: RankGroup, ulysses_size: int) -> tuple[RankGroup, RankGroup]:
    """Ulysses groups of ``ulysses_size`` consecutive ranks and ring groups of every ``ulysses_size``-th rank.

    Each rank creates only the two groups it belongs to (``use_local_synchronization``), so this works for a
    context-parallel group that is a subgroup of the world."""
    if ulysses_size == 1:
        return ALONE, cp
    if ulysses_size == cp.size:
        return cp, ALONE
    members = dist.get_process_group_ranks(cp.group)
    outer, inner = divmod(cp.rank, ulysses_size)
    inner_ranks = members[outer * ulysses_size:(outer + 1) * ulysses_size]
    outer_ranks = members[inner::ulysses_size]
    inner_group = dist.new_group(inner_ranks, use_local_synchronization=True)
    outer_group = dist.new_group(outer_ranks, use_local_synchronization=True)
    return RankGroup(inner_group, inner, ulysses_size), RankGroup(outer_group, outer, cp.size // ulysses_size)


def build_cp_groups(config: CPConfig, group: dist.ProcessGroup | None = None) -> CPGroups:
    """Groups for ``config`` over ``group`` (``None``: the default group, or a single process when
    torch.distributed is not initialized). Call it on every rank of ``group``. It communicates (a collective over
    ``group``) to create subgroups: the Ulysses and ring subgroups for ``ulysses_ring``, and, when
    ``config.check_ranks`` is set and ``group``'s backend cannot send CPU tensors (NCCL), a gloo group over the
    same ranks for the rank-agreement check. Before those, the ranks compare the fields that decide which groups
    they create (backend, ulysses_size, check_ranks; one small all-gather over ``group`` when it has more than one
    rank): ranks given different ones all raise the same ``ValueError`` instead of waiting on each other."""
    if not isinstance(config, CPConfig):
        raise TypeError(f"config must be a ctx_plugin.CPConfig, got {type(config).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialized; "
                             "call torch.distributed.init_process_group first")
        cp, device_types = ALONE, frozenset()
    else:
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group; call build_cp_groups with "
                             "a group that contains it (every rank passes its own context-parallel group)")
        cp, device_types = RankGroup(group, rank, dist.get_world_size(group)), _device_types(group)
        _agree(config, cp, device_types)
    check_ulysses_size(config, cp.size)
    u = config.ulysses_size
    if config.backend == Backend.ULYSSES:
        ulysses, ring = cp, ALONE
    else:
        ulysses, ring = _split(cp, u)
    return CPGroups(config=config, cp=cp, ulysses=ulysses, ring=ring, device_types=device_types,
                    check_group=_check_group(cp, device_types) if config.check_ranks else None)


_GROUP_FIELDS = ("backend", "ulysses_size", "check_ranks")
"""What decides which subgroups a rank creates (ranks creating different ones would wait on each other)."""


def _agree(config: CPConfig, cp: RankGroup, device_types: frozenset[str]) -> None:
    """The same ``ValueError`` on every rank of ``cp`` when they were given configs that would build different
    groups, before any subgroup is created (one all-gather of three ints over ``cp``: on the host where its
    backend moves CPU tensors, else on the current CUDA device)."""
    from .agreement import _ranks

    if cp.size == 1:
        return
    backends = list(Backend)
    mine = [backends.index(config.backend), config.ulysses_size, int(config.check_ranks)]
    device = "cpu" if "cpu" in device_types or not torch.cuda.is_available() else torch.cuda.current_device()
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    every = [torch.empty_like(local) for _ in range(cp.size)]
    dist.all_gather(every, local, group=cp.group)
    rows = [t.tolist() for t in every]
    if all(row == rows[0] for row in rows):
        return
    shown = [(backends[b].value, u, bool(c)) for b, u, c in rows]
    lines = []
    for i, name in enumerate(_GROUP_FIELDS):
        values: dict[str, list[int]] = {}
        for rank, row in enumerate(shown):
            values.setdefault(str(row[i]), []).append(rank)
        if len(values) > 1:
            lines.append(f"{name}: " + "; ".join(f"{_ranks(r)}: {v}" for v, r in values.items()))
    raise ValueError("build_cp_groups: the ranks of the context-parallel group were given configs that build "
                     "different groups (" + " | ".join(lines) + "); pass the same CPConfig on every rank")


def _check_group(cp: RankGroup, device_types: frozenset[str]) -> dist.ProcessGroup | None:
    """The CPU-side group the rank-agreement check all-reduces on (see :attr:`CPGroups.check_group`)."""
    if cp.size == 1:
        return None
    if "cpu" in device_types:
        return cp.group
    return dist.new_group(dist.get_process_group_ranks(cp.group), backend="gloo", use_local_synchronization=True)
