"""Simulated ranks: an N-rank context-parallel group inside one process, running the real ``cp_attention``.

Each simulated rank gets :class:`~ctx_plugin.core.groups.CPGroups` whose groups' process group is a
:class:`SimulatedGroup` (a :class:`ctx_plugin.core.comm.Transport`: it moves the data itself) instead of a
torch.distributed one, laid out exactly as :func:`~ctx_plugin.build_cp_groups` lays them out (Ulysses
groups of ``ulysses_size`` consecutive ranks, ring groups of every ``ulysses_size``-th rank). Two data movers:

- :class:`ThreadedWorld` moves the data: the N ranks run in N threads and exchange tensors through mailboxes and
  barriers, so every rank computes exactly what it computes in a distributed run (tests check this);
- :data:`SILENT` moves nothing: one rank runs alone, with the same plan, kernels and merges, and its receive
  buffers keep whatever they hold (for the memory and profile measurements, which count a rank's own copies);
- :data:`FILLING` is :data:`SILENT` whose receive buffers get this rank's own send buffers (a local device copy
  on the compute stream, of the size a peer's data would have), so the kernels compute on real values: on a GPU,
  uninitialised memory (zeros, denormals, NaN) runs matrix products at other speeds than trained data. The
  one-GPU benchmark times ranks with it; it includes no transfer time, contention or rank-agreement check.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

import torch

from ..core.config import CPConfig
from ..core.groups import ALONE, CPGroups, RankGroup
from ..core.rules import SettingNames, check_ulysses_size
from ..names import Backend

TIMEOUT_S = 120.0
"""A simulated rank waiting longer than this for its peers raises instead of hanging (a peer failed)."""
POLL_S = 0.05
"""How often a rank waiting for a message checks whether a peer failed (:meth:`ThreadedWorld.abort`)."""


class _Done:
    def wait(self) -> None:
        pass


class Silent:
    """A data mover that moves nothing (see the module docstring)."""

    def exchange(self, group, send, recv, send_to, recv_from, tag):
        return _Done()

    def all_to_all(self, group, out, inp) -> None:
        pass

    def all_gather(self, group, out, inp) -> None:
        pass

    def reduce_scatter(self, group, out, inp) -> None:
        pass


SILENT = Silent()


class Filling(Silent):
    """A data mover that moves nothing between ranks but fills every receive buffer from this rank's own send
    buffer (see the module docstring); a reduce-scatter's output gets this rank's own share."""

    def exchange(self, group, send, recv, send_to, recv_from, tag):
        _fill(recv, send)
        return _Done()

    def all_to_all(self, group, out, inp) -> None:
        for i in range(len(out)):
            _fill(out[i], inp[i])

    def all_gather(self, group, out, inp) -> None:
        for i in range(len(out)):
            _fill(out[i], inp)

    def reduce_scatter(self, group, out, inp) -> None:
        _fill(out, inp[group.rank])


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() == src.numel():
        dst.copy_(src.reshape(dst.shape))
    else:                                   # a receive of another size than the send (uneven shards)
        dst.copy_(src.flatten().repeat(-(-dst.numel() // max(src.numel(), 1)))[:dst.numel()].view(dst.shape))


FILLING = Filling()


class _Receive:
    def __init__(self, world: ThreadedWorld, box: queue.Queue, recv: torch.Tensor) -> None:
        self.world, self.box, self.recv = world, box, recv

    def wait(self) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                self.recv.copy_(self.box.get(timeout=POLL_S))
                return
            except queue.Empty:
                if self.world.aborted:
                    raise RuntimeError("a simulated peer rank failed while this rank waited for its data") from None
                if time.monotonic() > deadline:
                    raise


class ThreadedWorld:
    """Mailboxes and barriers for ``size`` simulated ranks in threads; ``groups(config, rank)`` builds a rank's
    CPGroups. Collectives sum in rank order (torch.distributed backends may add in another order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._boxes: dict = defaultdict(queue.Queue)      # (members, dst, src, tag) → tensors in send order
        self._barriers: dict = {}                          # members → Barrier
        self._deposits: dict = defaultdict(dict)           # members → {rank: tensor} of the current collective
        self.aborted = False

    def _barrier(self, members: tuple[int, ...]) -> threading.Barrier:
        with self._lock:
            barrier = self._barriers.setdefault(members, threading.Barrier(len(members), timeout=TIMEOUT_S))
            if self.aborted:            # created after a rank failed: broken too
                barrier.abort()
            return barrier

    def abort(self) -> None:
        """Breaks every barrier, those created later included, and every wait for a message (a rank failed: its
        peers raise at once instead of waiting :data:`TIMEOUT_S`)."""
        with self._lock:
            self.aborted = True
            for barrier in self._barriers.values():
                barrier.abort()

    def _box(self, key) -> queue.Queue:
        with self._lock:
            return self._boxes[key]

    def exchange(self, group, send, recv, send_to, recv_from, tag):
        members = group.members
        self._box((members, send_to, group.rank, tag)).put(send.clone())
        return _Receive(self, self._box((members, group.rank, recv_from, tag)), recv)

    def _collective(self, group, inp: torch.Tensor) -> list[torch.Tensor]:
        """Every member's ``inp``, in group rank order."""
        barrier = self._barrier(group.members)
        self._deposits[group.members][group.rank] = inp.clone()
        barrier.wait()
        everyone = [self._deposits[group.members][r] for r in range(group.size)]
        barrier.wait()                                     # nobody deposits the next collective before all read
        return everyone

    def all_to_all(self, group, out, inp) -> None:
        for i, theirs in enumerate(self._collective(group, inp)):
            out[i].copy_(theirs[group.rank])

    def all_gather(self, group, out, inp) -> None:
        for i, theirs in enumerate(self._collective(group, inp)):
            out[i].copy_(theirs.view(out[i].shape))

    def reduce_scatter(self, group, out, inp) -> None:
        parts = self._collective(group, inp)
        total = parts[0][group.rank].clone()
        for theirs in parts[1:]:
            total += theirs[group.rank]
        out.copy_(total.view(out.shape))


class SimulatedGroup:
    """The process group of one simulated rank (``RankGroup.group``): its members' world ranks (for the
    mailboxes), its rank among them, and the data mover (:data:`SILENT` or a :class:`ThreadedWorld`).
    Implements :class:`ctx_plugin.core.comm.Transport`."""

    def __init__(self, members: tuple[int, ...], rank: int, mover) -> None:
        self.members, self.rank, self.size, self.mover = members, rank, len(members), mover

    def exchange(self, send, recv, send_to: int, recv_from: int, tag: int):
        return self.mover.exchange(self, send, recv, send_to, recv_from, tag)

    def all_to_all(self, out, inp) -> None:
        self.mover.all_to_all(self, out, inp)

    def all_gather(self, out, inp) -> None:
        self.mover.all_gather(self, out, inp)

    def reduce_scatter(self, out, inp) -> None:
        self.mover.reduce_scatter(self, out, inp)


def _group(members: tuple[int, ...], rank: int, mover) -> RankGroup:
    return RankGroup(group=SimulatedGroup(members, rank, mover), rank=rank, size=len(members))


def simulated_groups(config: CPConfig, rank: int, size: int, mover, device_type: str) -> CPGroups:
    """Rank ``rank`` of a simulated group of ``size`` ranks, grouped as ``build_cp_groups`` groups real ranks;
    ``mover``: :data:`SILENT` or a :class:`ThreadedWorld`."""
    check_ulysses_size(config, size, SettingNames(cp="simulated size"))
    everyone = tuple(range(size))
    cp = _group(everyone, rank, mover)
    if config.backend == Backend.ULYSSES:
        ulysses, ring = cp, ALONE
    elif config.ulysses_size == 1:
        ulysses, ring = ALONE, cp
    elif config.ulysses_size == size:
        ulysses, ring = cp, ALONE
    else:
        u = config.ulysses_size
        outer, inner = divmod(rank, u)
        ulysses = _group(everyone[outer * u:(outer + 1) * u], inner, mover)
        ring = _group(everyone[inner::u], outer, mover)
    return CPGroups(config=config, cp=cp, ulysses=ulysses, ring=ring, device_types=frozenset({device_type}))


def run_threaded(size: int, fn) -> list:
    """Runs ``fn(rank, world)`` for every simulated rank in its own thread; returns the results in rank order
    (re-raising the first failure after breaking the other ranks' waits)."""
    world = ThreadedWorld(size)
    results, errors = [None] * size, []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, world)
        except BaseException as e:      # noqa: BLE001 - handed to the caller below
            errors.append(e)
            world.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
