"""Recompute presets: a frozen config parsed from a short string, and the layer plan it implies.

Strings: ``none``, ``attn_out``, ``selective``, ``core_attn``, ``mlp``, ``full``, ``full:uniform:N``,
``full:block:N``, ``sqrt`` and ``budget:<GiB>`` (resolved against the memory model by
:func:`ctx_plugin.recompute.resolve`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..names import Recompute, parse_enum

_METHODS = ("uniform", "block")


@dataclass(frozen=True, kw_only=True)
class RecomputeConfig:
    """What to recompute in backward. Build it with :meth:`parse` or directly; checked on construction."""

    preset: Recompute = Recompute.NONE
    """The preset name (:class:`ctx_plugin.names.Recompute`)."""
    method: str | None = None
    """For ``full``: ``"uniform"`` (checkpoint groups of ``num_layers`` consecutive layers, storing only each
    group's input) or ``"block"`` (checkpoint the first ``num_layers`` layers, store the rest); Megatron's
    ``recompute_method``. ``None`` for other presets; plain ``full`` means uniform groups of 1."""
    num_layers: int | None = None
    """For ``full:<method>:N``: N (Megatron's ``recompute_num_layers``)."""
    budget_gib: float | None = None
    """For ``budget``: activation+model memory budget per GPU in GiB."""

    def __post_init__(self) -> None:
        preset = parse_enum(Recompute, self.preset, "recompute preset")
        object.__setattr__(self, "preset", preset)
        if preset == Recompute.FULL:
            if self.method is None and self.num_layers is None:
                object.__setattr__(self, "method", "uniform")
                object.__setattr__(self, "num_layers", 1)
            if self.method not in _METHODS:
                raise ValueError(f"full recompute method must be one of {_METHODS}, got {self.method!r}")
            if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
                raise ValueError(f"full:{self.method}:N needs a positive integer N, got {self.num_layers!r}")
        elif self.method is not None or self.num_layers is not None:
            raise ValueError(f"method/num_layers apply to the 'full' preset only, not {preset.value!r}")
        if preset == Recompute.BUDGET:
            if isinstance(self.budget_gib, bool) or not isinstance(self.budget_gib, (int, float)) \
                    or not math.isfinite(self.budget_gib) or self.budget_gib <= 0:
                raise ValueError(f"budget:<GiB> needs a positive number of GiB, got {self.budget_gib!r}")
        elif self.budget_gib is not None:
            raise ValueError(f"budget_gib applies to the 'budget' preset only, not {preset.value!r}")

    @classmethod
    def parse(cls, text: str) -> RecomputeConfig:
        """``"full:block:4"`` → ``RecomputeConfig(preset="full", method="block", num_layers=4)``, etc."""
        if isinstance(text, RecomputeConfig):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a recompute preset must be a string, got {type(text).__name__}")
        name, *params = text.strip().split(":")
        preset = parse_enum(Recompute, name, "recompute preset")
        usage = ("expected one of: none, attn_out, selective, core_attn, mlp, full, full:uniform:N, full:block:N, "
                 "sqrt, budget:<GiB>")
        if preset == Recompute.FULL and params:
            if len(params) != 2 or not params[1].isdigit():
                raise ValueError(f"bad recompute preset {text!r}: {usage}")
            return cls(preset=preset, method=params[0], num_layers=int(params[1]))
        if preset == Recompute.BUDGET:
            try:
                (budget,) = params
                gib = float(budget)
            except ValueError:
                raise ValueError(f"bad recompute preset {text!r}: {usage}") from None
            return cls(preset=preset, budget_gib=gib)
        if params:
            raise ValueError(f"bad recompute preset {text!r}: {usage}")
        return cls(preset=preset)

    def __str__(self) -> str:
        if self.preset == Recompute.FULL:
            return "full" if (self.method, self.num_layers) == ("uniform", 1) else \
                f"full:{self.method}:{self.num_layers}"
        if self.preset == Recompute.BUDGET:
            return f"budget:{self.budget_gib:g}"
        return self.preset.value


def regions(config: RecomputeConfig, num_layers: int) -> list[tuple[int, int]]:
    """The whole-layer checkpoint regions ``[start, stop)`` of a stack of ``num_layers`` layers (empty for
    presets that do not checkpoint whole layers)."""
    if config.preset == Recompute.SQRT:
        size = math.ceil(math.sqrt(num_layers))
        return [(i, min(i + size, num_layers)) for i in range(0, num_layers, size)]
    if config.preset != Recompute.FULL:
        return []
    if config.method == "block":
        return [(i, i + 1) for i in range(min(config.num_layers, num_layers))]
    return [(i, min(i + config.num_layers, num_layers)) for i in range(0, num_layers, config.num_layers)]


def candidates(num_layers: int) -> list[RecomputeConfig]:
    """The presets ``budget:<GiB>`` chooses among for a stack of ``num_layers`` layers.
    :func:`ctx_plugin.recompute.resolve` ranks them by the memory model's estimated extra FLOPs, not by this order;
    the list starts with the presets that recompute least where that estimate ties (``none``, ``attn_out``, then
    ``selective``, whose elementwise recompute it counts as free), the order the planner keeps for equal predicted
    times. ``core_attn`` is never a candidate: it repeats the attention's communication and saves nothing over
    ``none``."""
    fixed = [RecomputeConfig.parse(p) for p in ("none", "attn_out", "selective", "mlp")]
    blocks = [RecomputeConfig(preset="full", method="block", num_layers=n) for n in range(1, num_layers)]
    return fixed + blocks + [RecomputeConfig.parse("full"), RecomputeConfig.parse("sqrt")]
