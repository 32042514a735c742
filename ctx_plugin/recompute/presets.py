"""Recompute presets: a frozen config parsed from a short string, and the layer plan it implies.

Strings: a preset — ``none``, ``attn_out``, ``selective``, ``core_attn``, ``mlp``, ``full``, ``full:uniform:N``,
``full:block:N``, ``sqrt`` or ``budget:<GiB>`` (resolved against the memory model by
:func:`ctx_plugin.recompute.resolve`) — followed by memory modifiers joined with ``+``
(:class:`ctx_plugin.names.Modifier`): ``tile_loss[:<tokens>]``, ``tile_mlp[:<tokens>]``, ``recompute_attn``,
``offload:<GiB>`` or ``offload_attn:<GiB>``; e.g. ``full+tile_mlp+tile_loss+offload_attn:96``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from ..names import Modifier, Recompute, parse_enum

_METHODS = ("uniform", "block")
_REGION_PRESETS = (Recompute.FULL, Recompute.SQRT)
_USAGE = ("expected a preset (none, attn_out, selective, core_attn, mlp, full, full:uniform:N, full:block:N, sqrt, "
          "budget:<GiB>) followed by any of +tile_loss[:<tokens>], +tile_mlp[:<tokens>], +recompute_attn, "
          "+offload:<GiB>, +offload_attn:<GiB>")


def _positive_int(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")


def _positive_gib(value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} needs a positive number of GiB, got {value!r}")


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
    tile_loss: bool = False
    """``+tile_loss``: the LM head and loss run over sequence chunks, each chunk's logits recomputed in backward."""
    loss_tokens: int | None = None
    """``+tile_loss:<tokens>``: tokens per loss chunk; ``None`` picks it from a memory target."""
    tile_mlp: bool = False
    """``+tile_mlp``: each layer's MLP and norms (and the final norm) run over sequence chunks, each recomputed in
    backward."""
    mlp_tokens: int | None = None
    """``+tile_mlp:<tokens>``: tokens per MLP chunk; ``None`` picks it automatically."""
    recompute_attention: bool = False
    """``+recompute_attn`` (``full``/``sqrt`` only): the attention is re-run with its region in backward."""
    offload_gib: float | None = None
    """``+offload:<GiB>`` / ``+offload_attn:<GiB>`` (``full``/``sqrt`` only): region inputs go to host memory, at
    most this many GiB per rank."""
    offload_attention: bool = False
    """``+offload_attn:<GiB>``: the pinned attention tensors go to host memory too."""

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
        self._check_modifiers(preset)

    def _check_modifiers(self, preset: Recompute) -> None:
        for flag in ("tile_loss", "tile_mlp", "recompute_attention", "offload_attention"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        for tokens, flag in (("loss_tokens", "tile_loss"), ("mlp_tokens", "tile_mlp")):
            if getattr(self, tokens) is not None:
                if not getattr(self, flag):
                    raise ValueError(f"{tokens} applies with {flag}=True only")
                _positive_int(getattr(self, tokens), f"+{flag}:<tokens>")
        region_only = [name for name, on in (("recompute_attn", self.recompute_attention),
                                             ("offload", self.offload_gib is not None)) if on]
        if region_only and preset not in _REGION_PRESETS:
            hint = (" (budget:<GiB> chooses among presets by itself; give an explicit full or sqrt preset with it)"
                    if preset == Recompute.BUDGET else "")
            verb, them = ("apply", "them") if len(region_only) > 1 else ("applies", "it")
            raise ValueError(f"+{' and +'.join(region_only)} {verb} to whole-layer checkpoint regions: use {them} "
                             f"with full, full:uniform:N, full:block:N or sqrt, not {preset.value!r}{hint}")
        if self.offload_gib is not None:
            _positive_gib(self.offload_gib, "+offload:<GiB>")
        if self.offload_attention:
            if self.offload_gib is None:
                raise ValueError("offload_attention needs a host budget: +offload_attn:<GiB>")
            if self.recompute_attention:
                raise ValueError("+offload_attn moves the pinned attention tensors to host memory, but with "
                                 "+recompute_attn nothing is pinned; use +offload:<GiB> with +recompute_attn")

    @classmethod
    def parse(cls, text: str) -> RecomputeConfig:
        """``"full:block:4"`` → ``RecomputeConfig(preset="full", method="block", num_layers=4)``, etc."""
        if isinstance(text, RecomputeConfig):
            return text
        if not isinstance(text, str):
            raise TypeError(f"a recompute preset must be a string, got {type(text).__name__}")
        head, *mods = _MODIFIER_SPLIT.split(text.strip())
        modifiers = _parse_modifiers(text, mods)
        name, *params = head.strip().split(":")
        preset = parse_enum(Recompute, name, "recompute preset")
        usage = _USAGE
        if preset == Recompute.FULL and params:
            if len(params) != 2 or not params[1].isdigit():
                raise ValueError(f"bad recompute preset {text!r}: {usage}")
            return cls(preset=preset, method=params[0], num_layers=int(params[1]), **modifiers)
        if preset == Recompute.BUDGET:
            try:
                (budget,) = params
                gib = float(budget)
            except ValueError:
                raise ValueError(f"bad recompute preset {text!r}: {usage}") from None
            return cls(preset=preset, budget_gib=gib, **modifiers)
        if params:
            raise ValueError(f"bad recompute preset {text!r}: {usage}")
        return cls(preset=preset, **modifiers)

    @property
    def modifiers(self) -> dict:
        """The modifier fields (what ``+...`` sets), to carry them onto another preset: ``replace(c, **m)``."""
        return {name: getattr(self, name) for name in _MODIFIER_FIELDS}

    @property
    def has_modifiers(self) -> bool:
        return self != self.base

    @property
    def for_layers(self) -> RecomputeConfig:
        """This config without ``+tile_loss`` (the loss applies that; :func:`ctx_plugin.recompute.apply` the rest)."""
        return replace(self, tile_loss=False, loss_tokens=None)

    @property
    def base(self) -> RecomputeConfig:
        """This preset without modifiers."""
        return replace(self, **{name: getattr(RecomputeConfig, name) for name in _MODIFIER_FIELDS})

    def __str__(self) -> str:
        if self.preset == Recompute.FULL:
            text = "full" if (self.method, self.num_layers) == ("uniform", 1) else \
                f"full:{self.method}:{self.num_layers}"
        elif self.preset == Recompute.BUDGET:
            text = f"budget:{gib_text(self.budget_gib)}"
        else:
            text = self.preset.value
        if self.tile_loss:
            text += "+tile_loss" + ("" if self.loss_tokens is None else f":{self.loss_tokens}")
        if self.tile_mlp:
            text += "+tile_mlp" + ("" if self.mlp_tokens is None else f":{self.mlp_tokens}")
        if self.recompute_attention:
            text += "+recompute_attn"
        if self.offload_gib is not None:
            text += f"+{'offload_attn' if self.offload_attention else 'offload'}:{gib_text(self.offload_gib)}"
        return text


_MODIFIER_SPLIT = re.compile(r"(?<![0-9.][eE])\+")
"""Where a preset string's modifiers begin: every ``+`` but an exponent's (``offload:1e+3``)."""


def gib_text(gib: float) -> str:
    """A GiB figure as :meth:`RecomputeConfig.parse` reads it back exactly (``str(c)`` parses to ``c``): whole
    numbers as such, others as Python's shortest exact form, an exponent without ``+`` (the modifiers' separator)."""
    gib = float(gib)
    return str(int(gib)) if gib.is_integer() and abs(gib) < 1e16 else repr(gib).replace("e+", "e")


_MODIFIER_FIELDS = ("tile_loss", "loss_tokens", "tile_mlp", "mlp_tokens", "recompute_attention", "offload_gib",
                    "offload_attention")


def _parse_modifiers(text: str, mods: list[str]) -> dict:
    """``["tile_mlp:4096", "offload:64"]`` → RecomputeConfig keyword arguments."""
    out: dict = {}
    seen: set[Modifier] = set()
    for mod in mods:
        name, *params = mod.strip().split(":")
        try:
            modifier = Modifier(name)
        except ValueError:
            raise ValueError(f"unknown recompute modifier {name!r} in {text!r}; choose among "
                             f"{', '.join(m.value for m in Modifier)}") from None
        if modifier in seen or (modifier in (Modifier.OFFLOAD, Modifier.OFFLOAD_ATTN) and "offload_gib" in out):
            raise ValueError(f"bad recompute preset {text!r}: +{name} given twice (or both offload and offload_attn)")
        seen.add(modifier)
        bad = ValueError(f"bad recompute modifier {mod!r} in {text!r}: {_USAGE}")
        if modifier in (Modifier.TILE_LOSS, Modifier.TILE_MLP):
            if len(params) > 1 or (params and not params[0].isdigit()):
                raise bad
            prefix = "loss" if modifier == Modifier.TILE_LOSS else "mlp"
            out[modifier.value] = True
            out[f"{prefix}_tokens"] = int(params[0]) if params else None
        elif modifier == Modifier.RECOMPUTE_ATTN:
            if params:
                raise bad
            out["recompute_attention"] = True
        else:
            if len(params) != 1:
                raise ValueError(f"bad recompute modifier {mod!r} in {text!r}: +{name} needs a host-memory budget "
                                 f"per rank, e.g. +{name}:64 (GiB)")
            try:
                out["offload_gib"] = float(params[0])
            except ValueError:
                raise bad from None
            out["offload_attention"] = modifier == Modifier.OFFLOAD_ATTN
    return out


def regions(config: RecomputeConfig, num_layers: int) -> list[tuple[int, int]]:
    """The whole-layer checkpoint regions ``[start, stop)`` of a stack of ``num_layers`` layers (empty for
    presets that do not checkpoint whole layers)."""
    if num_layers == 0:                  # a pipeline chunk may hold no decoder layer
        return []
    if config.preset == Recompute.SQRT:
        size = math.ceil(math.sqrt(num_layers))
        return [(i, min(i + size, num_layers)) for i in range(0, num_layers, size)]
    if config.preset != Recompute.FULL:
        return []
    if config.num_layers > num_layers:
        raise ValueError(f"recompute preset {config} counts {config.num_layers} layers, but the stack has {num_layers} "
                         f"(per pipeline stage or virtual-pipeline chunk); give N ≤ {num_layers}")
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
