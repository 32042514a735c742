"""Activation offload to host memory for whole-layer checkpoint regions (``+offload:<GiB>``, ``+offload_attn:<GiB>``).

What moves. Non-reentrant ``torch.utils.checkpoint`` keeps a region's positional tensor arguments for its
recomputation as autograd *saved tensors*, so they pass through any ``saved_tensors_hooks`` active around the
``checkpoint`` call (keyword arguments stay in a closure). :meth:`HostOffload.checkpoint` therefore calls the
region with its hidden states as the first positional argument (also when the layer takes them as
``hidden_states=``, as Megatron's block does) and wraps the call in hooks that move exactly that tensor to host
memory: nothing keeps the device tensor, gradients still flow to it through the forward graph, and the
recomputation in backward gets the tensor back through the hooks. With ``offload_attn`` the pinned attention's saved
tensors (q, k, v, out, LSE) and its remembered output (:class:`ctx_plugin.recompute.pinning.Recording`, the same
tensor as the saved ``out``: copied once) go the same way.

When. Each region's forward opens a *group* (its input plus, with ``offload_attn``, its attention tensors); groups
of one forward pass are chained in order. The first tensor of group *i* needed in backward (the region's input, when
its recomputation starts) starts the copies back of all of group *i* (if not already under way) and of group *i−1*:
region *i−1* is brought back while region *i* is recomputed and back-propagated (the last region, needed first, is
copied back when backward reaches it, not hidden). Host memory of an entry is released
when autograd releases the saved tensor (after the node that used it ran, unless ``retain_graph=True``; a second
backward copies it back again). A forward without autograd (eval, ``torch.no_grad``) checkpoints nothing and so
offloads nothing. Several forwards in flight before their backwards (pipeline schedules) each have their own groups.

How. CUDA tensors: a page-locked host buffer (:mod:`ctx_plugin.recompute.pinned`: of the copy's exact size from
64 MiB on, as torch's pinned allocator rounds to powers of two), the device-to-host copy on a side stream after it
waits for the producing stream, ``record_stream`` so the caching allocator reuses the device memory only once the
copy is done; copies back on a second side stream into memory the consuming stream then waits for (an event) and
records. CPU tensors: the
same path with plain host copies both ways (real copies and real accounting, no streams), so everything but the
overlap is tested on CPU. Overlap on a GPU is verified by ``tests/gpu/test_offload_gpu.py`` with
``torch.profiler``: the device-to-host copies of one region run on the side stream while the next region's kernels
run on the compute stream (their time intervals intersect), and the copies back of region *i−1* while region *i*
is recomputed.

Budget. ``offload_gib`` per rank, counted over the host copies alive at a time (all forwards in flight). Exceeding it
is a ValueError raised before the copy that would exceed it, at the same point on every rank (every CP rank holds
equal-sized shards), naming the bytes needed and the flag to raise.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from .pinned import PinnedPool, host_block
from .presets import gib_text

_ATTR = "_ctx_plugin_offload"
_GIB = 2 ** 30


def hidden_first(body: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """``(fn, args, kwargs)`` with ``fn(*args, **kwargs) == body(*args, **kwargs)`` and the hidden states first
    among ``args``, also for a layer called with ``hidden_states=`` only (Megatron's TransformerBlock).
    ``torch.utils.checkpoint`` saves and restores the device RNG state (dropout masks in the recomputation) of the
    devices of its *positional* tensor arguments only, and offload moves the first one."""
    if args or not isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return body, args, kwargs
    rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def run(hidden, **more):
        return body(hidden_states=hidden, **more)
    return run, (kwargs["hidden_states"],), rest


class _Group:
    """One region's forward run: its entries (weakly: an entry lives as long as autograd holds it) and the
    previous region of the same forward pass (weakly), brought back one region ahead in backward."""

    def __init__(self, prev: _Group | None) -> None:
        self.prev = None if prev is None else weakref.ref(prev)
        self.entries: list[weakref.ref] = []
        self.seen: list[tuple[weakref.ref, weakref.ref]] = []     # (device tensor, its entry): one copy per tensor
        self.fetched_for: int | None = None      # the backward (graph task) that last started its copies back

    def live(self) -> list[_Entry]:
        return [e for e in (r() for r in self.entries) if e is not None]


class _Entry:
    """A tensor held in host memory for backward (what the saved-tensor hooks pack)."""

    __slots__ = ("group", "host", "device", "ready", "handed", "target", "grad", "nbytes", "copied", "__weakref__")

    def __init__(self, group: _Group, host: torch.Tensor, target: torch.device, grad: bool, copied) -> None:
        self.group, self.host, self.target = group, host, target
        self.grad = grad                # whether the original required grad (a replayed output must, too)
        self.nbytes = host_block(host.numel() * host.element_size(), target.type)    # what the host holds
        self.copied = copied            # CUDA: event after the copy to host (None on CPU)
        self.device = self.ready = None     # a copy back under way, and its event
        self.handed = None              # weakref to the device tensor last handed to autograd


class HostOffload:
    """Host-memory offload of the checkpoint regions of one stack of layers (one :func:`ctx_plugin.recompute.apply`
    call): ``budget_gib`` per rank; ``attention`` also offloads the pinned attention tensors."""

    def __init__(self, budget_gib: float, *, attention: bool, flag: str) -> None:
        self.budget = int(budget_gib * _GIB)
        self.attention, self.flag = attention, flag
        self.held_bytes = 0
        """Bytes of host memory held now (the copies autograd still needs)."""
        self.peak_bytes = 0
        """The most ``held_bytes`` has been."""
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._pinned: PinnedPool | None = None   # exact-size page-locked buffers for large CUDA copies
        self._chain: set[int] = set()            # regions of the forward pass under way
        self._last: weakref.ref | None = None    # its latest group

    @classmethod
    def from_config(cls, config) -> HostOffload | None:
        """The offload a :class:`~ctx_plugin.recompute.RecomputeConfig` asks for (``None`` without ``+offload`` or
        ``+offload_attn``)."""
        if config.offload_gib is None:
            return None
        name = "offload_attn" if config.offload_attention else "offload"
        return cls(config.offload_gib, attention=config.offload_attention, flag=f"+{name}:{gib_text(config.offload_gib)}")

    # ---- forward ------------------------------------------------------------------------------------------------
    def checkpoint(self, region, body: Callable, contexts: Callable, args: tuple, kwargs: dict):
        """``torch.utils.checkpoint(body, *args, **kwargs)`` of ``region`` with its hidden states (the first
        positional argument, else ``hidden_states=``) offloaded; ``contexts(hooks)`` builds the checkpoint's
        context managers, ``hooks`` being the saved-tensor hooks for the pinned attention (``None``: kept)."""
        run, args, kwargs = hidden_first(body, args, kwargs)
        outer, hooks = self.hooks(region, args[0] if args else None)
        with outer:
            return checkpoint(run, *args, use_reentrant=False, context_fn=lambda: contexts(hooks), **kwargs)

    def hooks(self, region, hidden) -> tuple[torch.autograd.graph.saved_tensors_hooks, tuple | None]:
        """For one forward run of ``region`` with input ``hidden``: the saved-tensor hooks to enter around its
        checkpoint (they move ``hidden`` to host memory when the checkpoint saves it) and those for its pinned
        attention (``None`` without ``offload_attn``). A new group of this forward pass."""
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"{self.flag} offloads a region's hidden states: the layer's first argument (or "
                            f"hidden_states=) must be a tensor, got {type(hidden).__name__}")
        group = self._open(region)
        hooks = (lambda t: self.pack(group, t), self.unpack) if self.attention else None
        target = weakref.ref(hidden)        # autograd keeps the pack hook with what it packed: no strong reference

        def pack_input(t: torch.Tensor):
            return self.pack(group, t) if t is target() else t
        return torch.autograd.graph.saved_tensors_hooks(pack_input, self.unpack), hooks

    def _open(self, region) -> _Group:
        if id(region) in self._chain:            # this region ran already: a new forward pass begins
            self._chain.clear()
            self._last = None
        self._chain.add(id(region))
        group = _Group(None if self._last is None else self._last())
        self._last = weakref.ref(group)
        return group

    def pack(self, group: _Group, t: torch.Tensor) -> _Entry:
        """Copies ``t`` to host memory (asynchronously on CUDA) for ``group``; the budget is checked first."""
        for tensor, entry in group.seen:
            if tensor() is t and entry() is not None:
                return entry()
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"{self.flag}: activation offload supports CPU and CUDA tensors, got one on {t.device}; "
                             "drop the modifier")
        nbytes = host_block(t.numel() * t.element_size(), t.device.type)
        if self.held_bytes + nbytes > self.budget:
            need = self.held_bytes + nbytes
            name, _ = self.flag[1:].split(":")
            pinned = " (copies under 64 MiB in torch's pinned blocks, powers of two)" if t.device.type == "cuda" else ""
            raise ValueError(f"{self.flag}: offloading needs at least {need} bytes ({need / _GIB:.3g} GiB) of host "
                             f"memory on this rank ({self.held_bytes} held + {nbytes} for the next tensor)"
                             f"{pinned}, over the budget of {self.budget} bytes; raise it, e.g. +{name}:{_suggest(need)}, or offload "
                             "less (+offload instead of +offload_attn, fewer regions with full:uniform:N or sqrt)")
        host, copied = self._to_host(t)
        entry = _Entry(group, host, t.device, t.requires_grad, copied)
        self.held_bytes += entry.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        weakref.finalize(entry, self._release, entry.nbytes, host.untyped_storage().data_ptr())
        group.entries.append(weakref.ref(entry))
        group.seen.append((weakref.ref(t), weakref.ref(entry)))
        return entry

    def _release(self, nbytes: int, ptr: int) -> None:
        self.held_bytes -= nbytes
        if self._pinned is not None:
            self._pinned.give_back(ptr)

    def _stream(self, device: torch.device, direction: str) -> torch.cuda.Stream:
        key = (device, direction)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    @torch.no_grad()
    def _to_host(self, t: torch.Tensor):
        if t.device.type == "cpu":
            host = torch.empty(t.shape, dtype=t.dtype)
            host.copy_(t)
            return host, None
        side = self._stream(t.device, "d2h")
        side.wait_stream(torch.cuda.current_stream(t.device))      # t is written by now
        if self._pinned is None:
            self._pinned = PinnedPool()
        host = self._pinned.empty(t.shape, t.dtype)
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            copied = side.record_event()
        t.record_stream(side)               # its memory is reused only once the copy is done
        return host, copied

    # ---- backward -----------------------------------------------------------------------------------------------
    def unpack(self, entry):
        """A saved tensor back on its device: starts this region's and the previous region's copies back (once per
        backward), waits for this one."""
        if not isinstance(entry, _Entry):
            return entry
        task = torch._C._current_graph_task_id()
        group = entry.group
        prev = None if group.prev is None else group.prev()
        for g in (group, prev):
            if g is not None and (g.fetched_for != task or task == -1):
                g.fetched_for = task
                for e in g.live():
                    self._fetch(e)
        return self._take(entry)

    @torch.no_grad()
    def _fetch(self, entry: _Entry) -> None:
        if entry.device is not None or (entry.handed is not None and entry.handed() is not None):
            return                          # under way, or the tensor handed out is still in use
        if entry.target.type == "cpu":
            entry.device = torch.empty(entry.host.shape, dtype=entry.host.dtype)
            entry.device.copy_(entry.host)
            return
        side = self._stream(entry.target, "h2d")
        side.wait_event(entry.copied)       # the host copy is complete
        with torch.cuda.stream(side):
            entry.device = torch.empty(entry.host.shape, dtype=entry.host.dtype, device=entry.target)
            entry.device.copy_(entry.host, non_blocking=True)
            entry.ready = side.record_event()

    def _take(self, entry: _Entry) -> torch.Tensor:
        handed = None if entry.handed is None else entry.handed()
        if handed is not None:              # the same saved tensor, unpacked twice while in use
            return handed
        self._fetch(entry)
        out, ready = entry.device, entry.ready
        entry.device = entry.ready = None
        if ready is not None:
            stream = torch.cuda.current_stream(out.device)
            stream.wait_event(ready)
            out.record_stream(stream)
        if entry.grad:                      # a fresh leaf: what the recomputation builds on it is discarded
            out.requires_grad_(True)
        entry.handed = weakref.ref(out)
        return out


def _suggest(nbytes: int) -> str:
    gib = nbytes / _GIB
    return f"{math.ceil(gib * 2) / 2:g}" if gib >= 1 else f"{math.ceil(gib * 1000) / 1000:g}"


def attach(layers: Sequence[torch.nn.Module], offload: HostOffload | None) -> None:
    """Remembers ``offload`` on ``layers`` (read back by :func:`host_offload`; :func:`detach` forgets it)."""
    for layer in layers:
        if offload is not None:
            setattr(layer, _ATTR, offload)


def detach(layer: torch.nn.Module) -> None:
    if hasattr(layer, _ATTR):
        delattr(layer, _ATTR)


def host_offload(layers: Sequence[torch.nn.Module]) -> HostOffload | None:
    """The :class:`HostOffload` that :func:`ctx_plugin.recompute.apply` set up for ``layers`` (``None`` without
    ``+offload``/``+offload_attn``): ``held_bytes`` and ``peak_bytes`` say how much host memory it uses."""
    found = {id(o): o for o in (getattr(layer, _ATTR, None) for layer in layers) if o is not None}
    if len(found) > 1:
        raise ValueError("these layers were given to more than one ctx_plugin.recompute.apply call; ask per stack")
    return next(iter(found.values()), None)
