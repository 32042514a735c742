"""Checks made when a job starts, before ``srun``, that would otherwise waste the allocation: the rendezvous
host (the job's first node, where the batch script runs) resolves, and the master port is free there (else the
next free one; it is written into ``command.sh``, so every node uses the same)."""
from __future__ import annotations

import socket

from .records import node_list

PORT_TRIES = 200


def check_rendezvous(env) -> str:
    """The rendezvous host, checked to resolve (``ValueError`` naming the fix otherwise)."""
    nodes = node_list(env)
    if not nodes:
        raise ValueError("SLURM_JOB_NODELIST is empty: the job has no node list to take the rendezvous host from")
    host = nodes[0]
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise ValueError(f"the rendezvous host {host} (the job's first node) does not resolve on "
                         f"{socket.gethostname()} ({e.strerror}): the node names SLURM uses must resolve on every "
                         f"node (DNS or /etc/hosts)") from None
    return host


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as torchrun's store binds
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port(port: int) -> int:
    """``port`` if nothing listens on it here, else the next free one above it (``OSError`` if none)."""
    for candidate in range(port, port + PORT_TRIES):
        wrapped = 1024 + (candidate - 1024) % (65536 - 1024)
        if port_free(wrapped):
            return wrapped
    raise OSError(f"no free port among {PORT_TRIES} from {port}: give --master-port")
