"""Communication primitives, each on an explicit :class:`RankGroup` and counted in a :class:`CommCounter`.

torch.distributed moves the data, unless the group has a ``transport`` (the benchmark's simulated ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import CommCounter, RankGroup


class Exchange:
    """In-flight send/recv requests; ``wait()`` completes them (idempotent)."""

    def __init__(self, requests: list) -> None:
        self._requests = requests

    def wait(self) -> None:
        requests, self._requests = self._requests, []
        for req in requests:
            req.wait()


class RingComm:
    """Sends to rank ``r+1`` and receives from rank ``r−1`` of a group, counting each exchange.

    Use as a context manager: on exit every posted request is completed, also when an exception unwinds the
    ring (a request dropped without ``wait()`` makes the next collective hang on every rank)."""

    def __init__(self, group: RankGroup, counter: CommCounter) -> None:
        self.group, self.counter = group, counter
        self.send_to = (group.rank + 1) % group.size
        self.recv_from = (group.rank - 1) % group.size
        self._pending: list[Exchange] = []

    def start(self, send: torch.Tensor, recv: torch.Tensor, kind: str, tag: int = 0) -> Exchange:
        """Posts ``send`` → next rank and ``recv`` ← previous rank as one batch; returns without waiting.

        ``tag`` keeps different streams of messages apart on backends that match by tag (gloo)."""
        pg, transport = self.group.group, self.group.transport
        if transport is not None:
            exchange = Exchange([transport.exchange(self.group, send, recv, self.send_to, self.recv_from, tag)])
        else:
            ops = [dist.P2POp(dist.isend, send, group=pg, tag=tag, group_peer=self.send_to),
                   dist.P2POp(dist.irecv, recv, group=pg, tag=tag, group_peer=self.recv_from)]
            exchange = Exchange(dist.batch_isend_irecv(ops))
        self.counter.record(kind)
        self._pending.append(exchange)
        return exchange

    def __enter__(self) -> RingComm:
        return self

    def __exit__(self, *exc_info) -> None:
        pending, self._pending = self._pending, []
        for exchange in pending:
            exchange.wait()


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: RankGroup, counter: CommCounter) -> torch.Tensor:
    """``out[i]`` ← rank i's ``inp[this rank]`` (first dimension = group size); returns ``out``."""
    if group.transport is not None:
        group.transport.all_to_all(group, out, inp)
    else:
        dist.all_to_all_single(out, inp, group=group.group)
    counter.record("a2a")
    return out


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: RankGroup, counter: CommCounter,
               kind: str) -> torch.Tensor:
    """``out`` (contiguous, first dimension = group size) ← every rank's ``inp``, in rank order; returns ``out``."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.11 has only the old.
    if group.transport is not None:
        group.transport.all_gather(group, out, inp)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out.view(-1), inp.contiguous().view(-1), group=group.group)
    counter.record(kind)
    return out


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: RankGroup, counter: CommCounter,
                   kind: str) -> torch.Tensor:
    """``out`` (contiguous) ← the sum over ranks of ``inp[this rank]`` (first dimension of ``inp`` = group size)."""
    if group.transport is not None:
        group.transport.reduce_scatter(group, out, inp)
    else:
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor   # renamed in 2.13
        scatter(out.view(-1), inp.contiguous().view(-1), group=group.group)
    counter.record(kind)
    return out
