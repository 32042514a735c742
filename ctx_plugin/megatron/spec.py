"""Layer specs whose core attention is ctx_plugin's, positions for RoPE, and batch sharding (imports megatron)."""
from __future__ import annotations

import copy

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from .. import recompute as recompute_presets
from ..api import sequence_positions, shard_sequence
from ..config import CPConfig
from ..groups import CPGroups
from .args import MegatronCPSettings
from .core_attention import CPCoreAttention, GroupsProvider, context_parallel_group


def gpt_layer_spec(cp_config: CPConfig, *, base: ModuleSpec | None = None,
                   groups_provider: GroupsProvider | None = None) -> ModuleSpec:
    """``base`` (default: Megatron's local GPT layer spec; a per-layer ``TransformerBlockSubmodules`` too)
    with only its core attention replaced."""
    spec = copy.deepcopy(base if base is not None else get_gpt_layer_local_spec())
    provider = groups_provider if groups_provider is not None else GroupsProvider(cp_config)
    core = ModuleSpec(module=CPCoreAttention, params={"cp_config": cp_config, "groups_provider": provider})
    for layer in getattr(spec, "layer_specs", None) or [spec]:
        attention = getattr(getattr(layer, "submodules", None), "self_attention", None)
        if attention is None or not hasattr(attention.submodules, "core_attention"):
            raise ValueError("this layer spec has no self_attention.submodules.core_attention to replace; "
                             "ctx_plugin supports GPT layer specs with self-attention")
        attention.submodules.core_attention = core
    return spec


def layer_spec(model_config=None, vp_stage=None) -> ModuleSpec:
    """For ``--spec ctx_plugin.megatron.spec layer_spec``: Megatron's local or Transformer-Engine spec (by
    ``--transformer-impl``) with ctx_plugin's core attention configured by the ``--cp-*`` flags."""
    from megatron.training import get_args

    from .args import settings_from_args

    args = get_args()
    settings = settings_from_args(args)
    if args.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        base = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    else:
        base = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization)
    return gpt_layer_spec(settings.cp_config, base=base)


class LayoutRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding returning the frequencies of the global positions this rank holds in the
    backend's layout (Megatron's own slices zigzag-wise). Install with :func:`use_layout_rope`."""

    ctx_plugin_config: CPConfig
    ctx_plugin_groups: CPGroups

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq:
            raise ValueError("ctx_plugin does not support packed sequences with RoPE yet")
        positions = sequence_positions(max_seq_len, config=self.ctx_plugin_config, groups=self.ctx_plugin_groups,
                                       device=self.inv_freq.device).to(self.inv_freq.dtype)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions + offset, self.inv_freq)
        if self.rotary_interleaved:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]


def use_layout_rope(model, cp_config: CPConfig, groups: CPGroups) -> None:
    """Makes ``model.rotary_pos_emb`` (GPTModel with RoPE) layout-aware; no-op for models without RoPE."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        return
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"unsupported rotary embedding {type(rope).__name__} (need megatron's RotaryEmbedding)")
    rope.__class__ = LayoutRotaryEmbedding          # keeps inv_freq and every setting of the original
    rope.ctx_plugin_config, rope.ctx_plugin_groups = cp_config, groups


_SEQ_DIM = {"attention_mask": 2}
_PACKED = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen")


def shard_batch(batch: dict, *, config: CPConfig, groups: CPGroups) -> dict:
    """This rank's part of a Megatron batch (tokens, labels, loss_mask, position_ids, attention_mask, ...) in the
    backend's layout: the replacement for ``get_batch_on_this_cp_rank``. Labels must be pre-shifted."""
    packed = [k for k in _PACKED if batch.get(k) is not None]
    if packed:
        raise ValueError(f"packed sequences ({', '.join(packed)}) are not supported by ctx_plugin yet")
    return {key: None if value is None else shard_sequence(value, config=config, groups=groups,
                                                           dim=_SEQ_DIM.get(key, 1))
            for key, value in batch.items()}


def prepare_model(model, settings: MegatronCPSettings, groups_provider: GroupsProvider, pg_collection=None):
    """After building a GPTModel with :func:`gpt_layer_spec`: layout-aware RoPE, and the recompute preset when
    ctx_plugin (not Megatron) applies it. Returns the model's :class:`CPGroups`."""
    groups = groups_provider.get(context_parallel_group(pg_collection))
    use_layout_rope(model, settings.cp_config, groups)
    if settings.megatron_recompute is None:
        recompute_presets.apply(model.decoder.layers, settings.recompute, groups=groups)
    return groups
