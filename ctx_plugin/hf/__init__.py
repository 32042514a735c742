"""Hugging Face transformers (5.x): ctx_plugin's attention as an ``attn_implementation``.

    name = ctx_plugin.hf.enable(model, cp_config, groups)

The attention function follows transformers' interface (q ``[b, h, s, d]``, k/v ``[b, h_kv, s, d]``, returns
``([b, s, h, d], None)``). Rotary embeddings come from ``position_ids``, so pass the sharded global positions
(``ctx_plugin.sequence_positions``) with the sharded ``input_ids``. The name is deliberately not registered as a
mask implementation: transformers would read the jumps in sharded position ids as packed sequences.

Sliding windows (``sliding_window``, per layer through ``layer_types``), logit soft-capping (``softcap``) and
per-head attention sinks (``s_aux``) arrive as keywords of the attention interface and are passed on to
:func:`ctx_plugin.cp_attention` with transformers' own mask semantics (:func:`hf_window`).

Nothing is dropped silently. :func:`enable` refuses models with attention options ctx_plugin does not implement
(dropout, chunked attention, non-attention token mixers, attention outside transformers' interface, settings computed
from a rank's shard: :mod:`ctx_plugin.hf.checks`); before every forward of the model, or of its base model called
directly, or of ``model.forward(...)`` called itself (as PEFT calls it), the inputs are checked once (padding masks,
caches, position ids, labels, logits_to_keep, inputs of other modalities: :mod:`ctx_plugin.hf.inputs`) and the ranks
of the context-parallel group share their findings (one small all-reduce), so a problem on any rank is the same
``ValueError`` on every rank; and the attention function refuses every keyword it does not know to be harmless
(:data:`HONOURED`, :data:`MUST_BE_UNSET`, :data:`HARMLESS`: the README's table).
"""
from __future__ import annotations

import inspect
import weakref

import torch

from ..core import agreement
from ..core.api import cp_attention
from ..core.compiler import opaque
from ..core.config import CPConfig
from ..core.groups import CPGroups
from ..core.rules import SettingNames, check_heads
from ..packing import DOCUMENTS_KEYWORD, hf_documents
from ..recompute import pinning
from .checks import (Running, bidirectional_overlay, checked_modules, config_problems, encoder_modules,
                     other_modalities, refuse_generation, refuse_shard_loss, windowed_without_keyword)
from .inputs import InputCheck, check_direct_forward

HONOURED = {"scaling": "softmax scale (default head_dim**-0.5)",
            "is_causal": "causal or bidirectional (default: the module's is_causal, else causal)",
            "dropout": "must be 0: ctx_plugin's attention has no dropout",
            "sliding_window": "sliding-window attention with transformers' masks: causal, the last w keys "
                              "(window (w - 1, 0)); bidirectional by is_causal=False, |i - j| <= w (window (w, w))",
            "softcap": "attention logit soft-capping, c * tanh(scores / c) before the softmax (Gemma-2)",
            "s_aux": "attention sinks, one learnable logit per query head (gpt-oss)",
            "cu_seq_lens_q": "packed documents: the global sequence's cumulative lengths (equal to cu_seq_lens_k)",
            "cu_seq_lens_k": "packed documents (equal to cu_seq_lens_q)",
            "max_length_q": "must be the longest document of cu_seq_lens_q (checked)",
            "max_length_k": "must be the longest document of cu_seq_lens_k (checked)",
            DOCUMENTS_KEYWORD: "packed documents as a ctx_plugin.Documents (with padding: Documents.valid)"}
"""Keywords of transformers' attention interface that ctx_plugin implements exactly."""
MUST_BE_UNSET = {"sinks": "per-token attention sinks",
                 "position_bias": "an additive position bias (relative attention)",
                 "seq_idx": "per-token sequence indices (packed state-space layers)", "indices": "sparse attention", "block_indices": "sparse attention",
                 "block_table": "a paged KV cache", "use_cache": "a KV cache",
                 "output_attentions": "attention weights (ctx_plugin never materialises them)",
                 "encoder_hidden_states": "cross-attention to an encoder's states (BERT-style decoders pass None)"}
