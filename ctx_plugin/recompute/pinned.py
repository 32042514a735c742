"""Page-locked host buffers of exact sizes for activation offload (:mod:`ctx_plugin.recompute.offload`).

torch's caching host allocator (``pin_memory=True``) rounds every block up to a power of two, so a 3.5 GiB region
input held in host memory takes 4 GiB and a 2.1 GiB one 4 GiB: up to twice the bytes, which decides how long a
sequence fits a node's host memory. Copies of at least :data:`REGISTER_MIN` bytes therefore go to plain host memory
page-locked with ``cudaHostRegister`` (their own mappings at that size, so no two share a page), kept by size and
handed to the next copy of that size (every step offloads the same sizes), and unregistered when the pool goes;
smaller copies use torch's allocator, where rounding costs little. A copy of a size no free buffer has (the shapes
changed: another sequence length or micro batch) first unregisters the free buffers, after the device finished the
copies queued so far, so the registered bytes stay those of the copies alive and the one being made, within the
offload budget, instead of growing with every new size.

Reuse is ordered by the streams: a buffer comes back to the pool when autograd releases the saved tensor it held,
after the node that consumed its copy back ran on the compute stream, which had waited for that copy; the next copy
into the buffer runs on the device-to-host stream after it waited for the compute stream.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch

REGISTER_MIN = 64 << 20
"""Copies of at least this many bytes get a registered buffer of their exact size."""


def host_block(nbytes: int, device: str) -> int:
    """Host bytes a copy of ``nbytes`` from ``device`` holds: on CUDA, an exact registered buffer from
    :data:`REGISTER_MIN` bytes on, below it a block of torch's caching host allocator, rounded up to a power of two
    (its default ``pinned_max_round_threshold``); on CPU the bytes themselves."""
    if device != "cuda" or nbytes <= 1 or nbytes >= REGISTER_MIN:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


class PinnedPool:
    """Registered host buffers by size. ``register(ptr, nbytes)`` / ``unregister(ptr)`` default to the CUDA
    runtime's ``cudaHostRegister`` / ``cudaHostUnregister`` (a test passes stand-ins)."""

    def __init__(self, register: Callable[[int, int], object] | None = None,
                 unregister: Callable[[int], object] | None = None,
                 synchronize: Callable[[], object] | None = None) -> None:
        if register is None or unregister is None:
            cudart = torch.cuda.cudart()
            register = register or (lambda ptr, nbytes: cudart.cudaHostRegister(ptr, nbytes, 0))
            unregister = unregister or cudart.cudaHostUnregister
        self._register, self._unregister = register, unregister
        self._synchronize = synchronize or torch.cuda.synchronize
        self._buffers: dict[int, torch.Tensor] = {}      # every registered buffer, by address
        self._free: dict[int, list[torch.Tensor]] = {}   # those not holding a copy now, by size
        weakref.finalize(self, _unregister_all, self._buffers, unregister)

    @property
    def registered_bytes(self) -> int:
        """Bytes of host memory registered (held by copies or kept for the next ones)."""
        return sum(b.numel() for b in self._buffers.values())

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A page-locked host tensor for a copy of ``shape``/``dtype``: a registered buffer of its exact size, or
        below :data:`REGISTER_MIN` bytes one of torch's pinned blocks."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes < REGISTER_MIN:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        free = self._free.get(nbytes)
        if free:
            return free.pop().view(dtype).view(shape)
        self._release_free()
        return self._new(nbytes).view(dtype).view(shape)

    def give_back(self, ptr: int) -> None:
        """The buffer at ``ptr`` (a host tensor's storage address) holds no copy any more; other addresses (torch's
        pinned blocks) are ignored."""
        buf = self._buffers.get(ptr)
        if buf is not None:
            self._free.setdefault(buf.numel(), []).append(buf)

    def _release_free(self) -> None:
        """Unregisters the buffers holding no copy (of sizes the new copy cannot use), once the device is done with
        every copy queued so far."""
        if not any(self._free.values()):
            return
        self._synchronize()
        for bufs in self._free.values():
            for buf in bufs:
                self._unregister(buf.data_ptr())
                del self._buffers[buf.data_ptr()]
        self._free.clear()

    def _new(self, nbytes: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        error = self._register(buf.data_ptr(), nbytes)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory for activation offload failed "
                               f"({error}); the host may be out of lockable memory (ulimit -l) or memory")
        self._buffers[buf.data_ptr()] = buf
        return buf


def _unregister_all(buffers: dict[int, torch.Tensor], unregister: Callable[[int], object]) -> None:
    for ptr in list(buffers):
        unregister(ptr)
    buffers.clear()
