"""What :func:`ctx_plugin.hf.enable` checks of a model before it changes anything (:func:`check_model`): the
options its attention does not implement, read from the model's configs and modules (:func:`unsupported`), models it
cannot split (tensor-parallel, encoder-decoder, attention outside transformers' interface, no ``position_ids``) and
the head split over the context-parallel ranks."""
from __future__ import annotations

import inspect

import torch

from ..core.config import CPConfig
from ..core.rules import SettingNames, check_heads
from .checks import config_problems, encoder_modules, is_set

_LAYER_TYPES = ("full_attention", "attention", "sliding_attention")
_MODULE_OPTIONS = {"attention_dropout": "attention dropout (set it to 0)"}


def require_transformers():
    """transformers, or an ImportError that says how to install it."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError("ctx_plugin's Hugging Face integration needs transformers 5: "
                          "pip install 'ctx-plugin[hf]'") from e
    return transformers


def unsupported(model, encoders: set[int]) -> list[str]:
    """The model's attention options ctx_plugin does not implement, from its configs and attention modules (not those
    of its other-modality ``encoders``: :func:`ctx_plugin.hf.checks.encoder_modules`)."""
    from transformers import PreTrainedConfig

    found: dict[str, tuple[str, list[str]]] = {}                        # option -> (what it is, where)

    def note(option: str, text: str, where: str) -> None:
        found.setdefault(option, (text, []))[1].append(where)

    configs = {id(c): c for c in [model.config, *(getattr(m, "config", None) for m in model.modules()
                                                  if id(m) not in encoders)]
               if isinstance(c, PreTrainedConfig) and id(c) not in encoders}
    for c in configs.values():
        where = type(c).__name__
        layer_types = getattr(c, "layer_types", None)
        if layer_types is not None:
            other = sorted({t for t in layer_types if t not in _LAYER_TYPES})
            if other:
                note("layer_types", f"layer_types with {other} layers (full and sliding-window attention are "
                     f"implemented; recurrent/linear token mixers and other attention types are not)", where)
        if getattr(c, "attention_chunk_size", None) is not None:
            note("attention_chunk_size", f"attention_chunk_size={c.attention_chunk_size} (chunked attention)", where)
        if getattr(c, "attention_dropout", 0) or 0:
            note("attention_dropout", f"attention_dropout={c.attention_dropout} (ctx_plugin's attention has no "
                 f"dropout: set it to 0 before building the model)", where)
        for option, text in config_problems(c):
            note(option, text, where)
    for path, m in model.named_modules():
        if id(m) in encoders:
            continue
        first = _offset_positions(m)
        if first is not None:
            note("positions", f"learned position embeddings numbered from padding_idx + 1 = {first} (RoBERTa-style: "
                 f"the model's own position_ids start there, while ctx_plugin checks and shards position_ids "
                 f"0..seq_len-1, which would select other embeddings)", path or "the model")
        for attr, what in _MODULE_OPTIONS.items():
            val = getattr(m, attr, None)
            if attr not in found and (isinstance(val, torch.Tensor) or (
                    not isinstance(val, torch.nn.Module) and is_set(val) and val != 0)):
                shown = "a tensor" if isinstance(val, torch.Tensor) else repr(val)
                note(attr, f"{attr}={shown} on attention modules: {what}", path or "the model")
    return [f"{text}, in {where[0]}" + (f" and {len(where) - 1} more" if len(where) > 1 else "")
            for text, where in found.values()]


def _offset_positions(module) -> int | None:
    """``padding_idx + 1`` for an embeddings module that numbers learned positions from there (fairseq's scheme:
    RoBERTa, XLM-R, ESM's absolute positions, ...: ``create_position_ids_from_input_ids``), else None."""
    pad = getattr(module, "padding_idx", None)
    if not isinstance(pad, int) or isinstance(pad, bool) or not any(
            callable(getattr(module, name, None)) for name in ("create_position_ids_from_input_ids",
                                                               "create_position_ids_from_inputs_embeds")):
        return None
    learned = (getattr(module, name, None) for name in ("position_embeddings", "embed_positions"))
    return pad + 1 if any(isinstance(m, torch.nn.Module) for m in learned) else None


def _check_model(model) -> None:
    from transformers import PreTrainedModel

    tp = getattr(model, "tp_size", None)
    if tp not in (None, 1):
        raise ValueError(f"{type(model).__name__} is split by transformers' tensor parallelism (tp_size={tp}): "
                         f"ctx_plugin's attention is checked and split over context-parallel ranks by the config's "
                         f"whole heads, not a tensor-parallel rank's share; load the model without tp_plan "
                         f"(DeepSpeed's ZeRO shards its parameters instead), or train tensor × context parallel with "
                         f"Megatron")
    if getattr(model.config, "is_encoder_decoder", False) is True:
        raise ValueError(f"{type(model).__name__} is an encoder-decoder model: its decoder's cross-attention to the "
                         f"encoder's states is not attention over one sequence, and ctx_plugin does not split it; "
                         f"use a decoder-only model (or an encoder alone)")
    encoders = encoder_modules(model)
    problems = unsupported(model, encoders)
    if problems:
        raise ValueError("ctx_plugin's attention does not implement these options of the model, which change its "
                         "math: " + "; ".join(problems) + ". Use a model (config) without them")
    for m in model.modules():
        if isinstance(m, PreTrainedModel) and id(m) not in encoders and not type(m)._can_set_attn_implementation():
            raise ValueError(f"{type(m).__name__} does not route attention through transformers' "
                             f"AttentionInterface, so ctx_plugin cannot replace its attention")
    if "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError(f"{type(model).__name__}.forward takes no position_ids; ctx_plugin needs the model to "
                         f"take each rank's global token positions")


def _check_heads(model, cp_config: CPConfig, cp: int) -> None:
    """The head split (:func:`ctx_plugin.core.rules.check_heads`) for the model's config, at enable time."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    # a heterogeneous config (per_layer_config) refuses global reads of its per-layer attributes: each layer's
    layers = list(config.per_layer_config) if getattr(config, "is_heterogeneous", False) is True else [config]
    for heads, kv in dict.fromkeys((getattr(c, "num_attention_heads", None), getattr(c, "num_key_value_heads", None))
                                   for c in layers):
        if isinstance(heads, int):
            check_heads(cp_config, heads, kv or heads, cp, SettingNames(heads="attention heads (num_attention_heads)",
                                                                        kv_heads="num_key_value_heads"))


def check_model(model, cp_config: CPConfig, cp_size: int) -> None:
    """What :func:`ctx_plugin.hf.enable` checks of a model before it changes anything: the options ctx_plugin's
    attention does not implement and the head split over ``cp_size`` ranks (``ValueError`` naming them). Modules and
    configs only: a model built on the meta device will do (``ctx-plugin launch`` checks a job's model that way)."""
    require_transformers()
    _check_model(model)
    _check_heads(model, cp_config, cp_size)