"""Keywords that change the math or the result: accepted only as ``None`` (or ``False``), refused otherwise."""
HARMLESS = {"position_ids": "RoPE is applied before attention; the model's input check verifies them",
            "output_router_logits": "MoE router output, not attention",
            "output_hidden_states": "model output selection, not attention",
            "num_items_in_batch": "loss normalisation, not attention"}
"""Keywords that do not affect attention. Any keyword in none of the three tables is refused by name."""

_LAYER_TYPES = ("full_attention", "attention", "sliding_attention")
_MODULE_OPTIONS = {"attention_dropout": "attention dropout (set it to 0)"}
_PASSED_AS = {"sliding_window": "sliding_window", "attn_logit_softcapping": "softcap", "sinks": "s_aux"}
"""Attributes of attention modules and the keyword the model must pass them as (else the attention refuses)."""


def _require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("ctx_plugin's Hugging Face integration needs transformers 5: "
                          "pip install 'ctx-plugin[hf]'") from e
    return transformers


def _set(value) -> bool:
    return value is not None and value is not False


class _Attention:
    """The transformers attention function for one (config, groups). It runs only for modules of models given to
    :func:`enable`, whose forward pre-hook checks the inputs transformers would otherwise drop (padding masks)."""

    def __init__(self, cp_config: CPConfig, groups: CPGroups):
        self.cp_config, self.groups = cp_config, groups
        self.modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        """The modules of the models :func:`enable` switched to this attention, each with its model's
        :class:`ctx_plugin.hf.checks.Running` (what the forward under way checked)."""

    @opaque
    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        try:
            documents = self._documents(module, query, key, attention_mask, dropout, kwargs)
        except (TypeError, ValueError) as e:      # the same error on every rank, or the ranks' disagreement
            if self.groups.check_group is not None:
                agreement.check(self.groups, agreement.attention_signature(
                    *(t.transpose(1, 2) for t in (query, key, value)), groups=self.groups, causal=None,
                    softmax_scale=None, kernel=None, error=e))
            raise
        given, sinks = kwargs.get("is_causal"), kwargs.get("s_aux")
        # Gemma-3's use_bidirectional_attention: its own bidirectional mask decides over is_causal=True (sdpa gets a
        # mask); is_causal=False makes it build masking_utils' bidirectional masks instead (|i - j| <= w)
        overlay = bidirectional_overlay(module) and given is not False
        if overlay:
            given = None
        causal = False if overlay else bool(getattr(module, "is_causal", True) if given is None else given)
        if torch.is_autocast_enabled(query.device.type):    # as autocast casts sdpa's inputs: q, k come out of
            dtype = torch.get_autocast_dtype(query.device.type)     # RoPE in fp32 next to a bf16 v
            query, key, value = (t.to(dtype) for t in (query, key, value))
        out = cp_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), config=self.cp_config,
                           groups=self.groups, causal=causal, softmax_scale=scaling,
                           window=hf_window(kwargs.get("sliding_window"), given, causal,
                                            overlay=overlay),
                           softcap=kwargs.get("softcap"), sinks=sinks, documents=documents)
        return out, None

    def _documents(self, module, query, key, attention_mask, dropout, kwargs):
        """The call's packed documents (None: none), after checking what the attention cannot honour (ValueError,
        raised before any communication; counts the call)."""
        if module not in self.modules:
            raise ValueError(f"{type(module).__name__} belongs to a model that was not passed to "
                             f"ctx_plugin.hf.enable(model, config, groups), which checks the model's options and "
                             f"inputs; call it on the model (it switches the attention implementation itself)")
        for name, val in kwargs.items():
            if name in MUST_BE_UNSET:
                if _set(val):
                    raise ValueError(f"ctx_plugin's attention does not implement {MUST_BE_UNSET[name]} "
                                     f"({name}={val if not isinstance(val, torch.Tensor) else 'a tensor'}); "
                                     f"use a model (config) without it")
            elif name not in HARMLESS and name not in HONOURED:
                raise ValueError(f"ctx_plugin's attention got the keyword {name!r}, which it does not know to be "
                                 f"harmless, so it refuses it rather than ignore it (known: "
                                 f"{sorted({*HONOURED, *MUST_BE_UNSET, *HARMLESS})})")
        if dropout:
            raise ValueError(f"ctx_plugin's attention has no dropout; set the model's attention_dropout to 0 "
                             f"(got dropout={dropout})")
        if attention_mask is not None:
            raise ValueError("ctx_plugin's attention cannot apply an explicit attention mask (padding or custom "
                             "masks); give unpadded, causally-masked sequences (labels of padding = -100)")
        if query.shape[2] != key.shape[2]:
            raise ValueError("ctx_plugin's attention runs training/prefill without a KV cache; call the model with "
                             "use_cache=False")
        for attr, keyword in _PASSED_AS.items():
            val = getattr(module, attr, None)
            if keyword not in kwargs and (isinstance(val, torch.Tensor) or (
                    not isinstance(val, torch.nn.Module) and _set(val))):
                raise ValueError(f"{type(module).__name__}.{attr} is set but the model does not pass it to the "
                                 f"attention interface as {keyword}=, so ctx_plugin's attention cannot apply it")
        unwindowed = windowed_without_keyword(module, kwargs)
        if unwindowed is not None:
            raise ValueError(unwindowed)
        sinks = kwargs.get("s_aux")
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dim() != 1
                                  or sinks.shape[0] != query.shape[1]):
            raise ValueError(f"ctx_plugin's attention takes s_aux as one sink logit per query head (shape "
                             f"[{query.shape[1]}]), got {tuple(getattr(sinks, 'shape', ())) or type(sinks).__name__}")
        running = self.modules[module]
        running.calls += 1
        documents = hf_documents(kwargs, query.shape[2] * self.groups.size)
        if documents is None and running.module is not None:   # a layer that drops the forward's keywords
            documents = running.documents                        # (StableLM, Nemotron): the check's
        elif documents is None and running.documents is not None and pinning.state().mode != "replay":
            raise ValueError(f"{type(module).__name__} runs its attention again outside the model's forward (a "
                             f"recomputation in backward: gradient_checkpointing_enable(), +recompute_attn) without "
                             f"the packed documents, which its layer does not pass on; ctx_plugin cannot tell which "
                             f"forward's documents it recomputes: turn that recomputation off (ctx_plugin's full, "
                             f"sqrt or core_attn presets keep the attention), or pack no documents")
        return documents


