"""``+tile_loss`` for Hugging Face causal LMs: the model's final hidden states and its ``lm_head``, for
:func:`ctx_plugin.tiled_loss.lm_loss_sum`.

The tiled loss must reproduce exactly what the model does after its decoder. The Llama, Mistral, Qwen2 and Qwen3
causal LMs of transformers 5.x compute ``logits = lm_head(last_hidden_state)`` and nothing else (tied embeddings
and a head bias live in ``lm_head`` itself); other families scale, soft-cap or mask their logits there
(``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``, ...), which the tiled loss would drop, so they
are refused (:func:`check_model`), never approximated.

:func:`hidden_states` runs the whole model through whatever calls it (e.g. a DeepSpeed engine, whose forward must
run: it hooks its outputs to prepare backward) while its ``lm_head`` hands its input through, so the model's
``logits`` field is the final hidden state ``[batch, seq, hidden]`` and no logits are computed in forward.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn

_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_LOGIT_OPTIONS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _classes() -> tuple[type, ...]:
    import transformers

    return tuple(getattr(transformers, name) for name in _FAMILIES)


def check_model(model: nn.Module) -> nn.Linear:
    """The model's ``lm_head`` when the tiled loss reproduces its logits exactly; ValueError naming the reason
    otherwise (the model's class, a logits option, a head that is not a linear layer)."""
    if type(model) not in _classes():
        raise ValueError(f"+tile_loss on Hugging Face models supports {', '.join(_FAMILIES)} (their logits are "
                         f"lm_head(last hidden state), nothing else), not {type(model).__name__}: other families "
                         f"scale, soft-cap or mask their logits after the head; drop +tile_loss for this model")
    config = model.config
    for name in _LOGIT_OPTIONS:
        value = getattr(config, name, None)
        if value is not None and value != 1:
            raise ValueError(f"+tile_loss: {type(model).__name__} has config.{name}={value!r}, which changes the "
                             f"logits after lm_head and the tiled loss would not apply; drop +tile_loss")
    if getattr(config, "tie_last_hidden_states", True) is False:
        raise ValueError("+tile_loss: config.tie_last_hidden_states=False is not supported (the tiled loss reads the "
                         "model's final hidden state)")
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"+tile_loss: the model's lm_head is {type(head).__name__}, not torch.nn.Linear; drop "
                         f"+tile_loss")
    return head


@contextmanager
def _head_passes_input(head: nn.Linear):
    """``head(x)`` returns ``x`` inside (its module hooks still run, e.g. ZeRO-3's parameter fetch)."""
    if "forward" in vars(head):
        raise RuntimeError("the lm_head's forward is already replaced on the instance; ctx_plugin's tiled loss needs "
                           "the class's own forward")
    head.forward = lambda x: x
    try:
        yield
    finally:
        del head.forward


def hidden_states(call: Callable, model: nn.Module, **inputs) -> tuple[torch.Tensor, nn.Linear]:
    """(final hidden states ``[batch, seq, hidden]``, ``lm_head``) of ``call(**inputs)``, where ``call`` runs
    ``model`` (the model itself or a wrapper such as a DeepSpeed engine); no logits are computed."""
    head = check_model(model)
    with _head_passes_input(head):
        out = call(**inputs)
    hidden = out.logits
    if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != head.in_features:
        raise RuntimeError(f"{type(model).__name__}'s output did not come from lm_head(hidden states) "
                           f"({tuple(getattr(hidden, 'shape', ()))}); +tile_loss cannot be applied")
    return hidden, head
