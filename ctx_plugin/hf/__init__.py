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
from a rank's shard, encoder-decoders, positions numbered from another origin: :mod:`ctx_plugin.hf.model`,
:mod:`ctx_plugin.hf.checks`); before every forward of the model, or of its base model called
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
from ..packing import DOCUMENTS_KEYWORD, hf_documents
from ..recompute import pinning
from .checks import (Running, bidirectional_overlay, checked_modules, is_set, other_modalities, refuse_generation,
                     refuse_shard_loss, windowed_without_keyword)
from .inputs import InputCheck, check_direct_forward
from .model import check_model, require_transformers

HONOURED = {"scaling": "softmax scale (default head_dim**-0.5)",
            "is_causal": "causal or bidirectional (default: the module's is_causal; a module without one is refused)",
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

_PASSED_AS = {"sliding_window": "sliding_window", "attn_logit_softcapping": "softcap", "sinks": "s_aux"}
"""Attributes of attention modules and the keyword the model must pass them as (else the attention refuses)."""


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
        causal = False if overlay else bool(module.is_causal if given is None else given)
        # under autocast cp_attention casts q, k (out of RoPE in fp32) and v as autocast casts sdpa's inputs
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
                if is_set(val):
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
        if kwargs.get("is_causal") is None and not isinstance(getattr(module, "is_causal", None), bool):
            raise ValueError(f"{type(module).__name__} passes no is_causal= to the attention interface and has no "
                             f"is_causal attribute, so whether it attends causally is decided only by the mask its "
                             f"model builds (a bidirectional one for encoders such as Splinter, ALIGN or CLAP), which "
                             f"ctx_plugin's attention does not take; ctx_plugin does not guess: use a model whose "
                             f"attention modules set is_causal (as Llama-style decoders and BERT's do)")
        if attention_mask is not None:
            raise ValueError("ctx_plugin's attention cannot apply an explicit attention mask (padding or custom "
                             "masks); give unpadded, causally-masked sequences (labels of padding = -100)")
        if query.shape[2] != key.shape[2]:
            raise ValueError("ctx_plugin's attention runs training/prefill without a KV cache; call the model with "
                             "use_cache=False")
        for attr, keyword in _PASSED_AS.items():
            val = getattr(module, attr, None)
            if keyword not in kwargs and (isinstance(val, torch.Tensor) or (
                    not isinstance(val, torch.nn.Module) and is_set(val))):
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
            if documents is not None:
                running.drops_keywords.add(module)
        elif documents is None and module in running.drops_keywords and pinning.state().mode != "replay":
            raise ValueError(f"{type(module).__name__} runs its attention again outside the model's forward (a "
                             f"recomputation in backward: gradient_checkpointing_enable(), +recompute_attn), and its "
                             f"layer does not pass the packed documents on; ctx_plugin cannot tell which forward's "
                             f"documents (if any) it recomputes: turn that recomputation off (ctx_plugin's full, "
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
    transformers = require_transformers()
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
