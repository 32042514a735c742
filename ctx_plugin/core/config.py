"""``CPConfig``: what context-parallel attention to run (the algorithm, not the process groups)."""
from __future__ import annotations

from dataclasses import dataclass

from ..names import Backend, Kernel, parse_enum


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """Context-parallel attention settings. Keyword-only, frozen, checked on construction."""

    backend: Backend = Backend.ZIGZAG
    """Algorithm and token layout: one of :class:`ctx_plugin.names.Backend` (``ring``, ``zigzag``, ``striped``,
    ``ulysses``, ``ulysses_ring``, ``allgather``).
    ``zigzag`` (the default) balances causal work across ranks and is the layout Megatron-LM assumes."""

    kernel: Kernel = Kernel.AUTO
    """Local attention kernel: ``auto`` (fastest available for the device, dtype and head size), ``torch``,
    ``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_cpu`` or ``flash_attn`` (:class:`ctx_plugin.names.Kernel`). An explicit
    kernel that cannot run is an error."""

    ulysses_size: int = 1
    """For ``backend="ulysses_ring"``: ranks per Ulysses (all-to-all) group, meant to sit inside one node; the
    ring runs across the P / ulysses_size groups. Must divide the context-parallel size. Other backends take 1."""

    check_ranks: bool = True
    """Before each ``cp_attention`` and ``gather_sequence`` call communicates, the ranks of the group check that
    they are about to do the same thing (shapes, dtype, device, backend, causal, scale, kernel, ...) and raise one
    ``ValueError`` on every rank naming what differs, instead of hanging or computing garbage
    (:mod:`ctx_plugin.core.agreement`). It costs one all-reduce of four int64 on a CPU-side (gloo) group per call (its
    latency; on the host only, no GPU synchronisation: BENCHMARKS.md). Turn it off (``False``, on every rank)
    only when that latency matters more than a clear error, e.g. many small attention calls per step across
    nodes; for NCCL groups, off also skips creating the extra gloo group."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", parse_enum(Backend, self.backend, "backend"))
        object.__setattr__(self, "kernel", parse_enum(Kernel, self.kernel, "kernel"))
        if isinstance(self.ulysses_size, bool) or not isinstance(self.ulysses_size, int):
            raise TypeError(f"ulysses_size must be an int, got {type(self.ulysses_size).__name__}")
        if not isinstance(self.check_ranks, bool):
            raise TypeError(f"check_ranks must be a bool, got {type(self.check_ranks).__name__}")
        if self.ulysses_size < 1:
            raise ValueError(f"ulysses_size must be at least 1, got {self.ulysses_size}")
        if self.ulysses_size != 1 and self.backend != Backend.ULYSSES_RING:
            raise ValueError(f"ulysses_size={self.ulysses_size} applies to backend='ulysses_ring' only; use that "
                             f"backend for the 2-D hybrid, or leave ulysses_size at 1 for "
                             f"backend={self.backend.value!r}")
