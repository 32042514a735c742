"""Communication primitives, each on an explicit :class:`~ctx_plugin.core.groups.RankGroup`, reported to the active
observers.

The data moves through torch.distributed when the group's ``group`` is a ``torch.distributed.ProcessGroup``;
any other group object moves it itself (:class:`Transport`: the benchmark's simulated ranks,
:mod:`ctx_plugin.bench.simulated`).

Observers (e.g. :class:`ctx_plugin.bench.counting.CommCounter`) are context-scoped: ``with observing(obs):``
makes every operation issued in that context call ``obs.record(kind)``. Backward passes may run on autograd's
worker threads (CUDA), where the context is not set, so each autograd function captures
:func:`active_observers` at its forward and communicates with those in its backward: a backward is reported to
the observers that were active at its forward. Kinds: ``"ring_kv"`` (one K/V rotation), ``"ring_dkv"`` (one
dK/dV hop), ``"a2a"`` (one Ulysses all-to-all), ``"allgather_kv"``, ``"reduce_scatter_dkv"``,
``"gather_sequence"``, ``"reduce_scatter_grad"`` (its backward), ``"agree"`` (one rank-agreement check).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .groups import RankGroup


class Observer(Protocol):
    def record(self, kind: str) -> None:
        """Called once per communication operation of ``kind``."""
        ...


class Transport(Protocol):
    """A group object that moves the data itself instead of torch.distributed (it knows its rank and members)."""

    def exchange(self, send, recv, send_to: int, recv_from: int, tag: int):
        """Posts ``send`` → ``send_to`` and ``recv`` ← ``recv_from``; returns an object whose ``wait()``
        completes them."""
        ...

    def all_to_all(self, out, inp) -> None: ...

    def all_gather(self, out, inp) -> None: ...

    def reduce_scatter(self, out, inp) -> None: ...


_ACTIVE: ContextVar[tuple[Observer, ...]] = ContextVar("ctx_plugin_comm_observers", default=())


@dataclass(frozen=True)
class Observers:
    """The observers active when an operation (or an autograd function's forward) started."""

    members: tuple[Observer, ...] = ()

    def record(self, kind: str) -> None:
        for observer in self.members:
            observer.record(kind)


def active_observers() -> Observers:
    """The observers active in this context (capture them at a forward for its backward)."""
    return Observers(_ACTIVE.get())


@contextmanager
def observing(observer: Observer) -> Iterator[Observer]:
    """Reports every communication operation issued in this context (and the backwards of the forwards run in
    it) to ``observer`` too; yields it."""
    token = _ACTIVE.set((*_ACTIVE.get(), observer))
    try:
        yield observer
    finally:
        _ACTIVE.reset(token)


@contextmanager
def restored(observers: Observers) -> Iterator[None]:
    """Makes ``observers`` (captured earlier) the active ones again, e.g. while a checkpoint recomputes a forward
    on another thread or outside the context that ran it first."""
    token = _ACTIVE.set(observers.members)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _torch(group: RankGroup) -> bool:
    return isinstance(group.group, dist.ProcessGroup)


class Exchange:
    """In-flight send/recv requests; ``wait()`` completes them (idempotent)."""

    def __init__(self, requests: list) -> None:
        self._requests = requests

    def wait(self) -> None:
        requests, self._requests = self._requests, []
        for req in requests:
            req.wait()


class RingComm:
    """Sends to rank ``r+1`` and receives from rank ``r−1`` of a group, reporting each exchange to ``counter``
    (the :class:`Observers` captured at the forward).

    Use as a context manager: on exit every posted request is completed, also when an exception unwinds the
    ring (a request dropped without ``wait()`` makes the next collective hang on every rank)."""

    def __init__(self, group: RankGroup, counter: Observers) -> None:
        self.group, self.counter = group, counter
        self._pending: list[Exchange] = []

    def start(self, send: torch.Tensor | tuple[torch.Tensor, ...], recv: torch.Tensor, kind: str, tag: int = 0,
              shift: int = 1) -> Exchange:
        """Posts ``send`` → next rank and ``recv`` ← previous rank as one batch; returns without waiting.

        ``send`` may be a tuple of tensors (e.g. a rank's own K and V, not packed into one buffer first): they go
        as messages of the same batch, in order, into ``recv[0]``, ``recv[1]``, … (``recv``'s first dimension).
        ``tag`` keeps different streams of messages apart on backends that match by tag (gloo). ``shift``
        other than 1 exchanges with ranks further away: ``send`` → rank ``r + shift``, ``recv`` ← ``r − shift``
        (mod the group size; the ring's direct fetches and dK/dV's way home)."""
        pg, size, rank = self.group.group, self.group.size, self.group.rank
        send_to, recv_from = (rank + shift) % size, (rank - shift) % size
        pairs = list(zip(send, recv)) if isinstance(send, tuple) else [(send, recv)]
        if len(pairs) != (len(send) if isinstance(send, tuple) else 1):
            raise ValueError(f"{len(send)} tensors to send, room for {len(recv)}")
        if _torch(self.group):
            ops = [op for out, into in pairs
                   for op in (dist.P2POp(dist.isend, out, group=pg, tag=tag, group_peer=send_to),
                              dist.P2POp(dist.irecv, into, group=pg, tag=tag, group_peer=recv_from))]
            exchange = Exchange(dist.batch_isend_irecv(ops))
        else:
            exchange = Exchange([pg.exchange(out, into, send_to, recv_from, tag) for out, into in pairs])
        self.counter.record(kind)
        self._pending.append(exchange)
        return exchange

    def __enter__(self) -> RingComm:
        return self

    def __exit__(self, *exc_info) -> None:
        pending, self._pending = self._pending, []
        for exchange in pending:
            exchange.wait()


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: RankGroup, counter: Observers) -> torch.Tensor:
    """``out[i]`` ← rank i's ``inp[this rank]`` (first dimension = group size); returns ``out``."""
    if _torch(group):
        dist.all_to_all_single(out, inp, group=group.group)
    else:
        group.group.all_to_all(out, inp)
    counter.record("a2a")
    return out


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: RankGroup, counter: Observers,
               kind: str) -> torch.Tensor:
    """``out`` (contiguous, first dimension = group size) ← every rank's ``inp``, in rank order; returns ``out``."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has only the old.
    if _torch(group):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), inp.contiguous().view(-1), group=group.group)
    else:
        group.group.all_gather(out, inp)
    counter.record(kind)
    return out


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: RankGroup, counter: Observers,
                   kind: str) -> torch.Tensor:
    """``out`` (contiguous) ← the sum over ranks of ``inp[this rank]`` (first dimension of ``inp`` = group size)."""
    if _torch(group):
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # renamed in 2.13
        scatter(out.view(-1), inp.contiguous().view(-1), group=group.group)
    else:
        group.group.reduce_scatter(out, inp)
    counter.record(kind)
    return out