def hf_window(sliding_window, is_causal: bool | None, causal: bool, overlay: bool = False) -> tuple[int, int] | None:
    """ctx_plugin's ``window`` for transformers' ``sliding_window`` keyword, read as transformers' masks read it
    (``masking_utils``): causal, ``kv_idx > q_idx - w`` — the query and the ``w - 1`` keys before it, ``(w - 1, 0)``;
    bidirectional through ``is_causal=False`` (a config's ``is_causal``, ``create_bidirectional_sliding_window_mask``),
    ``|q_idx - kv_idx| <= w`` — ``(w, w)``. A module bidirectional on its own (``is_causal`` attribute, e.g. Gemma-3's
    ``use_bidirectional_attention``) gets its window mask from model code that differs between models, so that is an
    error unless ``overlay`` (Gemma-3's, :func:`ctx_plugin.hf.checks.bidirectional_overlay`: ``|q_idx - kv_idx| < w``,
    ``(w - 1, w - 1)``). ``causal`` is the decision (``is_causal`` keyword, else the module's)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if causal:
        return (sliding_window - 1, 0)
    if is_causal is False:
        return (sliding_window, sliding_window)
    if overlay:
        return (sliding_window - 1, sliding_window - 1)
    raise ValueError(f"a bidirectional attention module (is_causal=False) with sliding_window={sliding_window}: "
                     f"transformers' models build such masks in their own code, differently (masking_utils: "
                     f"|i - j| <= w; Gemma-3's use_bidirectional_attention: |i - j| < w), so ctx_plugin does not "
                     f"guess; use a causal model, or a config with is_causal=False (masking_utils' |i - j| <= w)")


def _register(cp_config: CPConfig, groups: CPGroups, name: str | None) -> tuple[str, _Attention]:
    transformers = _require_transformers()
    if not isinstance(groups, CPGroups) or groups.config != cp_config:
        raise ValueError("groups must come from ctx_plugin.build_cp_groups(config) for the config passed here")
    name = name or f"ctx_plugin_{cp_config.backend.value}_{id(groups):x}"
    existing = transformers.AttentionInterface().get(name)
    if existing is None and name != "eager":
        fn = _Attention(cp_config, groups)
        transformers.AttentionInterface.register(name, fn)
        return name, fn
    if isinstance(existing, _Attention) and existing.groups is groups and existing.cp_config == cp_config:
        return name, existing
    raise ValueError(f"the attention name {name!r} is already taken (transformers' registry is process-wide: "
                     f"another model would be rebound); pass another name, or none (one name per groups object)")


def register(cp_config: CPConfig, groups: CPGroups, name: str | None = None) -> str:
    """Registers the attention for ``attn_implementation=`` (default name: ``ctx_plugin_<backend>_<groups id>``,
    one per groups object, so models with other groups never share it). A model runs it only after
    :func:`enable`, which checks the model; registering alone is for building a model with the name."""
    return _register(cp_config, groups, name)[0]


def _unsupported(model, encoders: set[int]) -> list[str]:
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
        for attr, what in _MODULE_OPTIONS.items():
            val = getattr(m, attr, None)
            if attr not in found and (isinstance(val, torch.Tensor) or (
                    not isinstance(val, torch.nn.Module) and _set(val) and val != 0)):
                shown = "a tensor" if isinstance(val, torch.Tensor) else repr(val)
                note(attr, f"{attr}={shown} on attention modules: {what}", path or "the model")
    return [f"{text}, in {where[0]}" + (f" and {len(where) - 1} more" if len(where) > 1 else "")
            for text, where in found.values()]


def _check_model(model) -> None:
    from transformers import PreTrainedModel

    tp = getattr(model, "tp_size", None)
    if tp not in (None, 1):
        raise ValueError(f"{type(model).__name__} is split by transformers' tensor parallelism (tp_size={tp}): "
                         f"ctx_plugin's attention is checked and split over context-parallel ranks by the config's "
                         f"whole heads, not a tensor-parallel rank's share; load the model without tp_plan (DeepSpeed's "
                         f"ZeRO shards its parameters instead), or train tensor × context parallel with Megatron")
    encoders = encoder_modules(model)
    problems = _unsupported(model, encoders)
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
    """What :func:`enable` checks of a model before it changes anything: the options ctx_plugin's attention does not
    implement and the head split over ``cp_size`` ranks (``ValueError`` naming them). Modules and configs only: a
    model built on the meta device will do (``ctx-plugin launch`` checks a job's model that way)."""
    _require_transformers()
    _check_model(model)
    _check_heads(model, cp_config, cp_size)


def enable(model, cp_config: CPConfig, groups: CPGroups, name: str | None = None) -> str:
    """Checks the model (options ctx_plugin does not implement are a ``ValueError`` naming them, before anything
    changes), registers the attention, switches ``model`` to it, turns its KV cache off (``config.use_cache=False``)
    and checks every forward's inputs on all ranks of the group together; ``generate()`` is refused. Returns the
    attention's name."""
    check_model(model, cp_config, groups.size)
    name, fn = _register(cp_config, groups, name)
    others = other_modalities(model.config)
    # a multimodal model: its text model only (its encoders keep theirs; the input check refuses their inputs)
    model.set_attn_implementation({"": name, **{key: others[key]._attn_implementation if key in others else name
                                                for key in model.config.sub_configs}} if others else name)
    if model.config._attn_implementation != name:
        raise ValueError(f"transformers did not switch {type(model).__name__} to {name!r} (it uses "
                         f"{model.config._attn_implementation!r})")
    model.config.use_cache = False
    for previous in getattr(model, "_ctx_plugin_input_check", ()):  # enabled again (e.g. other groups): the new one
        previous.remove()
    running, handles = Running(), []
    fn.modules.update((m, running) for m in model.modules())
    for m in checked_modules(model):
        if getattr(m, "config", None) is not None:
            m.config.use_cache = False
        check = InputCheck(cp_config, groups, inspect.signature(m.forward), running,
                           multimodal=bool(other_modalities(getattr(m, "config", None))))
        handles += [m.register_forward_pre_hook(check, with_kwargs=True),
                    m.register_forward_hook(running, always_call=True)]
        if m is model:
            check_direct_forward(model, check, running)
    model._ctx_plugin_input_check = tuple(handles)
    refuse_shard_loss(model, InputCheck.PROBLEMS["labels"])
    refuse_generation(model)
    return name
