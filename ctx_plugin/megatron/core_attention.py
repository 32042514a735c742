"""ctx_plugin's attention as megatron-core's ``core_attention`` (imports megatron.core)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..api import cp_attention
from ..config import CPConfig
from ..groups import CPGroups, build_cp_groups
from .options import check_model_options

_MASK_TYPES = (AttnMaskType.causal, AttnMaskType.no_mask)


class GroupsProvider:
    """Builds the :class:`CPGroups` of one context-parallel process group once and hands the same object to
    every layer (the hybrid's subgroups are created once per model, not per layer)."""

    def __init__(self, cp_config: CPConfig) -> None:
        self.cp_config = cp_config
        self._groups: dict[int, tuple[dist.ProcessGroup | None, CPGroups]] = {}

    def get(self, group: dist.ProcessGroup | None) -> CPGroups:
        key = id(group)
        if key not in self._groups:
            self._groups[key] = (group, build_cp_groups(self.cp_config, group=group))
        return self._groups[key][1]


def context_parallel_group(pg_collection=None) -> dist.ProcessGroup | None:
    """Megatron's context-parallel group: ``pg_collection.cp`` when given, else parallel_state's."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and dist.is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    return group


class CPCoreAttention(MegatronModule):
    """Core attention running :func:`ctx_plugin.cp_attention` over Megatron's context-parallel group.

    Takes Megatron's ``[s, b, heads, dim]`` query and ``[s, b, groups, dim]`` key/value (GQA not expanded) and
    returns ``[s, b, heads·dim]``. Causal and no-mask types, applied by the attention itself: a mask tensor is an
    error (:func:`ctx_plugin.megatron.spec.shard_batch` checks that the dataloader's mask is the causal one and
    drops it). Every option it does not implement (options.py: sliding windows, softmax offsets, QK-clip, MLA,
    FP8 attention, dropout, ...; padding/arbitrary masks, attention bias, packed sequences) is an error."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: str | None = None, softmax_scale: float | None = None, pg_collection=None, *,
                 cp_config: CPConfig, groups_provider: GroupsProvider, **kwargs) -> None:
        super().__init__(config=config)
        check_model_options(config)
        if kwargs:
            raise TypeError(f"ctx_plugin's core attention got arguments it does not implement: {sorted(kwargs)} "
                            f"(megatron-core {_megatron_version()} passes ones this ctx_plugin does not know)")
        if attention_type != "self":
            raise ValueError(f"ctx_plugin's core attention supports self-attention only, not {attention_type!r}")
        if attn_mask_type not in _MASK_TYPES:
            raise ValueError(f"ctx_plugin's core attention supports causal and no_mask attention, not "
                             f"{attn_mask_type.name}")
        if cp_comm_type not in (None, "p2p"):
            raise ValueError(f"cp_comm_type={cp_comm_type!r} (--cp-comm-type) conflicts with ctx_plugin's backend "
                             f"{cp_config.backend}, which replaces Megatron's context-parallel communication; drop it "
                             f"(for all-to-all use --cp-backend ulysses or ulysses_ring)")
        group = context_parallel_group(pg_collection)
        size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if config.context_parallel_size != size:
            raise ValueError(f"context_parallel_size={config.context_parallel_size} in the TransformerConfig but the "
                             f"context-parallel group has {size} ranks (RoPE and sequence lengths use the config's); "
                             f"make them equal")
        self.layer_number, self.attn_mask_type = layer_number, attn_mask_type
        self.cp_config = cp_config
        self.groups = groups_provider.get(group)
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                attn_mask_type: AttnMaskType | None = None, attention_bias=None, packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if mask_type not in _MASK_TYPES:
            raise ValueError(f"ctx_plugin's core attention supports causal and no_mask attention, not {mask_type.name}")
        if attention_bias is not None:
            raise ValueError("ctx_plugin's core attention does not support attention_bias")
        if packed_seq_params is not None:
            raise ValueError("ctx_plugin's core attention does not support packed sequences (packed_seq_params) yet")
        if attention_mask is not None:
            raise ValueError(f"ctx_plugin's core attention got an attention_mask with attn_mask_type "
                             f"{mask_type.name}; it applies the causal mask itself and cannot apply others. Megatron's "
                             f"dataloader mask is checked and dropped by ctx_plugin's batch sharder (the entry point "
                             f"python -m ctx_plugin.megatron.pretrain_gpt, or ctx_plugin.megatron.spec.shard_batch); "
                             f"otherwise pass --no-create-attention-mask-in-dataloader")
        s, b, heads, dim = query.shape
        scale = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(dim)
        out = cp_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                           config=self.cp_config, groups=self.groups, causal=mask_type == AttnMaskType.causal,
                           softmax_scale=scale)
        return out.transpose(0, 1).reshape(s, b, heads * dim)


def _megatron_version() -> str:
    from megatron.core import package_info

    return package_info.__version__
