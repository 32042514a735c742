"""The ring communicator: batched non-blocking exchange with the next and previous rank of a group."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import CPGroups


class Exchange:
    """In-flight send/recv requests; ``wait()`` completes them (idempotent)."""

    def __init__(self, requests: list) -> None:
        self._requests = requests

    def wait(self) -> None:
        requests, self._requests = self._requests, []
        for req in requests:
            req.wait()


class RingComm:
    """Sends to rank ``r+1`` and receives from rank ``r−1`` of ``groups.group``, counting each exchange."""

    def __init__(self, groups: CPGroups) -> None:
        self.groups = groups
        self.rank, self.size = groups.rank, groups.size
        self.send_to = (self.rank + 1) % self.size
        self.recv_from = (self.rank - 1) % self.size
        self._pending: list[Exchange] = []

    def start(self, send: torch.Tensor, recv: torch.Tensor, kind: str, tag: int = 0) -> Exchange:
        """Posts ``send`` → next rank and ``recv`` ← previous rank as one batch; returns without waiting.

        ``tag`` keeps different streams of messages apart on backends that match by tag (gloo)."""
        group = self.groups.group
        ops = [dist.P2POp(dist.isend, send, group=group, tag=tag, group_peer=self.send_to),
               dist.P2POp(dist.irecv, recv, group=group, tag=tag, group_peer=self.recv_from)]
        exchange = Exchange(dist.batch_isend_irecv(ops))
        self.groups.counter.record(kind)
        self._pending.append(exchange)
        return exchange

    def __enter__(self) -> RingComm:
        return self

    def __exit__(self, *exc_info) -> None:
        # Complete every posted request, also when an exception unwinds the ring: a request dropped without
        # wait() makes the next collective hang on every rank.
        pending, self._pending = self._pending, []
        for exchange in pending:
            exchange.wait()
