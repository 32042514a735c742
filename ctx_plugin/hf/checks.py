"""Checks of :mod:`ctx_plugin.hf` that read a transformers config or module: options whose result depends on the
length a rank sees (its shard, not the sequence), sliding windows that a model applies only through its mask, and
which modules' forwards the input check guards (:func:`checked_modules`, once per forward: :class:`Running`).

A context-parallel rank holds a shard of the sequence, so anything transformers computes from the length or the
positions of what one forward sees is computed from the shard:

- RoPE types ``dynamic`` (NTK, rebuilding ``inv_freq``) and ``longrope`` (short or long factors) pick their
  frequencies from ``max(position_ids) + 1`` (``modeling_rope_utils.dynamic_rope_update``): the shard's;
- Llama-4's ``attn_temperature_tuning`` scales the queries of NoPE layers by their positions ``arange(local_len)``.

Both are refused by :func:`config_problems` (at :func:`ctx_plugin.hf.enable`), never approximated.
"""
from __future__ import annotations

import inspect
import weakref

import torch

from ..core.compiler import opaque


def is_set(value) -> bool:
    """An option given a value (neither None nor False)."""
    return value is not None and value is not False


def _rope_types(params) -> list[tuple[str, str]]:
    """(where, rope type) of a ``rope_parameters`` / ``rope_scaling`` value: one dict with ``rope_type`` (or the
    legacy ``type``), or a dict of such dicts per layer type (``{"full_attention": {...}, ...}``)."""
    if not isinstance(params, dict):
        return []
    if "rope_type" in params or "type" in params:
        return [("", str(params.get("rope_type", params.get("type"))))]
    return [(f"[{key!r}]", str(value.get("rope_type", value.get("type"))))
            for key, value in params.items() if isinstance(value, dict) and ("rope_type" in value or "type" in value)]


def _length_dependent(rope_type: str) -> bool:
    """Whether transformers recomputes the RoPE frequencies from a forward's largest position id
    (``dynamic_rope_update`` tests ``"dynamic" in rope_type``, so every dynamic variant, and ``longrope``)."""
    return rope_type == "longrope" or "dynamic" in rope_type


def config_problems(config) -> list[tuple[str, str]]:
    """(option, text) for each setting of ``config`` whose result would come from a rank's shard."""
    found = []
    seen = set()
    for attr in ("rope_parameters", "rope_scaling"):
        for where, rope_type in _rope_types(getattr(config, attr, None)):
            if _length_dependent(rope_type) and (where, rope_type) not in seen:
                seen.add((where, rope_type))
                found.append((f"rope_type{where}", f"{attr}{where}['rope_type']={rope_type!r} (RoPE frequencies chosen "
                              f"from the largest position id a forward sees, under context parallelism each "
                              f"rank's shard, not the sequence; use a config whose rope_type does not depend on "
                              f"the length, e.g. 'default', 'linear', 'llama3' or 'yarn')"))
    found += bidirectional_problems(config)
    if getattr(config, "add_cross_attention", False) is True:
        found.append(("add_cross_attention", "add_cross_attention=True (cross-attention to an encoder's states, which "
                      "the layers pass to the attention as its keys: not the sequence ctx_plugin shards, and the "
                      "encoder's padding mask would not reach it); build the decoder without cross-attention"))
    no_rope = getattr(config, "no_rope_layers", None) or []
    if getattr(config, "attn_temperature_tuning", False) and any(not use_rope for use_rope in no_rope):
        found.append(("attn_temperature_tuning", "attn_temperature_tuning=True with NoPE layers (no_rope_layers "
                      "0): their queries are scaled by the positions within each rank's shard, not the sequence's; "
                      "set attn_temperature_tuning=False"))
    return found


_OVERLAY_TYPES = ("gemma3_text",)
"""Model types whose ``use_bidirectional_attention=True`` makes every attention module ``is_causal=False`` and their
mask agree: full layers see the whole sequence, sliding layers ``|i - j| < w`` (Gemma-3's
``_bidirectional_window_overlay`` OR the causal window): ctx_plugin's ``window=(w - 1, w - 1)``."""


