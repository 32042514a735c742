"""``CPConfig``: what context-parallel attention to run (the algorithm, not the process groups)."""
from __future__ import annotations

from dataclasses import dataclass

from .names import Backend, Kernel, parse_enum


@dataclass(frozen=True, kw_only=True)
class CPConfig:
    """Context-parallel attention settings. Keyword-only, frozen, checked on construction."""

    backend: Backend = Backend.ZIGZAG
    """Algorithm and token layout: one of :class:`ctx_plugin.names.Backend` (``ring``, ``zigzag``, ``striped``).
    ``zigzag`` (the default) balances causal work across ranks and is the layout Megatron-LM assumes."""

    kernel: Kernel = Kernel.AUTO
    """Local attention kernel: ``auto`` (fastest available for the device, dtype and head size), ``torch``,
    ``sdpa_cudnn``, ``sdpa_flash`` or ``flash_attn``. An explicit kernel that cannot run is an error."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "backend", parse_enum(Backend, self.backend, "backend"))
        object.__setattr__(self, "kernel", parse_enum(Kernel, self.kernel, "kernel"))
