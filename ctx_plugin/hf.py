"""Hugging Face transformers (5.x): ctx_plugin's attention as an ``attn_implementation``.

    name = ctx_plugin.hf.enable(model, cp_config, groups)     # or register(...) + attn_implementation=name

The attention function follows transformers' interface (q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]``, returns
``([b, s, h, d], None)``). Rotary embeddings come from ``position_ids``, so pass the sharded global positions
(``ctx_plugin.sequence_positions``) with the sharded ``input_ids``. The name is deliberately not registered as a
mask implementation: transformers would read the jumps in sharded position ids as packed sequences. Masks
ctx_plugin cannot honor (padding, sliding windows) are errors, never dropped: :func:`enable` checks the model's
``attention_mask`` argument before every forward, and refuses KV caches (a cache of shards is not a cache).
"""
from __future__ import annotations

import torch

from .api import cp_attention
from .config import CPConfig
from .groups import CPGroups


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("ctx_plugin's Hugging Face integration needs transformers 5: "
                          "pip install 'ctx-plugin[hf]'") from e
    return transformers


def attention_function(cp_config: CPConfig, groups: CPGroups):
    """The transformers attention function running :func:`ctx_plugin.cp_attention` with these settings."""

    def ctx_plugin_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise ValueError("ctx_plugin's attention cannot apply an explicit attention mask (padding or custom "
                             "masks); give unpadded, causally-masked sequences (labels of padding = -100)")
        if dropout and module.training:
            raise ValueError(f"ctx_plugin's attention has no dropout; set the model's attention_dropout to 0 "
                             f"(got {dropout})")
        if kwargs.get("sliding_window") is not None:
            raise ValueError("ctx_plugin's attention does not support sliding-window attention; set the model's "
                             "sliding_window to None")
        if query.shape[2] != key.shape[2]:
            raise ValueError("ctx_plugin's attention runs training/prefill without a KV cache; call the model with "
                             "use_cache=False")
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), config=cp_config,
                           groups=groups, causal=bool(causal), softmax_scale=scaling)
        return out, None

    return ctx_plugin_attention


def register(cp_config: CPConfig, groups: CPGroups, name: str | None = None) -> str:
    """Registers the attention under ``name`` (default ``ctx_plugin_<backend>``) for ``attn_implementation=``."""
    transformers = _require_transformers()
    name = name or f"ctx_plugin_{cp_config.backend.value}"
    transformers.AttentionInterface.register(name, attention_function(cp_config, groups))
    return name


def _reject_masks(module, args, kwargs):
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
        raise ValueError("a KV cache built from context-parallel shards is not a model's cache; ctx_plugin runs "
                         "training/prefill only: call the model with use_cache=False")
    mask = kwargs.get("attention_mask")
    if mask is not None and not (mask.dim() == 2 and bool(torch.all(mask != 0))):
        raise ValueError("ctx_plugin cannot apply a padding/custom attention_mask under context parallelism; pass "
                         "attention_mask=None with unpadded sequences (mask padded labels with -100 instead)")


def enable(model, cp_config: CPConfig, groups: CPGroups, name: str | None = None) -> str:
    """Registers the attention, switches ``model`` to it, turns its KV cache off (``config.use_cache=False``) and
    makes ``model(...)`` refuse masks and caches it cannot honor."""
    name = register(cp_config, groups, name)
    model.set_attn_implementation(name)
    model.config.use_cache = False
    model.register_forward_pre_hook(_reject_masks, with_kwargs=True)
    return name