def bidirectional_overlay(module) -> bool:
    """Whether ``module`` is bidirectional the Gemma-3 way (:data:`_OVERLAY_TYPES`)."""
    config = getattr(module, "config", None)
    return (getattr(module, "is_causal", True) is False and getattr(config, "use_bidirectional_attention", None) is True
            and getattr(config, "model_type", None) in _OVERLAY_TYPES)


def bidirectional_problems(config) -> list[tuple[str, str]]:
    """``use_bidirectional_attention`` where the model's mask code, not its attention modules' ``is_causal``, decides
    which tokens see each other both ways: Gemma/Gemma-2 (and PaliGemma, which sets it) keep a causal mask, with
    prefix blocks from ``token_type_ids``, next to modules marked ``is_causal=False``; Step3p7 marks its modules
    causal next to a bidirectional mask; Gemma-4's ``"all"`` builds its own mask. ctx_plugin takes no mask, so only
    the kinds it reproduces pass: Gemma-3's ``True`` (:func:`bidirectional_overlay`) and ``"vision"`` (bidirectional
    blocks of image tokens only; image inputs are refused by the input check, text alone is causal)."""
    value = getattr(config, "use_bidirectional_attention", None)
    model_type = getattr(config, "model_type", None)
    if not value or value == "vision" or (value is True and model_type in _OVERLAY_TYPES):
        return []
    return [("use_bidirectional_attention", f"use_bidirectional_attention={value!r} ({model_type}: which tokens "
             f"see each other both ways comes from the model's own mask code, which its attention modules' is_causal "
             f"does not match, and ctx_plugin's attention takes no mask; set it to None/False for causal attention, "
             f"or use Gemma-3, whose bidirectional attention ctx_plugin reproduces)")]


def other_modalities(config) -> dict:
    """The sub-configs of a composite (multimodal) config other than its text model's, by key, those set
    (``vision_config``, ``audio_config``, ...): their encoders keep their own attention implementation."""
    return {key: sub for key in getattr(config, "sub_configs", {}) or {}
            if key != "text_config" and (sub := getattr(config, key, None)) is not None}


def encoder_modules(model) -> set[int]:
    """ids of a multimodal model's other-modality encoders (the modules whose config is a sub-config of
    :func:`other_modalities`, and theirs), and of those sub-configs: they keep their own attention and are not
    checked."""
    others = {id(c) for c in other_modalities(model.config).values()}
    found = set(others)
    for m in model.modules():
        if id(getattr(m, "config", None)) in others and id(m) not in found:
            found.update(id(sub) for sub in m.modules())
    return found


def windowed_without_keyword(module, kwargs: dict) -> str | None:
    """Why ``module`` should attend through a sliding window that its call does not pass (``sliding_window``
    absent or ``None``), or ``None``. transformers windows a layer through the mask it builds when its config has
    ``sliding_window`` and no ``layer_types`` (every layer), or ``layer_types[layer_idx] == "sliding_attention"``;
    ctx_plugin's attention takes no mask, so the window would be lost (e.g. PhiMoE)."""
    if kwargs.get("sliding_window") is not None:
        return None
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    index = getattr(module, "layer_idx", None)
    if layer_types is None:
        if window is None:
            return None
        where = f"config.sliding_window={window!r} and no layer_types (every layer is windowed)"
    elif isinstance(index, int) and 0 <= index < len(layer_types):
        if layer_types[index] != "sliding_attention":
            return None
        where = f"config.layer_types[{index}] is 'sliding_attention' (sliding_window={window!r})"
    elif "sliding_attention" in layer_types:
        where = f"config.layer_types has 'sliding_attention' layers and {type(module).__name__} has no layer_idx"
    else:
        return None
    return (f"{type(module).__name__} is a sliding-window layer ({where}) but the model does not pass "
            f"sliding_window= to the attention interface (transformers applies the window through its mask, which "
            f"ctx_plugin's attention does not take), so the window would be dropped; use a model that passes it "
            f"(Mistral, Qwen2, Gemma-2/3, gpt-oss, ...), or a config with sliding_window=None if the model is "
            f"meant to attend to the whole sequence")


