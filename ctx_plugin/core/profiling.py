"""Named profiler ranges around the attention's parts: what ``ctx-plugin bench --profile``
(:mod:`ctx_plugin.bench.profile`) attributes time by, and what any torch.profiler trace of a run shows.

``with span(Part.KERNEL):`` records a ``ctx_plugin::kernel`` range (``torch.profiler.record_function``) while a torch
profiler runs, so every op inside it (and, through the profiler's CPU→device correlation, every device kernel those
ops launch) belongs to that part. With no profiler running it returns one shared no-op context: no dispatcher call,
about 0.1 µs a range (measured in BENCHMARKS.md).
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd import _profiler_enabled

from ..names import Part

PREFIX = "ctx_plugin::"
"""What every range name starts with: ``ctx_plugin::kernel``, ``ctx_plugin::merge``."""
RANGES = {f"{PREFIX}{part.value}": part for part in (Part.KERNEL, Part.MERGE, Part.COPIES)}
"""Range name → the part it marks."""
_NAMES = {part: name for name, part in RANGES.items()}
_OFF = contextlib.nullcontext()


def span(part: Part):
    """A context that marks what runs inside it as ``part`` in a torch profiler's trace (a no-op without one)."""
    return torch.profiler.record_function(_NAMES[part]) if _profiler_enabled() else _OFF