class Running:
    """Which of a model's checked modules (the model, its base model, its decoder) runs the forward whose inputs were
    checked: the modules it calls skip their check (one check, one all-reduce, per forward); the forward hook clears
    it, also when the forward raises. Calling an inner module directly (``model.model(...)``) checks there;
    ``model.forward`` called itself (PEFT's tuner), which skips the model's hooks, checks in the model's instance
    ``forward`` (:func:`ctx_plugin.hf.inputs.check_direct_forward`)."""

    def __init__(self):
        self.module = None
        self.documents = None
        """The packed documents the check read for the forward under way (None: none), which the model's attention
        calls apply also when the model does not pass them on (StableLM and Nemotron decoder layers call their
        attention without the forward's keywords)."""
        self.drops_keywords: weakref.WeakSet = weakref.WeakSet()
        """Attention modules seen called without the documents of a forward that had some: their attention run
        again outside a forward (a recomputation in backward) is refused, since it cannot tell whose documents, if
        any, it recomputes (the latest forward's may be another micro batch's)."""
        self.calls = 0
        """Calls into ctx_plugin's attention during this forward: a forward that finishes without any ran its
        attention some other way (GIT's text layers hard-code theirs), on each rank's shard alone."""

    def start(self, module, documents) -> None:
        self.module, self.documents, self.calls = module, documents, 0

    @opaque
    def __call__(self, module, args, output):
        if self.module is module:
            calls, self.module = self.calls, None
            if calls == 0 and output is not None:        # None: the forward raised (the hook always runs)
                raise ValueError(f"{type(module).__name__}'s forward ran none of its attention through ctx_plugin's "
                                 f"attention function, so its attention saw only this rank's shard (the model "
                                 f"computes attention outside transformers' attention interface, e.g. GIT's text "
                                 f"layers); ctx_plugin cannot switch this model")


def checked_modules(model) -> list:
    """The model and the modules its forward calls that take the same inputs (``base_model``, ``get_decoder()``),
    each once, those whose forward takes ``position_ids``."""
    found = [model, getattr(model, "base_model", model)]
    try:
        found.append(model.get_decoder())
    except (AttributeError, NotImplementedError, ValueError, TypeError):
        pass
    unique = {id(m): m for m in found if isinstance(m, torch.nn.Module)}
    return [m for m in unique.values() if "position_ids" in inspect.signature(m.forward).parameters]


class ShardLossRefused:
    """The ``loss_function`` :func:`ctx_plugin.hf.enable` gives the model: transformers' causal-LM loss would shift
    ``labels`` inside a rank's shard (wrong targets at its edges). The model's input check refuses ``labels=`` (also
    for ``model.forward(...)``); a call that skips both (the class's forward, ``type(model).forward(model, ...)``)
    reaches this instead."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(self, *args, **kwargs):
        raise ValueError(f"ctx_plugin: {self.why} (labels= reached the model's loss function through a call that "
                         f"skipped its input check, e.g. type(model).forward(model, ...))")


def refuse_shard_loss(model, why: str) -> None:
    """Replaces ``model.loss_function`` (transformers' settable property) by :class:`ShardLossRefused`."""
    if isinstance(getattr(type(model), "loss_function", None), property):
        model.loss_function = ShardLossRefused(why)


class GenerationRefused:
    """The ``generate`` :func:`ctx_plugin.hf.enable` gives the model: decoding appends one token at a time to a KV
    cache, and under context parallelism each rank holds a shard of the sequence, so neither exists. Refused at the
    call, before any forward (every rank that calls it raises the same error; no collective runs)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def __call__(self, *args, **kwargs):
        raise ValueError(f"ctx_plugin: {self.model_name}.generate() is not supported under context parallelism "
                         f"(ctx_plugin.hf.enable switched the model to sharded training and prefill: no KV cache, each "
                         f"rank sees one shard of the sequence); generate with a model loaded without "
                         f"ctx_plugin.hf.enable, e.g. from the checkpoint this training saves")


def refuse_generation(model) -> None:
    """Gives ``model`` (when it has ``generate``, transformers' GenerationMixin) a :class:`GenerationRefused`."""
    if callable(getattr(model, "generate", None)):
        model.generate = GenerationRefused(type(model).__name__)
